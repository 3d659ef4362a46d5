"""Decode users' image and mask files into the arrays the project stores, whatever their mode.

Images become RGB uint8 HxWx3, EXIF orientation applied. Deep images are scaled by their real bit
depth: the PNG's `sBIT`, else the smallest of 10/12/14/16 bits that holds the maximum (a 12-bit
image in a 16-bit file does not turn near black); 16-bit colour is decoded by OpenCV (PIL cuts it
to 8 bits); a float image is scaled from [0, 1]. Masks become their raw label values, HxW: an
RGB(A) mask the max over its colours, a palette mask its index (0 background, any other nail).
"""

from __future__ import annotations

import struct
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from nailseg.errors import ConfigError

DEPTHS = (10, 12, 14, 16, 32)  # candidate bit depths of deep images, smallest first
MASK_VALUE_MAX = 65535  # of a 16-bit mask: a threshold at or above it leaves every mask empty
_INT_MODES = frozenset({"I", "I;16", "I;16B", "I;16L"})
# what PIL raises on a file it cannot decode (a broken header, truncated data, a decompression bomb)
DECODE_ERRORS = (OSError, SyntaxError, ValueError, struct.error, Image.DecompressionBombError)
_EXIF_ORIENTATION = 0x0112
# each EXIF orientation's transpose that turns the image upright, as PIL's exif_transpose turns it
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


class UnreadableImage(ValueError):
    """A file that cannot be decoded; the message names the file and the fault."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self):  # pickled by its arguments: predict's worker processes raise it
        return type(self), (self.path, self.reason)


def _png_depth(path: Path) -> tuple[int, int | None]:
    """(bits per sample from IHDR, significant bits from sBIT or None): PIL reads no sBIT."""
    depth, colour, significant = 8, 0, None
    with open(path, "rb") as f:
        f.read(8)  # the PNG signature
        while len(header := f.read(8)) == 8:
            length, kind = struct.unpack(">I4s", header)
            if kind in (b"IDAT", b"IEND"):
                break
            data = f.read(length)
            f.seek(4, 1)  # CRC
            if kind == b"IHDR" and length >= 10:
                depth, colour = data[8], data[9]
            elif kind == b"sBIT" and data:
                significant = max(data[:3] if colour in (2, 6) else data[:1])
    return depth, significant


def _file_depth(im: Image.Image, path: Path) -> tuple[int, int | None]:
    """(bits per sample in the file, significant bits when the file says)."""
    if im.format == "PNG":
        return _png_depth(path)
    if im.format == "TIFF":
        return max(im.tag_v2.get(258, (8,))), None
    return 8, None


def exif_orientation(im: Image.Image) -> int:
    """The image's EXIF orientation (1..8; 1 when none or unreadable). Only this tag is read: a
    malformed tag elsewhere stopped PIL's exif_transpose, which rewrites the whole EXIF."""
    try:
        value = im.getexif().get(_EXIF_ORIENTATION, 1)
    except (*DECODE_ERRORS, TypeError):
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _upright(im: Image.Image) -> Image.Image:
    method = _UPRIGHT.get(exif_orientation(im))
    return im if method is None else im.transpose(method)


def file_orientation(path: Path) -> int:
    """The file's EXIF orientation (`exif_orientation`); 1 when it cannot be read."""
    try:
        with Image.open(path) as im:
            return exif_orientation(im)
    except DECODE_ERRORS:
        return 1


def _stored(shape: tuple[int, ...], orientation: int) -> tuple[int, ...]:
    """The (height, width) a file holds, of an image `shape` once turned upright."""
    return tuple(shape[1::-1]) if orientation >= 5 else tuple(shape[:2])


def orientation_mismatch(
    image: Path, mask: Path, image_shape: tuple[int, ...], mask_shape: tuple[int, ...]
) -> str | None:
    """Why a mask and its image, each turned upright by its own EXIF orientation, may not line
    up when the two orientations differ; None when they agree, or the mask fits the image as
    shown only (drawn on the upright photo), or fits neither way (a plain size mismatch)."""
    ours, theirs = file_orientation(image), file_orientation(mask)
    if ours == theirs or _stored(image_shape, ours) != _stored(mask_shape, theirs):
        return None
    tags = f"EXIF orientation {ours} on the image, {theirs} on the mask"
    if tuple(image_shape[:2]) != tuple(mask_shape[:2]):
        return (
            f"{tags}: the mask fits the image as stored, not as shown upright (drawn ignoring "
            "the tag?): save the mask with the image's orientation tag, or both upright"
        )
    return (
        f"{tags}, and the mask fits the image both as stored and as shown upright, so which "
        "it was drawn on cannot be told: save both upright, or with one orientation tag"
    )


def _decode(path: Path) -> tuple[Image.Image | np.ndarray, int, int | None]:
    """A PIL image turned upright, or deep colour as uint16 RGB; its bits and significant bits."""
    try:
        with Image.open(path) as im:
            depth, significant = _file_depth(im, path)
            if depth > 8 and im.mode in ("RGB", "RGBA", "LA"):
                return _deep_colour(path), depth, significant
            im.load()  # decode now: a truncated file fails here, not later
            return _upright(im), depth, significant
    except DECODE_ERRORS as err:
        raise UnreadableImage(path, f"cannot decode image: {err}") from err


