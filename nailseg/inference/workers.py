"""predict's worker processes: they read the photos and write and score each photo's mask and
overlay, under GILs of their own, forked from multiprocessing's forkserver (forking the command,
which holds CUDA's state, is unsafe). Each worker lets go of the forkserver's "client alive" pipe
and dies with it, so a predict killed with `kill -9` leaves no process.
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
from typing import Any

import cv2
import numpy as np
from PIL import Image

from nailseg.inference.request import Photo, PredictError, Skipped, TrueMask
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OwnedFolder
from nailseg.lifetime import die_with_parent
from nailseg.prep.imageio import DECODE_ERRORS, UnreadableImage, exif_orientation, read_rgb
from nailseg.viz import PRED_COLOR, TRUTH_COLOR, captioned, overlay

OUTPUT_FOLDERS = ("masks", "overlays")
JPEG_SUFFIXES = frozenset({".jpg", ".jpeg"})


def dice_iou(tp, fp, fn) -> tuple[Any, Any]:
    """Dice and IoU from pixel counts (scalars or arrays); 1.0 where all counts are 0."""
    tp, fp, fn = (np.asarray(x, dtype=np.float64) for x in (tp, fp, fn))
    empty = (tp + fp + fn) == 0
    dice = np.where(empty, 1.0, 2 * tp / np.maximum(2 * tp + fp + fn, 1))
    iou = np.where(empty, 1.0, tp / np.maximum(tp + fp + fn, 1))
    return dice if dice.ndim else float(dice), iou if iou.ndim else float(iou)


@dataclass(frozen=True)
class ImageScore:
    """One row of scores.csv."""

    key: str  # the photo's path relative to the input folder, without extension
    image: str  # the photo's path as given (or found under the input folder)
    mask: str
    group: str
    height: int
    width: int
    tp: int
    fp: int
    fn: int
    dice: float
    iou: float


def score_image(
    pred: np.ndarray, truth: np.ndarray, *, key: str, image: str, mask: str, group: str
) -> ImageScore:
    """Scores of one predicted mask against its true mask (both HxW bool, one size)."""
    tp = int(np.count_nonzero(pred & truth))
    fp = int(np.count_nonzero(pred & ~truth))
    fn = int(np.count_nonzero(~pred & truth))
    dice, iou = dice_iou(tp, fp, fn)
    return ImageScore(key, image, mask, group, *pred.shape, tp, fp, fn, dice, iou)


@contextmanager
def worker_processes(count: int) -> Iterator[tuple[ProcessPoolExecutor, float]]:
    """`count` started workers, copies of the forkserver (which imports this module, not torch),
    and the seconds their start took. A worker that dies fails the run (PredictError)."""
    start = time.perf_counter()
    context = multiprocessing.get_context("forkserver")
    # a main module run with `python -m` is imported by each worker itself: preloaded by name
    # too, runpy would warn in every worker that it ran twice
    context.set_forkserver_preload(["__main__", __name__])
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
    ignored; one pressed after is raised once every worker has started."""
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


@dataclass(frozen=True)
class EncodedJpeg:
    """A JPEG file's bytes (uint8, 1-D) and its EXIF orientation (1: as stored)."""

    data: np.ndarray
    orientation: int


Loaded = np.ndarray | EncodedJpeg  # a photo as read: decoded (RGB uint8 HxWx3), or a JPEG's bytes


def load(photo: Photo, gpu_jpeg: bool) -> Loaded:
    """A JPEG's bytes when the GPU decodes them (`gpu_jpeg`), else the decoded RGB photo."""
    if not (gpu_jpeg and photo.path.suffix.lower() in JPEG_SUFFIXES):
        return read_rgb(photo.path)
    try:
        with Image.open(photo.path) as im:  # the header only: format check and EXIF
            if im.format != "JPEG":
                return read_rgb(photo.path)
            orientation = exif_orientation(im)
        data = np.fromfile(photo.path, dtype=np.uint8)  # read once, writable (torch takes it)
    except DECODE_ERRORS as err:
        raise UnreadableImage(photo.path, f"cannot decode image: {err}") from err
    return EncodedJpeg(data, orientation)


