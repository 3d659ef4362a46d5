"""Per-step values handed to the loggers without waiting for the device (Lightning's `on_step`
logging calls `.item()`, which waits for every queued step): a logged step's values are copied
to pinned host memory behind its work, and logged once a later step finds the copy done.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.loggers import Logger


def logs_step(trainer: L.Trainer, step: int) -> bool:
    """Whether Lightning logs optimizer step `step` (0-based), by its own rule
    (`_LoggerConnector.should_update_logs`)."""
    every = trainer.log_every_n_steps
    every_nth = every > 0 and ((step + 1) % every == 0 or trainer.should_stop)
    return bool(trainer.fast_dev_run) or every_nth


@dataclass
class _Pending:
    step: int
    epoch: int
    values: dict[str, torch.Tensor]  # host scalars; filled once `copied` completes
    copied: torch.cuda.Event | None  # None: the values were on the host already


class StepValues:
    """A queue of logged steps' values on their way from the device to the loggers."""

    def __init__(self) -> None:
        self._pending: deque[_Pending] = deque()

    def record(self, values: Mapping[str, torch.Tensor], step: int, epoch: int) -> None:
        """Queue scalar tensors as optimizer step `step`'s (on a GPU copied in stream order)."""
        device = next(iter(values.values())).device
        if device.type != "cuda":
            host = {name: value.detach() for name, value in values.items()}
            self._pending.append(_Pending(step, epoch, host, None))
            return
        host = {
            name: torch.empty((), dtype=value.dtype, pin_memory=True).copy_(
                value.detach(), non_blocking=True
            )
            for name, value in values.items()
        }
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(device))
        self._pending.append(_Pending(step, epoch, host, copied))

    def hand_over(self, loggers: Iterable[Logger], wait: bool = False) -> None:
        """Log the queued steps whose values have arrived, as Lightning would; `wait`: all."""
        loggers = list(loggers)
        while self._pending and (wait or _arrived(self._pending[0])):
            pending = self._pending.popleft()
            if wait and pending.copied is not None:
                pending.copied.synchronize()
            metrics = {name: value.item() for name, value in pending.values.items()}
            metrics["epoch"] = pending.epoch
            for logger in loggers:
                logger.log_metrics(metrics, step=pending.step)


def _arrived(pending: _Pending) -> bool:
    return pending.copied is None or pending.copied.query()
