"""How each photo meets the net, and its probabilities come back at its own size: resized as the
evaluation loader does (bilinear, antialiased, `(x/255 - mean) / std`), flipped (`tta`), at
several scales, whole or in tiles, the maps averaged. Tiles cover the photo resized to
`tile.long_side`, weighted by windows ramping across the overlaps and summing to 1 everywhere.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from nailseg.inference.request import PredictError
from nailseg.model.scales import NAIL_QUANTILES, nail_size, scaled_size

# auto_scale: nails this many times smaller in the window than the training nails' lower decile
# (the least size training covers well) run again at that size, at most AUTO_MOST windows across
AUTO_SMALLER = 1.25
AUTO_MOST = 8

# the net, or what runs it elsewhere (engine.OnnxNet): a normalised float batch in, logits out
Net = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class InferenceSpec:
    """How to run one checkpoint: the net to build and how its inputs were made."""

    ckpt: Path
    model: Mapping[str, Any]  # plain: arch, encoder_name, options
    image_size: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    threshold: float  # the run's module.threshold
    data_root: Path | None  # the run's prepared data, for choosing a threshold on validation
    nail_size: tuple[float, ...] | None = None  # the card's: its training nails (auto_scale)


@dataclass(frozen=True)
class Tiling:
    """`tile.*`: the long side, in pixels, photos are resized to; the least overlap of tiles."""

    long_side: int
    overlap: float  # a fraction of a tile, in [0, 1)


@dataclass(frozen=True)
class Views:
    """How each photo is run; `scales` None: the input size alone; `tile` None: the photo whole;
    `auto` (`auto_scale`, neither given): a photo with small nails runs again in these tiles."""

    tta: bool
    scales: tuple[float, ...] | None
    tile: Tiling | None
    auto: Tiling | None = None  # its long side set per photo

    def record(self) -> dict[str, Any]:
        """As summary.json and the threshold cache record them."""
        return {
            "scales": list(self.scales) if self.scales else None,
            "tile": asdict(self.tile) if self.tile else None,
            "auto_scale": True if self.auto else None,
        }


def views_of(cfg: DictConfig, spec: InferenceSpec) -> Views:
    """`cfg`'s tta, scales and tile; PredictError for a long side below the input size's."""
    long_side, tile = cfg.tile.long_side, None
    if long_side is not None:
        if long_side < max(spec.image_size):
            raise PredictError(
                f"tile.long_side={long_side}: must be at least the input size's long side, "
                f"{max(spec.image_size)} (image_size={list(spec.image_size)}); null: no tiles"
            )
        tile = Tiling(long_side=long_side, overlap=float(cfg.tile.overlap))
    scales = None if cfg.scales is None else tuple(OmegaConf.to_object(cfg.scales))
    auto = None
    if cfg.auto_scale and scales is None and tile is None and spec.nail_size is not None:
        auto = Tiling(long_side=max(spec.image_size), overlap=float(cfg.tile.overlap))
    return Views(tta=bool(cfg.tta), scales=scales, tile=tile, auto=auto)


def input_sizes(views: Views, spec: InferenceSpec) -> list[tuple[int, int]]:
    """Every size the net runs at, once each: tiles are the input size."""
    if views.tile is not None:
        return [spec.image_size]
    return list(dict.fromkeys(scaled_size(spec.image_size, s) for s in (views.scales or (1.0,))))


@torch.inference_mode()
def photo_probabilities(
    net: Net, images: Sequence[torch.Tensor], spec: InferenceSpec, views: Views, batch_size: int
) -> list[torch.Tensor]:
    """One H×W probability map per C×H×W photo, at its size, in order: the mean over `views`;
    tiles `batch_size` at a time. Photos run sorted by size: one resize call per size."""
    order = sorted(range(len(images)), key=lambda i: tuple(images[i].shape))
    ordered = [images[i] for i in order]
    maps: list[torch.Tensor] = []
    for scale in views.scales or (1.0,):
        if views.tile is None:
            size = scaled_size(spec.image_size, scale)
            got = full_size_probabilities(net, ordered, spec, views.tta, size)
        else:
            tiling = replace(views.tile, long_side=round(scale * views.tile.long_side))
            got = tiled_probabilities(net, ordered, spec, tiling, views.tta, batch_size)
        maps = [m + g for m, g in zip(maps, got, strict=True)] if maps else got
    count = len(views.scales or (1.0,))
    maps = maps if count == 1 else [m / count for m in maps]
    return [maps[j] for j in sorted(range(len(order)), key=order.__getitem__)]


@torch.inference_mode()
def auto_probabilities(
    net: Net, images: Sequence[torch.Tensor], spec: InferenceSpec, views: Views, batch_size: int
) -> tuple[list[torch.Tensor], list[int | None]]:
    """`auto_scale`: each photo's map once in one window; where its nails (above the run's
    threshold) are clearly smaller there than the training ones, again from `views.auto`'s tiles
    at the long side that brings them to that size. Returns the maps and those sides."""
    runs = runs_of_one_size(images)
    probs = probabilities(net, to_batch(images, spec), views.tta)[:, 0]
    maps = _at_photo_sizes(probs.split([len(run) for run in runs]), runs)
    found = (probs > spec.threshold).byte().cpu().numpy()  # waits for the net: one copy a batch
    sides = [
        auto_long_side(m, tuple(i.shape[1:]), spec) for m, i in zip(found, images, strict=True)
    ]
    for i, side in enumerate(sides):
        if side is not None:
            tiling = replace(views.auto, long_side=side)
            maps[i] = tiled_probabilities(net, [images[i]], spec, tiling, views.tta, batch_size)[0]
    return maps, sides


def auto_long_side(found: np.ndarray, shape: tuple[int, int], spec: InferenceSpec) -> int | None:
    """The long side an H×W photo (`shape`) runs again at, given the nails `found` in its window:
    None where none were or they are not `AUTO_SMALLER` times smaller than the training nails'
    lower decile; else the side scaling its median nail to that decile."""
    target, found_size = spec.nail_size[NAIL_QUANTILES.index(0.1)], nail_size(found)
    if found_size is None or target < AUTO_SMALLER * found_size:
        return None
    # the window squeezed the photo: a nail's diameter there is its own times the area's root
    in_photo = found_size * math.sqrt(shape[0] * shape[1] / found.size)
    side = round(target / in_photo * max(shape))
    return min(max(side, max(spec.image_size)), AUTO_MOST * max(spec.image_size))


def image_tensors(images: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """RGB uint8 HxWx3 arrays as C×H×W uint8 tensors on `device`, in one copy of one host buffer:
    to a GPU pinned and asynchronous (a plain copy waits for the work queued there)."""
    sizes = [image.size for image in images]
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    for part, image in zip(host.split(sizes), images, strict=True):
        part.numpy()[:] = image.reshape(-1)
    moved = host.to(device, non_blocking=True)
    return [
        part.view(image.shape).permute(2, 0, 1)
        for part, image in zip(moved.split(sizes), images, strict=True)
    ]


def to_batch(
    images: Sequence[torch.Tensor], spec: InferenceSpec, size: tuple[int, int] | None = None
) -> torch.Tensor:
    """RGB uint8 C×H×W photos → one normalised float B×3×h×w batch at `size` (None: the input
    size), channels-last on CUDA; photos of one size in a row resized in one call."""
    device = images[0].device
    resized = [
        F.interpolate(
            torch.stack(run).float(),
            size=size or spec.image_size,
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )
        for run in runs_of_one_size(images)
    ]
    # `torch.tensor(..., device=cuda)` would wait for the work queued there; this copy does not
    mean, std = (
        torch.tensor([spec.mean, spec.std]).view(2, 1, 3, 1, 1).to(device, non_blocking=True)
    )
    return _laid_out((torch.cat(resized) / 255.0 - mean) / std)


def _laid_out(batch: torch.Tensor) -> torch.Tensor:
    """Channels-last on CUDA: the layout the net runs fastest in there."""
    return batch.contiguous(memory_format=torch.channels_last) if batch.is_cuda else batch


def runs_of_one_size(images: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`images` cut where the shape changes: consecutive photos of one size together."""
    return [list(run) for _, run in itertools.groupby(images, key=lambda image: image.shape)]


