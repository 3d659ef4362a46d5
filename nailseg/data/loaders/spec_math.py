"""The numbers behind the spec's geometric and colour ops, shared by the torch backend (one
sample, OpenCV) and the Kornia backend (a batch), so both match DALI's `fn.rotate`, `fn.slice`,
`fn.gaussian_blur` and `fn.hsv` (tests/data/test_loader_parity.py).
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


def _place(
    canvas_hw: np.ndarray, win_h: np.ndarray, win_w: np.ndarray, u: np.ndarray, v: np.ndarray
) -> np.ndarray:
    """(k, 4) integer windows x0, y0, x1, y1 (end exclusive) of the given sides, placed by `u`,
    `v` in [0, 1) over the room between window and canvas (negative when the window is larger).
    Corners round half up, as DALI's slice does."""
    x0, y0 = u * (canvas_hw[:, 1] - win_w), v * (canvas_hw[:, 0] - win_h)
    corners = np.stack([x0, y0, x0 + win_w, y0 + win_h], axis=1)
    return np.floor(corners + 0.5).astype(np.int64)


def crop_windows(
    canvas_hw: np.ndarray, scale: np.ndarray, ratio: np.ndarray, u: np.ndarray, v: np.ndarray
) -> np.ndarray:
    """The windows of `random_resized_crop`: area `scale` * h * w and width / height `ratio`,
    each side clamped to [1, side]."""
    h, w = canvas_hw[:, 0], canvas_hw[:, 1]
    area = h * w * scale
    crop_w = np.clip(np.sqrt(area * ratio), 1.0, w)
    crop_h = np.clip(np.sqrt(area / ratio), 1.0, h)
    return _place(canvas_hw, crop_h, crop_w, u, v)


def zoom_windows(
    canvas_hw: np.ndarray, scale: np.ndarray, u: np.ndarray, v: np.ndarray
) -> np.ndarray:
    """The windows of `zoom_out`: each side 1 / `scale` times the canvas's, around it (x0, y0 <= 0:
    the part outside the canvas is filled with 0)."""
    return _place(canvas_hw, canvas_hw[:, 0] / scale, canvas_hw[:, 1] / scale, u, v)


def blur_window(sigma: float) -> int:
    """Odd kernel width that DALI's gaussian_blur uses for `sigma`: the Gaussian cut at 3 sigma."""
    return 2 * int(np.ceil(3 * sigma)) + 1


# DALI's colour space for hue and saturation: chroma turns and scales in YIQ, and returns to RGB
# through the exact inverse of this matrix.
_RGB_TO_YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.321], [0.211, -0.523, 0.311]])
_YIQ_TO_RGB = np.linalg.inv(_RGB_TO_YIQ)


def colour_matrices(hue_degrees: np.ndarray, saturation: np.ndarray) -> np.ndarray:
    """(k, 3, 3) float32 RGB -> RGB matrices (out = M @ rgb) of DALI's `fn.hsv(hue, saturation)`."""
    theta = np.deg2rad(np.asarray(hue_degrees, dtype=np.float64))
    cos = np.cos(theta) * saturation
    sin = np.sin(theta) * saturation
    twist = np.zeros((len(theta), 3, 3))
    twist[:, 0, 0] = 1.0
    twist[:, 1, 1], twist[:, 1, 2], twist[:, 2, 1], twist[:, 2, 2] = cos, sin, -sin, cos
    return (_YIQ_TO_RGB @ twist @ _RGB_TO_YIQ).astype(np.float32)


def colour_params(op_name: str, draw: float) -> tuple[float, float]:
    """(hue degrees, saturation) of one colour-matrix op (`hue`, `saturation`, `grayscale`) given
    its drawn parameter (ignored by grayscale)."""
    return {"hue": (draw, 1.0), "saturation": (0.0, draw), "grayscale": (0.0, 0.0)}[op_name]
