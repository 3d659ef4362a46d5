"""predict's writer with faults. predict writes in worker processes, so a fault cannot be patched
into this process: a test has predict use this class, which the workers import by name (tests/
is on their path, as on this process's)."""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass

import numpy as np

from nailseg.inference.request import Photo, Skipped, TrueMask
from nailseg.inference.workers import ImageScore, PhotoWriter


@dataclass(frozen=True)
class FailsAfter(PhotoWriter):
    """Once `files` PNGs lie in the output folder (the run before's were removed before the first
    write: these are this run's), the next write fails: `fault="disk_full"` raises ENOSPC as a
    full disk does; `fault="killed"` kills the worker, as the kernel's out-of-memory killer does."""

    files: int = 2
    fault: str = "disk_full"

    def write(
        self, photo: Photo, image: np.ndarray | None, pred: np.ndarray, truth: TrueMask | str | None
    ) -> ImageScore | Skipped | None:
        if len(list(self.output.rglob("*.png"))) >= self.files:
            if self.fault == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            path = self.output / "masks" / f"{photo.key}.png"
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return super().write(photo, image, pred, truth)