def probabilities(net: Net, batch: torch.Tensor, tta: bool = False) -> torch.Tensor:
    """Foreground probabilities B×1×h×w (float32); with `tta`, the mean over identity, horizontal
    and vertical flips, run as one batch of 3B. On CUDA under bf16 autocast, as training ran."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=batch.device.type == "cuda"):
        if not tta:
            return torch.sigmoid(net(batch).float())
        n = len(batch)
        probs = torch.sigmoid(net(torch.cat([batch, batch.flip(3), batch.flip(2)])).float())
    return (probs[:n] + probs[n : 2 * n].flip(3) + probs[2 * n :].flip(2)) / 3.0


@torch.inference_mode()
def full_size_probabilities(
    net: Net,
    images: Sequence[torch.Tensor],
    spec: InferenceSpec,
    tta: bool = False,
    size: tuple[int, int] | None = None,
) -> list[torch.Tensor]:
    """One H×W map per C×H×W photo, at its size, in order, the net run at `size` (None: its)."""
    runs = runs_of_one_size(images)
    probs = probabilities(net, to_batch(images, spec, size), tta)[:, 0]
    return _at_photo_sizes(probs.split([len(run) for run in runs]), runs)


def _at_photo_sizes(maps: Sequence[torch.Tensor], runs: list[list[torch.Tensor]]):
    """Each run's R×h×w maps brought to its photos' size: one H×W map per photo, in order."""
    return [
        full
        for part, run in zip(maps, runs, strict=True)
        for full in F.interpolate(part[:, None], run[0].shape[1:], mode="bilinear")[:, 0]
    ]


@dataclass(frozen=True)
class Layout:
    """One photo size's tiles: the resized size, each axis' tile starts, and per axis one
    normalised weight profile per tile (the window of tile (i, j) is `rows[i] ⊗ cols[j]`)."""

    size: tuple[int, int]
    row_starts: tuple[int, ...]
    col_starts: tuple[int, ...]
    rows: torch.Tensor  # len(row_starts) × tile height, on the CPU
    cols: torch.Tensor  # len(col_starts) × tile width

    @property
    def corners(self) -> list[tuple[int, int]]:
        """Each tile's top-left corner, row by row: the order tiles run in."""
        return [(y, x) for y in self.row_starts for x in self.col_starts]


