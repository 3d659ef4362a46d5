"""Scales: how large an image reaches the net, as a factor of the input size. Training's
evaluation (`module.eval_scales`) and predict (`scales=`) mean the same by a factor. How large
nails are: the card records its training photos' (`training_nail_sizes`), predict's auto scale
measures a photo's against them (`nail_size`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from nailseg.prep.format import read_table, split_file

if TYPE_CHECKING:
    import torch

SIZE_MULTIPLE = 32  # UNet's and SegFormer's encoders halve the input five times
NAIL_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)  # of the card's `nail_size`
NAIL_SAMPLE = 512  # training photos measured for the card: enough for its quantiles, read in ~1 s
SPECK = 0.1  # a component below this share of a mask's largest one's area is not a nail


def scaled_size(image_size: tuple[int, int], scale: float) -> tuple[int, int]:
    """The size an image runs at for `scale`: each side times it, rounded to the nearest multiple
    of `SIZE_MULTIPLE` (halves up; at least one); factor 1 is the input size itself."""
    if scale == 1.0:
        return image_size
    height, width = (
        max(SIZE_MULTIPLE, math.floor(scale * side / SIZE_MULTIPLE + 0.5) * SIZE_MULTIPLE)
        for side in image_size
    )
    return height, width


def scales_problem(key: str, scales: Sequence[float]) -> str | None:
    """What is wrong with `scales` (one factor > 0 or more), given as `key`, in one line."""
    if not scales:
        return (
            f"{key}=[]: give one factor of the input size or more, e.g. {key}=[1.0,1.5] "
            "(null: the input size alone)"
        )
    if not all(math.isfinite(s) and s > 0 for s in scales):
        shown = "[" + ",".join(f"{s:g}" for s in scales) + "]"
        return f"{key}={shown}: each factor must be a number > 0"
    return None


def multiscale_probabilities(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    batch: torch.Tensor,
    scales: Sequence[float],
    logits: torch.Tensor,
) -> torch.Tensor:
    """The mean foreground probability over `scales` of a B×C×H×W batch at its size (resized
    there and back, bilinear); `logits` are the batch's own at factor 1."""
    import torch
    import torch.nn.functional as F

    size = (batch.shape[-2], batch.shape[-1])
    total = torch.zeros_like(logits, dtype=torch.float32)
    for scale in scales:
        run_size = scaled_size(size, scale)
        if run_size == size:
            total += torch.sigmoid(logits.float())
            continue
        resized = F.interpolate(
            batch, run_size, mode="bilinear", antialias=True, align_corners=False
        )
        probs = torch.sigmoid(logits_of(resized).float())
        total += F.interpolate(probs, size, mode="bilinear", align_corners=False)
    return total / len(scales)


def nail_size(mask: np.ndarray) -> float | None:
    """The median nail's diameter in pixels (a nail: an 8-connected component of the H×W mask,
    specks left out; its diameter: a disc's of its area), None where there is none."""
    import cv2

    _, _, stats, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=8)
    areas = stats[1:, cv2.CC_STAT_AREA]
    if not len(areas):
        return None
    return float(np.median(np.sqrt(4 / math.pi * areas[areas >= SPECK * areas.max()])))


def training_nail_sizes(
    sources: Mapping[str, float], image_size: Sequence[int], seed: int = 0
) -> list[float] | None:
    """The `NAIL_QUANTILES` of the per-photo `nail_size` at `image_size` (each photo squeezed to
    it, as training does) over the train splits of `sources` (prepared root: its weight), a
    sample of `NAIL_SAMPLE` photos shared by weight; None where no photo shows a nail."""
    sources = {
        r: w for r, w in sources.items() if w > 0 and (Path(r) / split_file("train")).is_file()
    }
    rng, total, sizes = np.random.default_rng(seed), sum(sources.values()), []
    for root, weight in sources.items():
        rows = read_table(Path(root) / split_file("train"), ["masks", "height", "width"])
        n = min(len(rows), math.ceil(NAIL_SAMPLE * weight / total))
        for row in rows.iloc[np.sort(rng.choice(len(rows), n, replace=False))].itertuples():
            size = nail_size(np.load(Path(root) / row.masks, allow_pickle=False)[..., 0])
            if size is not None:  # the area's scale, a disc's diameter scales by its root
                sizes.append(
                    size * math.sqrt(image_size[0] * image_size[1] / row.height / row.width)
                )
    return np.quantile(sizes, NAIL_QUANTILES).round(2).tolist() if sizes else None
