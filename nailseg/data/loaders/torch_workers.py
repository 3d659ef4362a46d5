"""`loader=torch`: a torch DataLoader whose worker processes apply the AugSpec with numpy and OpenCV.

Each op reproduces DALI's (dali.py) pixel for pixel, through augment.py's numbers; the image is
resized with torch's antialiased bilinear filter on uint8, which is what DALI's linear resize
computes (OpenCV's filters alias or box-filter), masks with DALI's half-pixel nearest rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from nailseg.data.augment import (
    COLOUR,
    GEOMETRIC,
    PHOTOMETRIC,
    AugOp,
    AugSpec,
    blur_window,
    colour_matrices,
    colour_params,
    crop_windows,
    rotation_matrices,
    zoom_windows,
)
from nailseg.data.loaders.workers import BatchTransform, WorkerLoader

Rng = np.random.Generator


def _flip(op: AugOp, image: np.ndarray, mask: np.ndarray, _: Rng) -> tuple[np.ndarray, ...]:
    code = 1 if op.name == "hflip" else 0  # OpenCV: 1 mirrors columns, 0 mirrors rows
    return cv2.flip(image, code), cv2.flip(mask, code)


def _rotate(op: AugOp, image: np.ndarray, mask: np.ndarray, rng: Rng) -> tuple[np.ndarray, ...]:
    h, w = mask.shape
    degrees = np.array([rng.uniform(*op.ranges["degrees"])])
    matrix = rotation_matrices(degrees, np.array([[h, w]], dtype=np.float64), (h, w))[0]
    border = {"borderMode": cv2.BORDER_CONSTANT, "borderValue": 0}
    return (
        cv2.warpAffine(image, matrix, (w, h), flags=cv2.INTER_LINEAR, **border),
        cv2.warpAffine(mask, matrix, (w, h), flags=cv2.INTER_NEAREST, **border),
    )


def _random_resized_crop(
    op: AugOp, image: np.ndarray, mask: np.ndarray, rng: Rng
) -> tuple[np.ndarray, ...]:
    draws = (
        rng.uniform(*op.ranges["scale"]),
        rng.uniform(*op.ranges["ratio"]),
        rng.random(),
        rng.random(),
    )
    canvas = np.array([mask.shape], dtype=np.float64)
    x0, y0, x1, y1 = crop_windows(canvas, *(np.array([d]) for d in draws))[0]
    return image[y0:y1, x0:x1], mask[y0:y1, x0:x1]


def _zoom_out(op: AugOp, image: np.ndarray, mask: np.ndarray, rng: Rng) -> tuple[np.ndarray, ...]:
    draws = (rng.uniform(*op.ranges["scale"]), rng.random(), rng.random())
    canvas = np.array([mask.shape], dtype=np.float64)
    x0, y0, x1, y1 = zoom_windows(canvas, *(np.array([d]) for d in draws))[0]
    h, w = mask.shape
    out_image = np.zeros((y1 - y0, x1 - x0, 3), np.uint8)
    out_mask = np.zeros((y1 - y0, x1 - x0), mask.dtype)
    out_image[-y0 : h - y0, -x0 : w - x0] = image
    out_mask[-y0 : h - y0, -x0 : w - x0] = mask
    return out_image, out_mask


def _colour_matrix(op: AugOp, image: np.ndarray, rng: Rng) -> np.ndarray:
    draw = rng.uniform(*next(iter(op.ranges.values()))) if op.ranges else 0.0
    matrix = colour_matrices(*(np.array([v]) for v in colour_params(op.name, draw)))[0]
    out = matrix @ image.reshape(3, -1).astype(np.float32)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8).reshape(image.shape)


def _gamma(op: AugOp, image: np.ndarray, rng: Rng) -> np.ndarray:
    gamma = rng.uniform(*op.ranges["gamma"])
    table = np.rint(255.0 * (np.arange(256) / 255.0) ** gamma).astype(np.uint8)
    return table[image]


def _jpeg(op: AugOp, image: np.ndarray, rng: Rng) -> np.ndarray:
    lo, hi = op.ranges["quality"]
    quality = int(rng.integers(round(lo), round(hi) + 1))
    bgr = np.ascontiguousarray(image[::-1].transpose(1, 2, 0))
    ok, encoded = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError(f"OpenCV could not JPEG-encode a {bgr.shape} image")
    return np.ascontiguousarray(cv2.imdecode(encoded, cv2.IMREAD_COLOR).transpose(2, 0, 1)[::-1])


def _gaussian_noise(op: AugOp, x: np.ndarray, rng: Rng) -> np.ndarray:
    sigma = rng.uniform(*op.ranges["sigma"])
    return x + sigma * rng.standard_normal(x.shape, dtype=np.float32)


def _gaussian_blur(op: AugOp, x: np.ndarray, rng: Rng) -> np.ndarray:
    sigma = rng.uniform(*op.ranges["sigma"])
    k = blur_window(sigma)
    return np.stack(
        [cv2.GaussianBlur(c, (k, k), sigma, borderType=cv2.BORDER_REFLECT_101) for c in x]
    )


def _brightness(op: AugOp, x: np.ndarray, rng: Rng) -> np.ndarray:
    return x * rng.uniform(*op.ranges["factor"])


def _contrast(op: AugOp, x: np.ndarray, rng: Rng) -> np.ndarray:
    mean = x.mean()
    return np.clip(mean + (x - mean) * rng.uniform(*op.ranges["factor"]), x.min(), x.max())


# each op of the spec (augment.OPS): geometric ones on the image and its mask, colour ones on the
# resized uint8 3xHxW image, photometric ones on the normalised image
_OPS: dict[str, Callable[..., Any]] = {
    "hflip": _flip,
    "vflip": _flip,
    "rotate": _rotate,
    "random_resized_crop": _random_resized_crop,
    "zoom_out": _zoom_out,
    "hue": _colour_matrix,
    "saturation": _colour_matrix,
    "grayscale": _colour_matrix,
    "gamma": _gamma,
    "jpeg": _jpeg,
    "gaussian_noise": _gaussian_noise,
    "gaussian_blur": _gaussian_blur,
    "brightness": _brightness,
    "contrast": _contrast,
}


def resize_image(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 HxWx3 -> uint8 3 x size: bilinear, antialiased when shrinking (DALI's filter)."""
    chw = torch.from_numpy(image).permute(2, 0, 1)[None]
    out = F.interpolate(chw, size=size, mode="bilinear", align_corners=False, antialias=True)
    return out[0].numpy()