def resized_size(shape: Sequence[int], tile: tuple[int, int], long_side: int) -> tuple[int, int]:
    """The size an H×W photo is tiled at: long side `long_side`, aspect kept, sides >= tile's."""
    height, width = shape
    ratio = long_side / max(height, width)
    return max(tile[0], round(height * ratio)), max(tile[1], round(width * ratio))


def tile_starts(length: int, tile: int, overlap: float) -> list[int]:
    """Where tiles begin along a side of `length`: evenly spread from 0 to `length - tile`, the
    fewest whose neighbours overlap by at least `overlap` of a tile (at most one per pixel)."""
    if length <= tile:
        return [0]
    stride = tile * (1.0 - overlap)
    count = min(1 + math.ceil((length - tile) / stride - 1e-9), length - tile + 1)
    return [round(i * (length - tile) / (count - 1)) for i in range(count)]


def _profiles(starts: Sequence[int], tile: int, length: int) -> torch.Tensor:
    """Each tile's weights along one axis: a linear ramp across its overlap with each neighbour
    (pixel centres: none is 0), 1 elsewhere; divided by their sum, so they sum to 1 everywhere."""
    centres = torch.arange(tile, dtype=torch.float64) + 0.5
    ramps = []
    for i, start in enumerate(starts):
        ramp = torch.ones(tile, dtype=torch.float64)
        if i > 0 and (before := starts[i - 1] + tile - start) > 0:
            ramp *= (centres / before).clamp(max=1.0)
        if i < len(starts) - 1 and (after := start + tile - starts[i + 1]) > 0:
            ramp *= ((tile - centres) / after).clamp(max=1.0)
        ramps.append(ramp)
    total = torch.zeros(length, dtype=torch.float64)
    for start, ramp in zip(starts, ramps, strict=True):
        total[start : start + tile] += ramp
    return torch.stack(
        [ramp / total[start : start + tile] for start, ramp in zip(starts, ramps, strict=True)]
    ).float()


@functools.lru_cache(maxsize=64)
def tile_layout(shape: tuple[int, int], tile: tuple[int, int], tiling: Tiling) -> Layout:
    """The tiles of an H×W photo (`shape`), computed once per photo size."""
    size = resized_size(shape, tile, tiling.long_side)
    rows = tile_starts(size[0], tile[0], tiling.overlap)
    cols = tile_starts(size[1], tile[1], tiling.overlap)
    profiles = _profiles(rows, tile[0], size[0]), _profiles(cols, tile[1], size[1])
    return Layout(size, tuple(rows), tuple(cols), *profiles)


@torch.inference_mode()
def tiled_probabilities(
    net: Net,
    images: Sequence[torch.Tensor],
    spec: InferenceSpec,
    tiling: Tiling,
    tta: bool,
    batch_size: int,
) -> list[torch.Tensor]:
    """One H×W map per C×H×W photo, at its size, in order, from tiles, `batch_size` at a time."""
    tile = spec.image_size
    runs = runs_of_one_size(images)
    layouts = [tile_layout(tuple(run[0].shape[1:]), tile, tiling) for run in runs]
    crops = [
        photo[:, y : y + tile[0], x : x + tile[1]]
        for run, layout in zip(runs, layouts, strict=True)
        for photo in to_batch(run, spec, layout.size)
        for y, x in layout.corners
    ]
    probs = torch.cat(
        [
            probabilities(net, _laid_out(torch.stack(crops[start : start + batch_size])), tta)[:, 0]
            for start in range(0, len(crops), batch_size)
        ]
    )
    counts = [len(run) * len(layout.corners) for run, layout in zip(runs, layouts, strict=True)]
    blended = [
        _blend(part.view(len(run), -1, *tile), layout, tile)
        for part, run, layout in zip(probs.split(counts), runs, layouts, strict=True)
    ]
    return _at_photo_sizes(blended, runs)


def _blend(probs: torch.Tensor, layout: Layout, tile: tuple[int, int]) -> torch.Tensor:
    """R photos' tile probabilities (R × tiles × tile) as R maps at the resized size, each tile
    weighted by its window (copied from pageable memory: no wait for the queued work)."""
    rows = layout.rows.to(probs.device, non_blocking=True)
    cols = layout.cols.to(probs.device, non_blocking=True)
    windows = (rows[:, None, :, None] * cols[None, :, None, :]).flatten(0, 1)
    weighted = probs * windows
    blended = probs.new_zeros(len(probs), *layout.size)
    for t, (y, x) in enumerate(layout.corners):
        blended[:, y : y + tile[0], x : x + tile[1]] += weighted[:, t]
    return blended