def _deep_colour(path: Path) -> np.ndarray:
    """16-bit colour as uint16 RGB (OpenCV applies the EXIF orientation)."""
    bgr = cv2.imread(str(path), cv2.IMREAD_COLOR | cv2.IMREAD_ANYDEPTH)
    if bgr is None:
        raise UnreadableImage(path, "cannot decode 16-bit colour image")
    return np.ascontiguousarray(bgr[..., ::-1])


def _significant(array: np.ndarray, depth: int, significant: int | None) -> tuple[np.ndarray, int]:
    """Deep data and the bit depth it is scaled by: the declared significant bits (of data above
    them, the spec's scaled-up form, the top bits), else the smallest depth holding the max."""
    top = int(array.max(initial=0))
    if not significant:
        return array, next((bits for bits in DEPTHS if top < 1 << bits), DEPTHS[-1])
    if significant < depth and top >= 1 << significant:
        return array >> (depth - significant), significant
    return array, significant


def _to_uint8(array: np.ndarray, bits: int) -> np.ndarray:
    """Scale `bits`-deep integers to 0..255, rounding (a 16-bit v * 257 becomes v)."""
    top = (1 << bits) - 1
    clipped = np.clip(array.astype(np.int64), 0, top)
    return ((clipped * 255 + top // 2) // top).astype(np.uint8)


def decode_rgb(path: Path) -> tuple[np.ndarray, int]:
    """RGB uint8 HxWx3, C-order, and the bit depth it was scaled from (8: not scaled)."""
    decoded, depth, significant = _decode(path)
    if isinstance(decoded, np.ndarray):
        deep = decoded
    elif decoded.mode == "F":
        return _float_to_uint8(path, np.asarray(decoded)), 32
    elif decoded.mode in _INT_MODES:
        deep = np.repeat(np.asarray(decoded)[..., None], 3, axis=2)
    else:
        return np.ascontiguousarray(np.asarray(decoded.convert("RGB"), dtype=np.uint8)), 8
    values, bits = _significant(deep, depth, significant)
    return np.ascontiguousarray(_to_uint8(values, bits)), bits


def _float_to_uint8(path: Path, values: np.ndarray) -> np.ndarray:
    """A float image in [0, 1] as RGB uint8; other values (NaN included) are refused."""
    if not np.isfinite(values).all():
        raise UnreadableImage(path, "float image holding NaN or infinite values")
    low, high = float(values.min(initial=0.0)), float(values.max(initial=0.0))
    if low < 0.0 or high > 1.0:
        raise UnreadableImage(
            path,
            f"float image with values beyond [0, 1] (down to {low:g}, up to {high:g}): only "
            "[0, 1] has a known scale; save it as 8- or 16-bit integers",
        )
    grey = np.round(values * 255).astype(np.uint8)
    return np.ascontiguousarray(np.repeat(grey[..., None], 3, axis=2))


def read_rgb(path: Path) -> np.ndarray:
    """RGB uint8 HxWx3, C-order."""
    return decode_rgb(path)[0]


def read_mask_values(path: Path) -> np.ndarray:
    """The mask's raw label values, one integer channel HxW (alpha ignored; a palette by index,
    never by colour, as indexed label files of VOC and CVAT mean it)."""
    decoded, *_ = _decode(path)
    if isinstance(decoded, np.ndarray):
        array = decoded
    elif decoded.mode in ("P", "PA"):
        return (np.asarray(decoded.getchannel(0)) != 0).astype(np.uint8)
    else:
        array = np.asarray(decoded)
    if array.ndim == 3:
        array = array[..., :3].max(axis=2) if array.shape[2] >= 3 else array[..., 0]
    if array.dtype == np.bool_:
        return array.astype(np.uint8)
    if not np.issubdtype(array.dtype, np.integer):
        raise UnreadableImage(path, f"unsupported pixel type {array.dtype}")
    return np.ascontiguousarray(array)


def check_mask_threshold(threshold: int) -> None:
    """Refuse a `mask_threshold` that `binarise` cannot use."""
    if not 0 <= threshold < MASK_VALUE_MAX:
        raise ConfigError(
            f"mask_threshold={threshold} is outside 0..{MASK_VALUE_MAX - 1}: a mask value above "
            "it is nail (8-bit masks hold 0..255, 16-bit ones 0..65535)"
        )


def binarise(values: np.ndarray, threshold: int) -> tuple[np.ndarray, int]:
    """Mask in {0, 1}: values above `threshold`, a {0, 1} mask as it is; and, for a mask that was
    not binary ({0, 255} and {0, the type's max} are), its count of distinct values, else 0."""
    distinct = set(np.unique(values).tolist())
    if distinct <= {0, 1}:
        return values.astype(np.uint8), 0
    binary = distinct <= {0, 255} or distinct <= {0, int(np.iinfo(values.dtype).max)}
    return (values > threshold).astype(np.uint8), 0 if binary else len(distinct)