def resize_mask(mask: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """HxW -> size, nearest: output pixel i takes input floor((i + 0.5) * in / out), as DALI."""

    def source(n_in: int, n_out: int) -> np.ndarray:
        return (2 * np.arange(n_out) + 1) * n_in // (2 * n_out)

    return mask[np.ix_(source(mask.shape[0], size[0]), source(mask.shape[1], size[1]))]


class OpenCVTransform:
    """One sample through the spec: geometric ops, resize, colour ops, normalise, photometric ops.

    With `normalise=False` it stops after the resize and returns the uint8 image, for a backend
    that normalises (and augments) on the device.
    """

    def __init__(
        self, spec: AugSpec, image_size: tuple[int, int], *, normalise: bool = True
    ) -> None:
        if not normalise and len(spec.stage(GEOMETRIC)) < len(spec.ops):
            raise ValueError("colour and photometric ops follow the resize: normalise=True needed")
        self.spec, self.image_size, self.normalise = spec, image_size, normalise
        self._mean = 255 * np.array(spec.mean, dtype=np.float32)[:, None, None]
        self._std = 255 * np.array(spec.std, dtype=np.float32)[:, None, None]

    @staticmethod
    def worker_init(_worker_id: int) -> None:
        """OpenCV on the worker's own thread: the workers are the parallelism. 0, not 1, which can
        hang a worker forked from a process whose OpenCV thread pool ran."""
        cv2.setNumThreads(0)

    def __call__(
        self, image: np.ndarray, mask: np.ndarray, rng: Rng
    ) -> tuple[np.ndarray, np.ndarray]:
        for op in self.spec.stage(GEOMETRIC):
            if rng.random() < op.p:
                image, mask = _OPS[op.name](op, image, mask, rng)
        image = resize_image(image, self.image_size)
        mask = resize_mask(mask, self.image_size)[None]
        if not self.normalise:
            return image, mask
        for op in self.spec.stage(COLOUR):
            if rng.random() < op.p:
                image = _OPS[op.name](op, image, rng)
        x = (image - self._mean) / self._std
        for op in self.spec.stage(PHOTOMETRIC):
            if rng.random() < op.p:
                x = _OPS[op.name](op, x, rng)
        return x, mask


class TorchLoader(WorkerLoader):
    """`loader=torch`: the whole spec runs in the DataLoader workers; batches are only moved."""

    def _transforms(
        self, spec: AugSpec, image_size: tuple[int, int]
    ) -> tuple[OpenCVTransform, BatchTransform | None]:
        return OpenCVTransform(spec, image_size), None
