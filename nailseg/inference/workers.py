"""predict's worker processes: they read the photos (`photos.read_photos`) and write, and score,
each photo's mask and overlay, in chunks, under GILs of their own, not the one of the thread that
drives the device. They fork from multiprocessing's forkserver (forking the command, which holds
CUDA's state and threads, is unsafe). The forkserver ends when the last holder of its "client
alive" pipe closes it: each worker lets go of its inherited end at its start, leaving predict the
only holder, and dies with the forkserver; so a predict killed with `kill -9` leaves neither.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import forkserver
from pathlib import Path

import numpy as np
from PIL import Image

from nailseg.inference.photos import Photo, Skipped, TrueMask
from nailseg.inference.scoring import ImageScore, score_image
from nailseg.inference.spec import PredictError
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OwnedFolder
from nailseg.lifetime import die_with_parent
from nailseg.viz import overlay

OUTPUT_FOLDERS = ("masks", "overlays")


@contextmanager
def worker_processes(count: int, preload: str) -> Iterator[tuple[ProcessPoolExecutor, float]]:
    """`count` started workers and the seconds their start took; each starts as a copy of the
    forkserver, which imports `preload` once. A worker that dies fails the run (PredictError)."""
    start = time.perf_counter()
    context = multiprocessing.get_context("forkserver")
    # a main module run with `python -m` is imported by each worker itself: preloaded by name
    # too, runpy would warn in every worker that it ran twice
    context.set_forkserver_preload(["__main__", preload])
    with ProcessPoolExecutor(count, mp_context=context, initializer=_start_worker) as pool:
        try:
            with _ctrl_c_held():
                for started in [pool.submit(os.getpid) for _ in range(count)]:
                    started.result()
            yield pool, time.perf_counter() - start
        except BrokenProcessPool as err:
            raise PredictError(
                "a worker process reading or writing the files died (killed by the system or a "
                "signal: out of memory?), so the run stopped; its summary.json says unfinished, "
                "and a rerun into the same output folder replaces what it wrote"
            ) from err


def _start_worker() -> None:
    """Each worker dies with the forkserver, lets go of its "client alive" pipe (the module
    docstring) and ignores Ctrl-C: the command shuts the workers down (every write is atomic)."""
    die_with_parent()
    os.close(forkserver._forkserver._forkserver_alive_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Ctrl-C kept from the workers' start (main thread only): the forkserver starts with it
    ignored (it ignores Ctrl-C only once its preload is imported); one pressed after is held until
    every worker has started, then raised (at once, a half-made worker printed a traceback)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if held:
        raise KeyboardInterrupt


# what a filesystem answers to an output name it cannot hold (any other error fails the run)
_NAME_REFUSED = {errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.EINVAL}


class NotWritten(Skipped):
    """A photo predicted but not written: the filesystem refused its output name, or a file that
    is not nailseg's lies there."""


# one photo to write: the photo, its image for the overlay (None: no overlay), the predicted mask
# (HxW bool) and, when scoring, its true mask or why it has none (None: not scoring)
Prediction = tuple[Photo, np.ndarray | None, np.ndarray, TrueMask | str | None]
_attached: dict[Path, OwnedFolder] = {}  # this worker's view of the output folder


@dataclass(frozen=True)
class PhotoWriter:
    """Writes photos' masks and overlays through the output folder predict claimed, and scores
    the masks."""

    output: Path

    def __call__(self, predictions: Sequence[Prediction]) -> list[ImageScore | Skipped | None]:
        """Each photo's score, why it was not written or scored, or None (written, not scoring)."""
        return [self.write(*prediction) for prediction in predictions]

    def write(
        self,
        photo: Photo,
        image: np.ndarray | None,
        pred: np.ndarray,
        truth: TrueMask | str | None,
    ) -> ImageScore | Skipped | None:
        """A name the filesystem refuses (too long, a folder in the way), or a file of someone
        else's in the way, leaves that photo out, named: the others are still written."""
        if self.output not in _attached:
            _attached[self.output] = OwnedFolder.attach(self.output)
        folder = _attached[self.output]
        images = [pred.astype(np.uint8) * 255] + ([] if image is None else [overlay(image, pred)])
        try:
            for name, array in zip(OUTPUT_FOLDERS, images, strict=False):
                folder.write(f"{name}/{photo.key}.png", _png(array))
        except NotOursError as err:
            return NotWritten(photo.path, str(err))
        except OSError as err:
            if err.errno not in _NAME_REFUSED:
                raise
            return NotWritten(photo.path, f"cannot write {err.filename}: {err.strerror}")
        if truth is None:
            return None
        if isinstance(truth, str):
            return Skipped(photo.path, truth)
        if truth.shape != pred.shape:
            return Skipped(
                photo.path, f"mask {truth.path} is {truth.shape}, the photo is {pred.shape}"
            )
        return score_image(
            pred,
            truth.array(),
            key=photo.key,
            image=str(photo.path),
            mask=str(truth.path),
            group=photo.group,
        )


def _png(array: np.ndarray):
    """`array` as PNG, at zlib's fastest level: encoding overlays bounds predict's speed."""
    return lambda f: Image.fromarray(array).save(f, format="PNG", compress_level=1)
