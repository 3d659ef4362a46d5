"""How each photo is shown to the net: flipped (`tta`), at several scales (`scales`), whole or in
tiles (`tile`); the probabilities merged into one map per photo before the threshold. predict and
`threshold=auto` run the same views, so the threshold is chosen on what predict writes.

A scale is a factor of how large the photo reaches the net. Whole, the photo runs at the input size
times the factor, each side rounded to a multiple of 32 (`model/scales.py`; the factor 1 is the input
size as it is, the size the net was trained at); in tiles, it is resized to `tile.long_side` times
the factor and tiled at the input size (tiles.py). Each scale's map is brought back to the photo's
size, and the maps are averaged (the mean probability).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from nailseg.inference.spec import InferenceSpec, Net, full_size_probabilities
from nailseg.inference.tiles import Tiling, tiled_probabilities
from nailseg.model.scales import scaled_size, scales_problem


@dataclass(frozen=True)
class Views:
    """How each photo is run; `scales` None is the input size alone, `tile` None the photo
    whole."""

    tta: bool
    scales: tuple[float, ...] | None
    tile: Tiling | None

    @property
    def factors(self) -> tuple[float, ...]:
        return self.scales or (1.0,)

    def record(self) -> dict[str, Any]:
        """The scales and tiles, as summary.json and the threshold cache record them."""
        return {
            "scales": list(self.scales) if self.scales else None,
            "tile": asdict(self.tile) if self.tile else None,
        }


def views_of(cfg: DictConfig, spec: InferenceSpec) -> Views:
    """`cfg`'s tta, scales and tile, checked against the input size; a ValueError naming the key
    of the first bad value."""
    scales = None if cfg.scales is None else tuple(OmegaConf.to_object(cfg.scales))
    problem = None if scales is None else scales_problem("scales", scales)
    if problem:
        raise ValueError(problem)
    overlap, long_side = cfg.tile.overlap, cfg.tile.long_side
    if not 0.0 <= overlap < 1.0:
        raise ValueError(f"tile.overlap={overlap}: must be in [0, 1), a fraction of a tile")
    tile = None
    if long_side is not None:
        if long_side < max(spec.image_size):
            raise ValueError(
                f"tile.long_side={long_side}: must be at least the input size's long side, "
                f"{max(spec.image_size)} (image_size={list(spec.image_size)}); null: no tiles"
            )
        tile = Tiling(long_side=long_side, overlap=float(overlap))
    return Views(tta=bool(cfg.tta), scales=scales, tile=tile)


def input_sizes(views: Views, spec: InferenceSpec) -> list[tuple[int, int]]:
    """Every size the net runs at, once each: tiles are the input size."""
    if views.tile is not None:
        return [spec.image_size]
    return list(dict.fromkeys(scaled_size(spec.image_size, s) for s in views.factors))


@torch.inference_mode()
def photo_probabilities(
    net: Net,
    images: Sequence[torch.Tensor],
    spec: InferenceSpec,
    views: Views,
    batch_size: int,
) -> list[torch.Tensor]:
    """One H×W probability map per C×H×W photo, at the photo's own size (on its device), in the
    photos' order: the mean over `views`' scales, each with its flips (the module docstring);
    tiles go through the net `batch_size` at a time."""
    maps: list[torch.Tensor] = []
    for scale in views.factors:
        if views.tile is None:
            size = scaled_size(spec.image_size, scale)
            got = full_size_probabilities(net, images, spec, views.tta, size)
        else:
            tiling = replace(views.tile, long_side=round(scale * views.tile.long_side))
            got = tiled_probabilities(net, images, spec, tiling, views.tta, batch_size)
        maps = [m + g for m, g in zip(maps, got, strict=True)] if maps else got
    count = len(views.factors)
    return maps if count == 1 else [m / count for m in maps]
