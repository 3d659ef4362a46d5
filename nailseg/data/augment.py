"""The one augmentation spec every loader backend reads, and the numbers the backends share, so
that `aug=heavy` means the same whichever runs it.

An op is declared once, in `OPS`. Stages run in order: geometric ops on the image and its mask
(mask: nearest), both resized to the input size; colour ops on the RGB levels 0..255 (each
result rounded and clamped); normalisation `(x/255 - mean) / std`; photometric ops. Each op fires
with probability `p` and draws its parameters uniformly from closed ranges, once per sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

GEOMETRIC, COLOUR, PHOTOMETRIC = "geometric", "colour", "photometric"
INF = float("inf")


class Op(NamedTuple):
    stage: str
    params: tuple[str, ...] = ()  # range parameters, each a [lo, hi] pair
    within: tuple[float, float] | None = None  # bounds of its (one) parameter


OPS: dict[str, Op] = {
    "hflip": Op(GEOMETRIC),
    "vflip": Op(GEOMETRIC),
    # counter-clockwise; image bilinear, mask nearest, border 0
    "rotate": Op(GEOMETRIC, ("degrees",)),
    # a crop of area `scale` x the image's and width / height `ratio`, placed at random
    "random_resized_crop": Op(GEOMETRIC, ("scale", "ratio")),
    # the image as `scale` of each side of a larger canvas (0 around it), placed at random
    "zoom_out": Op(GEOMETRIC, ("scale",), (1e-3, 1.0)),
    # chroma turned (hue) or scaled (saturation, grayscale: 0) in YIQ, as DALI's fn.hsv
    "hue": Op(COLOUR, ("degrees",)),
    "saturation": Op(COLOUR, ("factor",), (0.0, INF)),
    "grayscale": Op(COLOUR),
    # 255 * (x / 255) ** gamma: below 1 brightens the shadows
    "gamma": Op(COLOUR, ("gamma",), (1e-3, INF)),
    # libjpeg's artefacts at an integer quality (4:2:0 chroma)
    "jpeg": Op(COLOUR, ("quality",), (1.0, 100.0)),
    # adds N(0, sigma^2)
    "gaussian_noise": Op(PHOTOMETRIC, ("sigma",)),
    # sigma in pixels of the resized image; DALI and Kornia fail mid-epoch on 0
    "gaussian_blur": Op(PHOTOMETRIC, ("sigma",), (1e-3, INF)),
    # multiplies the normalised image
    "brightness": Op(PHOTOMETRIC, ("factor",)),
    # mean + (x - mean) * factor per image, clamped to its own min and max
    "contrast": Op(PHOTOMETRIC, ("factor",)),
}


@dataclass(frozen=True)
class AugOp:
    """One op of a spec: fires with probability `p`, parameters drawn from `ranges`."""

    name: str
    p: float
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in OPS:
            raise ValueError(f"unknown augmentation op {self.name!r}; known: {sorted(OPS)}")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"op {self.name!r}: p={self.p} is not in [0, 1]")
        _, params, within = OPS[self.name]
        if set(self.ranges) != set(params):
            raise ValueError(
                f"op {self.name!r} takes parameters {sorted(params)}, got {sorted(self.ranges)}"
            )
        for key, (lo, hi) in self.ranges.items():
            if lo > hi:
                raise ValueError(f"op {self.name!r}: {key}=[{lo}, {hi}] has lo > hi")
            if within is not None and not within[0] <= lo <= hi <= within[1]:
                raise ValueError(
                    f"op {self.name!r}: {key}=[{lo}, {hi}] must lie within {list(within)}"
                )

    @property
    def stage(self) -> str:
        return OPS[self.name].stage


@dataclass(frozen=True)
class AugSpec:
    """The whole spec: ordered ops plus the normalisation that follows the colour ops."""

    ops: tuple[AugOp, ...]
    mean: tuple[float, float, float]  # conf/normalize
    std: tuple[float, float, float]

    def stage(self, stage: str) -> tuple[AugOp, ...]:
        return tuple(op for op in self.ops if op.stage == stage)

    @classmethod
    def from_config(
        cls, ops: Iterable[Mapping], mean: Iterable[float], std: Iterable[float]
    ) -> AugSpec:
        """From `[{op: name, p: prob, <param>: [lo, hi]}]`; None parameters (unset) are left out."""
        parsed = []
        for raw in ops:
            entry = dict(raw)
            name, p = entry.pop("op"), float(entry.pop("p", 1.0))
            ranges = {k: (float(v[0]), float(v[1])) for k, v in entry.items() if v is not None}
            parsed.append(AugOp(name=name, p=p, ranges=ranges))
        mean_, std_ = rgb_triple(mean, "normalize.mean"), rgb_triple(std, "normalize.std", True)
        return cls(ops=tuple(parsed), mean=mean_, std=std_)


def rgb_triple(
    values: Iterable[float], key: str, positive: bool = False
) -> tuple[float, float, float]:
    """Three values, one per RGB channel, or a ValueError naming `key`; `positive`: each above 0
    (a std, which divides)."""
    out = tuple(float(v) for v in values)
    if len(out) != 3:
        raise ValueError(f"{key}={list(out)}: needs 3 values, one per RGB channel")
    if positive and min(out) <= 0:
        raise ValueError(f"{key}={list(out)}: every value must be above 0 (it divides)")
    return out  # type: ignore[return-value]


# --- the numbers torch (one sample) and Kornia (a batch) share with DALI's operators ---------------


def rotation_matrices(
    degrees: np.ndarray, canvas_hw: np.ndarray, out_hw: tuple[int, int]
) -> np.ndarray:
    """(k, 2, 3) source -> destination pixel maps (OpenCV's warpAffine convention) rotating each
    canvas by `degrees` about its centre, for an image showing that canvas resized to `out_hw`:
    the rotation conjugated with that resize (`cv2.getRotationMatrix2D` when they are equal)."""
    theta = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    cos, sin = np.cos(theta), np.sin(theta)
    out_h, out_w = out_hw
    sx, sy = out_w / canvas_hw[:, 1], out_h / canvas_hw[:, 0]  # output pixels per canvas pixel
    linear = np.stack([np.stack([cos, sin * sx / sy], -1), np.stack([-sin * sy / sx, cos], -1)], 1)
    centre = np.array([(out_w - 1) / 2, (out_h - 1) / 2])
    shift = centre - linear @ centre
    return np.concatenate([linear, shift[:, :, None]], axis=2)


def _place(canvas_hw: np.ndarray, win_h, win_w, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """(k, 4) integer windows x0, y0, x1, y1 (end exclusive) placed by `u`, `v` in [0, 1) over
    the room between window and canvas (negative for a larger window); corners round half up,
    as DALI's slice does."""
    x0, y0 = u * (canvas_hw[:, 1] - win_w), v * (canvas_hw[:, 0] - win_h)
    return np.floor(np.stack([x0, y0, x0 + win_w, y0 + win_h], axis=1) + 0.5).astype(np.int64)


def crop_windows(canvas_hw: np.ndarray, scale, ratio, u, v) -> np.ndarray:
    """`random_resized_crop`'s windows, each side clamped to [1, side]."""
    h, w = canvas_hw[:, 0], canvas_hw[:, 1]
    area = h * w * scale
    crop_w, crop_h = np.clip(np.sqrt(area * ratio), 1.0, w), np.clip(np.sqrt(area / ratio), 1.0, h)
    return _place(canvas_hw, crop_h, crop_w, u, v)


def zoom_windows(canvas_hw: np.ndarray, scale, u, v) -> np.ndarray:
    """`zoom_out`'s windows: each side 1 / `scale` times the canvas's, around it."""
    return _place(canvas_hw, canvas_hw[:, 0] / scale, canvas_hw[:, 1] / scale, u, v)


def blur_window(sigma: float) -> int:
    """The odd kernel width DALI's gaussian_blur uses: the Gaussian cut at 3 sigma."""
    return 2 * int(np.ceil(3 * sigma)) + 1


# DALI's colour space for hue and saturation; back to RGB through this matrix's exact inverse
_RGB_TO_YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.321], [0.211, -0.523, 0.311]])


def colour_params(op_name: str, draw: float) -> tuple[float, float]:
    """(hue degrees, saturation) of `hue`, `saturation` or `grayscale` for its drawn parameter."""
    return {"hue": (draw, 1.0), "saturation": (0.0, draw), "grayscale": (0.0, 0.0)}[op_name]


def colour_matrices(hue_degrees: np.ndarray, saturation: np.ndarray) -> np.ndarray:
    """(k, 3, 3) float32 RGB -> RGB matrices (out = M @ rgb) of DALI's `fn.hsv`."""
    theta = np.deg2rad(np.asarray(hue_degrees, dtype=np.float64))
    cos, sin = np.cos(theta) * saturation, np.sin(theta) * saturation
    twist = np.zeros((len(theta), 3, 3))
    twist[:, 0, 0] = 1.0
    twist[:, 1, 1], twist[:, 1, 2], twist[:, 2, 1], twist[:, 2, 2] = cos, sin, -sin, cos
    return (np.linalg.inv(_RGB_TO_YIQ) @ twist @ _RGB_TO_YIQ).astype(np.float32)
