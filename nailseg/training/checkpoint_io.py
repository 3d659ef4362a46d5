"""Checkpoints written the way every other output is: a temporary file in the checkpoint's own
folder, fsync'd, then renamed (nailseg/atomic.py).

Lightning's own save goes through fsspec's transaction, which writes the temporary file to
`$TMPDIR` and moves it into place: atomic only when `$TMPDIR` shares the checkpoint's filesystem,
and never fsync'd, so a `kill -9` or a power cut during the move left a truncated `last.ckpt`.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from nailseg.atomic import write_atomic


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose saves are atomic and durable on a local filesystem."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        write_atomic(path, lambda f: torch.save(checkpoint, f))
