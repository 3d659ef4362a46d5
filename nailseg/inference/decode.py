"""Photos from files to RGB uint8 C×H×W tensors on the device predict runs on.

On a GPU, JPEGs come from the workers as bytes and are decoded there in batches by nvJPEG, their
EXIF orientation (read on the CPU) applied there, as nvJPEG ignores it. Any other format, a JPEG
nvJPEG refuses (CMYK, say), and every photo on the CPU is decoded by `read_rgb`, prepare's
decoder, which names what is wrong with a broken file.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from nailseg.inference.photos import Photo
from nailseg.inference.spec import image_tensors
from nailseg.inference.workers import EncodedJpeg, Loaded
from nailseg.prep.imageio import UnreadableImage, read_rgb


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A C×H×W image turned upright by its EXIF orientation, as `imageio` turns a decoded one."""
    h, w = 1, 2
    turns = {
        2: lambda x: x.flip(w),
        3: lambda x: x.flip(h, w),
        4: lambda x: x.flip(h),
        5: lambda x: x.transpose(h, w),
        6: lambda x: x.rot90(-1, (h, w)),
        7: lambda x: x.transpose(h, w).flip(h, w),
        8: lambda x: x.rot90(1, (h, w)),
    }
    turn = turns.get(orientation)
    return turn(image).contiguous() if turn else image


def to_device(
    photos: Sequence[Photo], loaded: Sequence[Loaded], device: torch.device
) -> list[torch.Tensor | UnreadableImage]:
    """Each photo as an RGB uint8 C×H×W tensor on `device` (JPEG bytes: decoded there in one
    batch), or why it could not be decoded."""
    out: list[torch.Tensor | UnreadableImage | None] = [None] * len(loaded)
    decoded_here = [i for i, item in enumerate(loaded) if isinstance(item, np.ndarray)]
    uploaded = image_tensors([loaded[i] for i in decoded_here], device)
    for i, image in zip(decoded_here, uploaded, strict=True):
        out[i] = image
    jpegs = [i for i, item in enumerate(loaded) if isinstance(item, EncodedJpeg)]
    if not jpegs:
        return out
    data = [torch.from_numpy(loaded[i].data) for i in jpegs]
    try:
        decoded = _decode_jpeg(data, device)
    except RuntimeError:  # one bad file fails the batch: decode them one by one
        decoded = [_decode_one(item, device) for item in data]
    for i, image in zip(jpegs, decoded, strict=True):
        if image is None:  # nvJPEG refused it: the CPU decoder decodes it or says why not
            try:
                out[i] = image_tensors([read_rgb(photos[i].path)], device)[0]
            except UnreadableImage as err:
                out[i] = err
        else:
            out[i] = orient(image, loaded[i].orientation)
    return out


def _decode_one(data: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    try:
        return _decode_jpeg(data, device)
    except RuntimeError:
        return None


def _decode_jpeg(data, device: torch.device):
    # torchvision's decoders warn at every call that they are deprecated; they run nvJPEG here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
