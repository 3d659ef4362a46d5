"""A callback that fails any training or validation step that waits for the GPU."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch


class NoSyncInSteps(L.Callback):
    """torch's CUDA sync debug mode set to "error" from each step's start hook to its end hook
    (forward, loss, backward, optimizer step, metric updates and the other callbacks' hooks in
    between): an `.item()`, a blocking copy or a host-side check of a device value raises
    there. The loader's `next()` and the logging every `log_every_n_steps` lie outside."""

    def _forbid(self, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode("error")

    def _allow(self, *args: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")

    on_train_batch_start = on_validation_batch_start = _forbid
    on_train_batch_end = on_validation_batch_end = on_exception = _allow
