"""A callback that fails any training or validation step that waits for the GPU."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch


class NoSyncInSteps(L.Callback):
    """torch's CUDA sync debug mode set to "error" while the training loop runs from one step to
    the next (forward, loss, backward, optimizer step, metric updates, the other callbacks' hooks,
    the logging every `log_every_n_steps`, the next batch's `next()`) and within each validation
    step: an `.item()`, a blocking copy or a host-side check of a device value raises there. The
    window closes at an epoch's last training batch, before the epoch-end and validation hooks
    that wait for the device on purpose (TrainSpeedMonitor's clock)."""

    def _forbid(self, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode("error")

    def _allow(self, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._allow()

    on_train_batch_start = on_validation_batch_start = _forbid
    on_validation_batch_end = on_exception = _allow
