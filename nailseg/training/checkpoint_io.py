"""Checkpoints written the way every other output is: a temporary file in the checkpoint's own
folder, fsync'd, then renamed (nailseg/atomic.py), by a background thread.

Lightning's own save goes through fsspec's transaction, which writes the temporary file to
`$TMPDIR` and moves it into place: atomic only when `$TMPDIR` shares the checkpoint's filesystem,
and never fsync'd, so a `kill -9` or a power cut during the move left a truncated `last.ckpt`.

Why a thread: a UNet-resnet34 checkpoint with its AdamW state is ~290 MB, and its synchronous save
took 0.39 s on the H200 machine; `last.ckpt` and a new best are saved every epoch, so on the real
photos (0.6 s of training an epoch) saving was a third of the fit's wall time. Lightning's
`AsyncCheckpointIO` copies every tensor (on its device, microseconds) before returning, so the
file holds the state at the save while training goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from nailseg.atomic import write_atomic


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose saves are atomic and durable on a local filesystem."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        write_atomic(path, lambda f: torch.save(checkpoint, f))


class BackgroundCheckpointIO(AsyncCheckpointIO):
    """Atomic saves (`AtomicCheckpointIO`) in one background thread, in the order they were made.

    Removals go through the same thread: ModelCheckpoint removes the previous best right after
    saving the new one, and a removal run at once could come before that file's own queued write,
    which would then bring it back. The first error of any queued save or removal is raised at
    the next call or when the strategy tears down; teardown (end of a fit, also after an error)
    waits for every queued write, so what follows a fit (the final test, a resume) reads whole
    files.
    """

    def __init__(self) -> None:
        super().__init__(AtomicCheckpointIO())

    def remove_checkpoint(self, path: _PATH) -> None:
        self._queue(self.checkpoint_io.remove_checkpoint, path)

    def _queue(self, work: Callable[..., None], *args: Any) -> None:
        self._ensure_setup()

        def run() -> None:
            try:
                work(*args)
            except BaseException as err:  # raised in the training thread, see save_checkpoint
                self._error = err

        self._executor.submit(run)
        if self._error:
            raise self._error
