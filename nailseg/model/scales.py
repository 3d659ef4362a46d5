"""Scales: how large an image reaches the net, as a factor of the input size. Training's
evaluation (`module.eval_scales`) and predict (`scales=`) mean the same by a factor."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SIZE_MULTIPLE = 32  # UNet's and SegFormer's encoders halve the input five times


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
