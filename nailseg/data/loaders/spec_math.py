"""The numbers behind the spec's rotate, crop and blur, for the backends that compute them themselves.

The torch backend (one sample, OpenCV) and the Kornia backend (a batch, on the device) both call
these, so they cannot drift apart; both reproduce DALI's behaviour (dali.py), which was checked
pixel for pixel: `cv2.warpAffine` with `rotation_matrices` is DALI's `fn.rotate`, `crop_windows`
rounds like DALI's `fn.slice`, and `blur_window` is `fn.gaussian_blur`'s default window.
"""

from __future__ import annotations

import numpy as np


def rotation_matrices(
    degrees: np.ndarray, canvas_hw: np.ndarray, out_hw: tuple[int, int]
) -> np.ndarray:
    """(k, 2, 3) source -> destination pixel maps (OpenCV's warpAffine convention) rotating each
    canvas by `degrees` counter-clockwise about its centre, for an image showing that canvas
    resized to `out_hw`.

    The spec rotates the canvas before the final resize. Kornia rotates after it, so the rotation is
    conjugated with that (possibly anisotropic) resize; when `out_hw` is the canvas size this is
    exactly `cv2.getRotationMatrix2D(((w - 1) / 2, (h - 1) / 2), degrees, 1)`.
    """
    theta = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    cos, sin = np.cos(theta), np.sin(theta)
    out_h, out_w = out_hw
    sx = out_w / canvas_hw[:, 1]  # output pixels per canvas pixel, per axis
    sy = out_h / canvas_hw[:, 0]
    linear = np.stack([np.stack([cos, sin * sx / sy], -1), np.stack([-sin * sy / sx, cos], -1)], 1)
    centre = np.array([(out_w - 1) / 2, (out_h - 1) / 2])
    shift = centre - linear @ centre
    return np.concatenate([linear, shift[:, :, None]], axis=2)


def crop_windows(
    canvas_hw: np.ndarray, scale: np.ndarray, ratio: np.ndarray, u: np.ndarray, v: np.ndarray
) -> np.ndarray:
    """(k, 4) integer windows x0, y0, x1, y1 (end exclusive) of `random_resized_crop`.

    The crop has area `scale` * h * w and width / height `ratio`, each side clamped to [1, side];
    `u`, `v` in [0, 1) place it. Corners round half up, as DALI's slice does.
    """
    h, w = canvas_hw[:, 0], canvas_hw[:, 1]
    area = h * w * scale
    crop_w = np.clip(np.sqrt(area * ratio), 1.0, w)
    crop_h = np.clip(np.sqrt(area / ratio), 1.0, h)
    x0, y0 = u * (w - crop_w), v * (h - crop_h)
    corners = np.stack([x0, y0, x0 + crop_w, y0 + crop_h], axis=1)
    return np.floor(corners + 0.5).astype(np.int64)


def blur_window(sigma: float) -> int:
    """Odd kernel width that DALI's gaussian_blur uses for `sigma`: the Gaussian cut at 3 sigma."""
    return 2 * int(np.ceil(3 * sigma)) + 1
