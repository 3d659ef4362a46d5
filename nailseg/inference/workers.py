"""What predict's worker processes run: reading photos, and writing (and scoring) each photo's
mask and overlay. This file work is mostly Python, so in processes of their own it runs under their
own GILs, not the GIL of the thread that drives the device; work comes in chunks of photos, so a
batch costs that thread a few messages. No torch here: the processes fork from the forkserver with
little to copy; all passed to and from them is pickled (numpy arrays; JPEG files as bytes).
"""

from __future__ import annotations

import errno
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from nailseg.inference.photos import Photo, Skipped, TrueMask
from nailseg.inference.scoring import ImageScore, score_image
from nailseg.lifetime import die_with_parent
from nailseg.prep.imageio import DECODE_ERRORS, UnreadableImage, exif_orientation, read_rgb
from nailseg.viz import overlay, save_png_atomic

JPEG_SUFFIXES = frozenset({".jpg", ".jpeg"})


def start_worker() -> None:
    """Each worker's start: it dies with its parent, the forkserver, which dies with the command
    (lifetime.py); it ignores Ctrl-C, which the command handles by shutting the workers down (each
    finishes what it was given; every write is atomic)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclass(frozen=True)
class EncodedJpeg:
    """A JPEG file's bytes (uint8, 1-D) and its EXIF orientation (1: as stored)."""

    data: np.ndarray
    orientation: int


Loaded = np.ndarray | EncodedJpeg  # a photo as read: decoded (RGB uint8 HxWx3), or a JPEG's bytes


def load(photo: Photo, gpu_jpeg: bool) -> Loaded:
    """A JPEG's bytes when the GPU decodes them (`gpu_jpeg`), else the decoded photo (RGB uint8
    HxWx3). Raises UnreadableImage naming the file and the fault."""
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
_NAME_REFUSED = frozenset(
    {errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.EINVAL}
)


class NotWritten(Skipped):
    """A photo predicted but not written: the filesystem refused its output name."""


# one photo to write: the photo, its image for the overlay (None: no overlay), the predicted mask
# (HxW bool) and, when scoring, its true mask or why it has none (None: not scoring)
Prediction = tuple[Photo, np.ndarray | None, np.ndarray, TrueMask | str | None]


@dataclass(frozen=True)
class PhotoWriter:
    """Writes photos' masks and overlays into `output` and scores the masks. Every file gets the
    run's `stamp` as its modification time: what tells predict's outputs from files put in their
    place (output.py)."""

    output: Path
    stamp: int

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
        """A name the filesystem refuses (too long, a folder in the way) leaves that photo out,
        named: the other photos are still written."""
        mask = pred.astype(np.uint8) * 255
        # zlib's fastest level: encoding overlays bounds predict's speed; the files grow a little
        try:
            masks, overlays = self.output / "masks", self.output / "overlays"
            save_png_atomic(masks / f"{photo.key}.png", mask, 1, self.stamp)
            if image is not None:
                save_png_atomic(overlays / f"{photo.key}.png", overlay(image, pred), 1, self.stamp)
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
