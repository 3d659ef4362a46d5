"""Drawing masks over images, captioning and tiling them into one PNG (numpy + PIL), for training's
overlays and predict alike. Arrays are HxWx3 uint8 (RGB) and HxW bool masks throughout."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from nailseg.io.atomic import write_atomic

TRUTH_COLOR = (0, 255, 0)
PRED_COLOR = (255, 0, 0)
WHITE = (255, 255, 255)
CAPTION_HEIGHT = 14  # pixels: a caption strip, one line of PIL's default font


def denormalize(image: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """Undo `(x/255 - mean) / std` on a 3×H×W float image: the HxWx3 uint8 picture it came from."""
    chw = (
        image * np.asarray(std, np.float32)[:, None, None]
        + np.asarray(mean, np.float32)[:, None, None]
    )
    return (np.clip(chw, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8).transpose(1, 2, 0)


def overlay(
    image: np.ndarray, mask: np.ndarray, color: Sequence[int] = PRED_COLOR, alpha: float = 0.5
) -> np.ndarray:
    """`image` with the pixels of `mask` blended towards `color` by `alpha`."""
    if image.shape[:2] != mask.shape:
        raise ValueError(f"image {image.shape} and mask {mask.shape} differ in size")
    out = image.astype(np.float32)
    out[mask] = (1.0 - alpha) * out[mask] + alpha * np.asarray(color, np.float32)
    return (out + 0.5).astype(np.uint8)


def captioned(tile: np.ndarray, *parts: tuple[str, Sequence[int]]) -> np.ndarray:
    """`tile` above a black strip `CAPTION_HEIGHT` high holding each (text, colour) in turn."""
    strip = Image.new("RGB", (tile.shape[1], CAPTION_HEIGHT))
    draw, x = ImageDraw.Draw(strip), 2.0
    for text, color in parts:
        draw.text((x, 1), text, fill=tuple(color))
        x += draw.textlength(text)
    return np.concatenate([tile, np.asarray(strip)])


def grid(rows: Sequence[Sequence[np.ndarray]], pad: int = 2, fill: int = 255) -> np.ndarray:
    """Tile HxWx3 images row by row (one width; one height a row), `pad` pixels of `fill` between
    and around."""
    if not rows or not all(rows):
        raise ValueError("grid needs at least one non-empty row")
    w = rows[0][0].shape[1]
    if any(tile.shape != (row[0].shape[0], w, 3) for row in rows for tile in row):
        raise ValueError(f"all tiles must be {w} wide, with 3 channels, each row of one height")
    n_cols = max(len(row) for row in rows)
    height = pad + sum(row[0].shape[0] + pad for row in rows)
    canvas = np.full((height, pad + n_cols * (w + pad), 3), fill, dtype=np.uint8)
    y = pad
    for row in rows:
        h = row[0].shape[0]
        for c, tile in enumerate(row):
            x = pad + c * (w + pad)
            canvas[y : y + h, x : x + w] = tile
        y += h + pad
    return canvas


def save_png_atomic(
    path: str | os.PathLike[str],
    array: np.ndarray,
    compress_level: int = 6,
    mtime_ns: int | None = None,
) -> Path:
    """Write `array` as a PNG atomically (`write_atomic`). `compress_level`: zlib's, 1 (fastest)
    to 9; `mtime_ns`: the file's modification time."""
    return write_atomic(
        path,
        lambda f: Image.fromarray(array).save(f, format="PNG", compress_level=compress_level),
        mtime_ns,
    )
