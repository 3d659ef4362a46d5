"""Epoch-level Dice and IoU from pixel counts summed over every sample, overall and per group:
independent of how samples fall into batches, and exactly reducible across ranks.

A pixel is foreground when its probability is `> threshold`; with no true and no predicted
foreground Dice = IoU = 1.0; a group with no samples this epoch scores NaN. No update waits for the
device (torchmetrics' MeanMetric and SumMetric would); `compute()` syncs once, at epoch end.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

_COUNTS = ("tp", "fp", "fn", "samples")


class SegmentationScores(Metric):
    """Accumulates TP/FP/FN pixel counts and sample counts, overall and for `num_groups` groups.

    `update(probs, target, group)`: probs and target B×1×H×W (probabilities, {0, 1} mask), group
    int64 B (indices into the caller's list of group names; ignored when `num_groups` is 0).
    `compute()` returns a dict of `dice`, `iou`, `samples` (scalars) and `dice_group`,
    `iou_group`, `samples_group` (tensors of length `num_groups`).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, num_groups: int, threshold: float) -> None:
        super().__init__()
        self.num_groups = num_groups
        self.threshold = threshold
        for name in _COUNTS:
            self.add_state(name, torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
            self.add_state(
                f"{name}_group", torch.zeros(num_groups, dtype=torch.long), dist_reduce_fx="sum"
            )

    def update(self, probs: torch.Tensor, target: torch.Tensor, group: torch.Tensor) -> None:
        if probs.shape != target.shape:
            raise ValueError(f"probs {tuple(probs.shape)} and target {tuple(target.shape)} differ")
        pred = (probs > self.threshold).flatten(1)
        true = (target > 0.5).flatten(1)
        per_sample = {
            "tp": (pred & true).sum(1),
            "fp": (pred & ~true).sum(1),
            "fn": (~pred & true).sum(1),
            "samples": torch.ones(len(pred), dtype=torch.long, device=pred.device),
        }
        if self.num_groups:
            # ids come from the data module's name -> id map (loaders/base.py refuses unknown
            # names up front); an id out of range still fails, in index_add_
            group = group.to(device=pred.device, dtype=torch.long)
        for name, values in per_sample.items():
            setattr(self, name, getattr(self, name) + values.sum())
            if self.num_groups:
                getattr(self, f"{name}_group").index_add_(0, group, values)

    def compute(self) -> dict[str, torch.Tensor]:
        dice, iou = _scores(self.tp, self.fp, self.fn)
        dice_group, iou_group = _scores(self.tp_group, self.fp_group, self.fn_group)
        unseen = self.samples_group == 0
        return {
            "dice": dice,
            "iou": iou,
            "samples": self.samples,
            "dice_group": dice_group.masked_fill(unseen, float("nan")),
            "iou_group": iou_group.masked_fill(unseen, float("nan")),
            "samples_group": self.samples_group,
        }


class BatchMean(Metric):
    """The mean of per-batch values weighted by their batch sizes (`update(value, n)`: value a
    scalar tensor, n an int), summed exactly over DDP ranks; updated without a device sync."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, n: int) -> None:
        # in-place ops with a Python number: the number goes to the kernel, nothing is copied
        self.total += value.detach().double() * n
        self.count += n

    def compute(self) -> torch.Tensor:
        return (self.total / self.count).float()


def _scores(
    tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dice and IoU from counts (in float64, so large pixel sums stay exact); 1.0 in the empty
    case (nothing to find and nothing predicted)."""
    tp, fp, fn = (x.double() for x in (tp, fp, fn))
    empty = (tp + fp + fn) == 0
    one = torch.ones_like(tp)
    dice = torch.where(empty, one, 2 * tp / (2 * tp + fp + fn).clamp_min(1))
    iou = torch.where(empty, one, tp / (tp + fp + fn).clamp_min(1))
    return dice.float(), iou.float()
