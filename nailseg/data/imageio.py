"""Decode users' image and mask files into the arrays the project stores, whatever their mode.

Images become RGB uint8 HxWx3 (grey, RGBA, palette and 16-bit converted; EXIF orientation
applied). Masks become one uint8 channel HxW of their raw values (binarised later, by `binarise`):
an RGB(A) mask is reduced by the max over its colour channels so that a coloured annotation on
black (a pure red nail, say) still counts as foreground; alpha is ignored.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


class UnreadableImage(ValueError):
    """A file that cannot be decoded; the message names the file and the fault."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def _open(path: Path) -> Image.Image:
    try:
        with Image.open(path) as im:
            im.load()  # decode now: a truncated file fails here, not later
            return ImageOps.exif_transpose(im)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise UnreadableImage(path, f"cannot decode image: {err}") from err


def _to_uint8(array: np.ndarray, path: Path) -> np.ndarray:
    """16- or 32-bit integer data scaled to 8 bits by its dtype's range; 8-bit kept as is."""
    if array.dtype == np.uint8:
        return array
    if array.dtype == np.bool_:
        return array.astype(np.uint8) * 255
    if np.issubdtype(array.dtype, np.integer):
        bits = 16 if array.max(initial=0) <= 0xFFFF else 32
        return (array.astype(np.uint64) >> (bits - 8)).astype(np.uint8)
    raise UnreadableImage(path, f"unsupported pixel type {array.dtype}")


def read_rgb(path: Path) -> np.ndarray:
    """RGB uint8 HxWx3, C-order."""
    im = _open(path)
    if im.mode in ("I", "I;16", "I;16B", "I;16L"):
        grey = _to_uint8(np.asarray(im), path)
        return np.ascontiguousarray(np.repeat(grey[..., None], 3, axis=2))
    return np.ascontiguousarray(np.asarray(im.convert("RGB"), dtype=np.uint8))


def read_mask_values(path: Path) -> np.ndarray:
    """The mask's raw values as one uint8 channel HxW (see the module docstring)."""
    im = _open(path)
    if im.mode == "P":
        im = im.convert("RGBA")
    array = np.asarray(im)
    if array.ndim == 3:
        array = array[..., :3].max(axis=2) if array.shape[2] >= 3 else array[..., 0]
    return np.ascontiguousarray(_to_uint8(array, path))


def binarise(values: np.ndarray, threshold: int) -> tuple[np.ndarray, int]:
    """Mask in {0, 1}, and the number of distinct values when the input was not binary (else 0).

    Values above `threshold` are foreground; a mask stored as {0, 1} is taken as is (thresholding
    it at 127 would empty it). Noisy masks (JPEG artefacts, anti-aliased edges) are reported by
    their count of distinct values so a user sees how far from binary they were.
    """
    distinct = set(np.unique(values).tolist())
    if distinct <= {0, 1}:
        return values.astype(np.uint8), 0
    nonbinary = 0 if distinct <= {0, 255} else len(distinct)
    return (values > threshold).astype(np.uint8), nonbinary
