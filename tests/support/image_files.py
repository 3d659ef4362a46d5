"""Test inputs written as image files: random photos, box masks, any array saved as an image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def photo(h: int = 24, w: int = 32, seed: int = 0) -> np.ndarray:
    """A random RGB uint8 photo."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def box_mask(h: int = 24, w: int = 32, box: int = 6) -> np.ndarray:
    """A 0/255 mask with one square nail of side `box` at (box, box)."""
    mask = np.zeros((h, w), np.uint8)
    mask[box : 2 * box, box : 2 * box] = 255
    return mask


def save_image(path: Path, array: np.ndarray, **kwargs) -> Path:
    """An image file of `array` (HxW grey, HxWx3 RGB, HxWx4 RGBA; uint16 → 16-bit PNG)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path, **kwargs)
    return path
