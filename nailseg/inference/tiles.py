"""Photos in overlapping tiles of the net's input size (`tile.long_side=N`), so a large photo's
pixels reach the net at a chosen scale instead of squeezed into one input-size window.

A photo is resized (bilinear, antialiased, as a whole photo is) so that its long side is
`long_side` pixels, its aspect kept; a side that comes out shorter than the tile's is stretched to
it, so no made-up pixels reach the net and a photo that fits in one tile runs as one input-size
window, as without tiles. Tiles of the input size cover the resized photo, evenly spread, the
fewest that overlap their neighbours by at least `overlap` of a tile. Each tile's probabilities are
weighted by a window that ramps linearly across its overlap with each neighbour (1 elsewhere),
normalised so the windows sum to 1 at every pixel: seams do not show, and a net whose output at a
pixel depends on that pixel alone gives what it gives on the whole resized photo. The blended map
is brought back to the photo's size bilinearly, as a whole photo's map is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nailseg.inference.spec import InferenceSpec, Net, probabilities, runs_of_one_size, to_batch


@dataclass(frozen=True)
class Tiling:
    """`tile.*`: the long side, in pixels, photos are resized to; the least overlap of tiles."""

    long_side: int
    overlap: float  # a fraction of a tile, in [0, 1)


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
    """The size an H×W photo is tiled at: its long side `long_side`, its aspect kept, each side
    at least the tile's."""
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
    (pixel centres, so no weight is 0), 1 elsewhere; divided by their sum at each pixel of the
    side, so the tiles' weights sum to 1 everywhere."""
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
    return Layout(
        size=size,
        row_starts=tuple(rows),
        col_starts=tuple(cols),
        rows=_profiles(rows, tile[0], size[0]),
        cols=_profiles(cols, tile[1], size[1]),
    )


@torch.inference_mode()
def tiled_probabilities(
    net: Net,
    images: Sequence[torch.Tensor],
    spec: InferenceSpec,
    tiling: Tiling,
    tta: bool,
    batch_size: int,
) -> list[torch.Tensor]:
    """One H×W probability map per C×H×W photo, at the photo's own size (on its device), in the
    photos' order: each photo run in tiles (the module docstring), the tiles of all the photos
    through the net `batch_size` at a time (the last batch may be smaller)."""
    tile = spec.image_size
    order = sorted(range(len(images)), key=lambda i: tuple(images[i].shape))
    runs = runs_of_one_size([images[i] for i in order])
    layouts = [tile_layout(tuple(run[0].shape[1:]), tile, tiling) for run in runs]
    crops = [
        photo[:, y : y + tile[0], x : x + tile[1]]
        for run, layout in zip(runs, layouts, strict=True)
        for photo in to_batch(run, spec, layout.size)
        for y, x in layout.corners
    ]
    probs = torch.cat(
        [
            probabilities(net, _stacked(crops[start : start + batch_size]), tta)[:, 0]
            for start in range(0, len(crops), batch_size)
        ]
    )
    maps: list[torch.Tensor] = []
    for run, layout in zip(runs, layouts, strict=True):
        count = len(run) * len(layout.corners)
        run_probs, probs = probs[:count], probs[count:]
        blended = _blend(run_probs.view(len(run), -1, *tile), layout, tile)
        full = F.interpolate(
            blended[:, None], size=run[0].shape[1:], mode="bilinear", align_corners=False
        )
        maps += full[:, 0].unbind()
    by_photo = dict(zip(order, maps, strict=True))
    return [by_photo[i] for i in range(len(images))]


def _stacked(crops: Sequence[torch.Tensor]) -> torch.Tensor:
    """Tiles as one batch, channels-last on CUDA (as `to_batch` makes a whole photo's)."""
    batch = torch.stack(list(crops))
    return batch.contiguous(memory_format=torch.channels_last) if batch.is_cuda else batch


def _blend(probs: torch.Tensor, layout: Layout, tile: tuple[int, int]) -> torch.Tensor:
    """R photos' tile probabilities (R × tiles × tile) as R maps at the resized size: each tile
    weighted by its window and added where it came from. The windows reach the device by a copy
    from pageable memory, which does not wait for the work queued there."""
    rows = layout.rows.to(probs.device, non_blocking=True)
    cols = layout.cols.to(probs.device, non_blocking=True)
    windows = (rows[:, None, :, None] * cols[None, :, None, :]).flatten(0, 1)
    weighted = probs * windows
    blended = probs.new_zeros(len(probs), *layout.size)
    for t, (y, x) in enumerate(layout.corners):
        blended[:, y : y + tile[0], x : x + tile[1]] += weighted[:, t]
    return blended
