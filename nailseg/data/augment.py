"""One augmentation spec that every loader backend (DALI, torch, Kornia) reads.

A spec is an ordered list of ops, each with a probability and parameter ranges. The semantics are
fixed here so that `aug=heavy` means the same thing whichever backend runs it:

* geometric ops (`GEOMETRIC`) run first, in spec order, on the image *and* its mask (mask:
  nearest-neighbour), then both are resized to the input size (mask: nearest-neighbour);
* colour ops (`COLOUR`) then run in spec order on the resized image's RGB pixel values (0..255);
  each op's result is rounded to the nearest level and clamped to 0..255, as a photo has them;
* the image is then normalised (`(x/255 - mean) / std`);
* photometric ops (`PHOTOMETRIC`) run last, in spec order, on the normalised image only.

Parameter meaning (all ranges are closed intervals sampled uniformly, once per sample):

* `hflip`, `vflip`: no parameters.
* `rotate`: `degrees` [lo, hi]; image bilinear, mask nearest, border filled with 0.
* `random_resized_crop`: `scale` [lo, hi] (crop area / image area) and `ratio` [lo, hi]
  (crop width / height); the crop is then resized to the input size like the full image.
* `zoom_out`: `scale` [lo, hi] within (0, 1]: the image becomes that fraction of each side of a
  larger canvas (image and mask filled with 0 around it), placed uniformly at random; the canvas
  is then resized like the full image, so the nails get smaller in the frame.
* `hue`: `degrees` [lo, hi]; rotates each pixel's chroma in YIQ space (DALI's `fn.hue`: a 3x3
  colour matrix, luma kept).
* `saturation`: `factor` [lo, hi] >= 0; scales the chroma in YIQ space (DALI's `fn.saturation`);
  0 is grey.
* `grayscale`: no parameters; `saturation` with factor 0.
* `gamma`: `gamma` [lo, hi] > 0; `255 * (x / 255) ** gamma`: below 1 brightens the shadows.
* `jpeg`: `quality` [lo, hi], integers in 1..100 drawn uniformly; JPEG compression artefacts
  (encode and decode at that quality, 4:2:0 chroma).
* `gaussian_noise`: `sigma` [lo, hi]; adds N(0, sigma^2) to the normalised image.
* `gaussian_blur`: `sigma` [lo, hi] > 0 in pixels of the resized image (Kornia and DALI refuse a
  sigma of 0 mid-epoch, so it is refused up front).
* `brightness`: `factor` [lo, hi]; multiplies the normalised image.
* `contrast`: `factor` [lo, hi]; `mean + (x - mean) * factor` per image, clamped to the image's
  own min and max before the op.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

GEOMETRIC = ("hflip", "vflip", "rotate", "random_resized_crop", "zoom_out")
COLOUR = ("hue", "saturation", "grayscale", "gamma", "jpeg")
PHOTOMETRIC = ("gaussian_noise", "gaussian_blur", "brightness", "contrast")

# op name -> the range parameters it takes (each a [lo, hi] pair)
OP_PARAMS: dict[str, tuple[str, ...]] = {
    "hflip": (),
    "vflip": (),
    "rotate": ("degrees",),
    "random_resized_crop": ("scale", "ratio"),
    "zoom_out": ("scale",),
    "hue": ("degrees",),
    "saturation": ("factor",),
    "grayscale": (),
    "gamma": ("gamma",),
    "jpeg": ("quality",),
    "gaussian_noise": ("sigma",),
    "gaussian_blur": ("sigma",),
    "brightness": ("factor",),
    "contrast": ("factor",),
}

# op -> (key, lowest, highest) a range must stay within
_BOUNDS: dict[str, tuple[str, float, float]] = {
    "zoom_out": ("scale", 1e-3, 1.0),
    "saturation": ("factor", 0.0, float("inf")),
    "gamma": ("gamma", 1e-3, float("inf")),
    "jpeg": ("quality", 1.0, 100.0),
    "gaussian_blur": ("sigma", 1e-3, float("inf")),
}


@dataclass(frozen=True)
class AugOp:
    """One op of a spec: fires with probability `p`, parameters drawn from `ranges`."""

    name: str
    p: float
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in OP_PARAMS:
            raise ValueError(f"unknown augmentation op {self.name!r}; known: {sorted(OP_PARAMS)}")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"op {self.name!r}: p={self.p} is not in [0, 1]")
        wanted = set(OP_PARAMS[self.name])
        if set(self.ranges) != wanted:
            raise ValueError(
                f"op {self.name!r} takes parameters {sorted(wanted)}, got {sorted(self.ranges)}"
            )
        for key, (lo, hi) in self.ranges.items():
            if lo > hi:
                raise ValueError(f"op {self.name!r}: {key}=[{lo}, {hi}] has lo > hi")
        if self.name in _BOUNDS:
            key, low, high = _BOUNDS[self.name]
            lo, hi = self.ranges[key]
            if lo < low or hi > high:
                raise ValueError(
                    f"op {self.name!r}: {key}=[{lo}, {hi}] must lie within [{low}, {high}]"
                )

    @property
    def geometric(self) -> bool:
        return self.name in GEOMETRIC

    @property
    def colour(self) -> bool:
        return self.name in COLOUR


@dataclass(frozen=True)
class AugSpec:
    """The whole spec: ordered ops plus the normalisation that follows the geometric part."""

    ops: tuple[AugOp, ...]
    mean: tuple[float, float, float]  # conf/normalize
    std: tuple[float, float, float]

    @property
    def geometric_ops(self) -> tuple[AugOp, ...]:
        return tuple(op for op in self.ops if op.geometric)

    @property
    def colour_ops(self) -> tuple[AugOp, ...]:
        return tuple(op for op in self.ops if op.colour)

    @property
    def photometric_ops(self) -> tuple[AugOp, ...]:
        return tuple(op for op in self.ops if op.name in PHOTOMETRIC)

    @classmethod
    def from_config(
        cls, ops: Iterable[Mapping], mean: Iterable[float], std: Iterable[float]
    ) -> AugSpec:
        """Build from the config form: a list of `{op: name, p: prob, <param>: [lo, hi]}`;
        parameters set to None (the schema's unset keys) are ignored."""
        parsed = []
        for raw in ops:
            entry = dict(raw)
            name = entry.pop("op")
            p = float(entry.pop("p", 1.0))
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