def read_photos(photos: Sequence[Photo], gpu_jpeg: bool) -> list[Loaded | UnreadableImage]:
    """Each photo loaded (`load`), or why it could not be."""
    loaded: list[Loaded | UnreadableImage] = []
    for photo in photos:
        try:
            loaded.append(load(photo, gpu_jpeg))
        except UnreadableImage as err:
            loaded.append(err)
    return loaded


# what a filesystem answers to an output name it cannot hold (any other error fails the run)
_NAME_REFUSED = {errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.EINVAL}


class NotWritten(Skipped):
    """A photo predicted, not written: its name refused, or a file not nailseg's in the way."""


# one photo to write: the photo, its image for the overlay (None: no overlay), the predicted mask
# (HxW bool) and, when scoring, its true mask or why it has none (None: not scoring)
Prediction = tuple[Photo, np.ndarray | None, np.ndarray, TrueMask | str | None]
_attached: dict[Path, OwnedFolder] = {}  # this worker's view of the output folder


@dataclass(frozen=True)
class PhotoWriter:
    """Writes photos' masks and overlays into predict's claimed folder, and scores the masks."""

    output: Path

    def __call__(self, predictions: Sequence[Prediction]) -> list[ImageScore | Skipped | None]:
        """Each photo's score, why it was not written or scored, or None (written, not scoring)."""
        return [self.write(*prediction) for prediction in predictions]

    def write(
        self, photo: Photo, image: np.ndarray | None, pred: np.ndarray, truth: TrueMask | str | None
    ) -> ImageScore | Skipped | None:
        """A name the filesystem refuses (too long, a folder in the way), or a file of someone
        else's in the way, leaves that photo out, named: the others are still written."""
        if self.output not in _attached:
            _attached[self.output] = OwnedFolder.attach(self.output)
        folder = _attached[self.output]
        true = truth.array() if isinstance(truth, TrueMask) and truth.shape == pred.shape else None
        score = None
        if true is not None:
            where = {"image": str(photo.path), "mask": str(truth.path), "group": photo.group}
            score = score_image(pred, true, key=photo.key, **where)
        images = [pred.astype(np.uint8) * 255]
        images += [] if image is None else [_overlay(image, pred, true, score)]
        try:
            for name, array in zip(OUTPUT_FOLDERS, images, strict=False):
                folder.write(f"{name}/{photo.key}.png", _png(array))
        except NotOursError as err:
            return NotWritten(photo.path, str(err))
        except OSError as err:
            if err.errno not in _NAME_REFUSED:
                raise
            return NotWritten(photo.path, f"cannot write {err.filename}: {err.strerror}")
        if isinstance(truth, str):
            return Skipped(photo.path, truth)
        if truth is not None and true is None:
            return Skipped(
                photo.path, f"mask {truth.path} is {truth.shape}, the photo is {pred.shape}"
            )
        return score


def _overlay(
    image: np.ndarray, pred: np.ndarray, true: np.ndarray | None, score: ImageScore | None
) -> np.ndarray:
    """The predicted mask blended in red; with a true mask, its outline in green over it and a
    strip below naming the colours and the photo's Dice."""
    shown = overlay(image, pred)
    if true is None or score is None:
        return shown
    cross = cv2.getStructuringElement(cv2.MORPH_CROSS, (3, 3))  # inside: every 4-neighbour true
    shown[true & ~cv2.erode(true.view(np.uint8), cross).astype(bool)] = TRUTH_COLOR
    words = f"  true outline  Dice {score.dice:.3f}"
    return captioned(shown, ("predicted", PRED_COLOR), (words, TRUTH_COLOR))


def _png(array: np.ndarray):
    """`array` as PNG, at zlib's fastest level: encoding overlays bounds predict's speed."""
    return lambda f: Image.fromarray(array).save(f, format="PNG", compress_level=1)
