"""The losses by name (`module.loss`), and epoch Dice and IoU from pixel counts summed over every
sample, overall and per group, exactly reducible across ranks (nothing to find and nothing found:
1.0; a group without samples: NaN). No update waits for the device; `compute()` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchmetrics import Metric

from nailseg.model import import_smp

smp = import_smp()

_COUNTS = ("tp", "fp", "fn", "samples")


class DiceBCELoss(nn.Module):
    """Soft Dice + BCE, summed: Dice drives overlap, BCE keeps per-pixel gradients and penalises
    false positives on empty masks."""

    def __init__(self) -> None:
        super().__init__()
        self.dice = smp.losses.DiceLoss(smp.losses.BINARY_MODE, from_logits=True)
        self.bce = nn.BCEWithLogitsLoss()

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.dice(logits, target) + self.bce(logits, target)


LOSSES: dict[str, Callable[[], nn.Module]] = {
    "dice_bce": DiceBCELoss,
    "dice": lambda: smp.losses.DiceLoss(smp.losses.BINARY_MODE, from_logits=True),
    "bce": nn.BCEWithLogitsLoss,
    "focal": lambda: smp.losses.FocalLoss(smp.losses.BINARY_MODE),
    "lovasz": lambda: smp.losses.LovaszLoss(smp.losses.BINARY_MODE),
}


def build_loss(name: str) -> nn.Module:
    """The loss module called `name`; a ValueError lists the known names otherwise."""
    try:
        factory = LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}; known: {sorted(LOSSES)}") from None
    return factory()


class SegmentationScores(Metric):
    """TP/FP/FN pixel and sample counts, overall and per group (`update(probs, mask, group)`);
    `compute()`: `dice`, `iou`, `samples` and each per group (`dice_group`, ...)."""

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
        group = group.to(device=pred.device, dtype=torch.long)  # ids of the datamodule's groups
        for name, values in per_sample.items():
            setattr(self, name, getattr(self, name) + values.sum())
            if self.num_groups:
                getattr(self, f"{name}_group").index_add_(0, group, values)

    def compute(self) -> dict[str, torch.Tensor]:
        dice, iou = scores(self.tp, self.fp, self.fn)
        dice_group, iou_group = scores(self.tp_group, self.fp_group, self.fn_group)
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
    """The mean of per-batch values weighted by batch size, exact over ranks, without a sync."""

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


def scores(
    tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dice and IoU from counts, in float64 (large pixel sums stay exact)."""
    tp, fp, fn = (x.double() for x in (tp, fp, fn))
    empty = (tp + fp + fn) == 0
    one = torch.ones_like(tp)
    dice = torch.where(empty, one, 2 * tp / (2 * tp + fp + fn).clamp_min(1))
    iou = torch.where(empty, one, tp / (tp + fp + fn).clamp_min(1))
    return dice.float(), iou.float()
