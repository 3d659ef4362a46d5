"""Binary segmentation losses on logits by name (`module.loss=...`). Soft Dice is over the whole
batch (smp's binary mode) and cannot penalise false positives on nail-free images: `dice_bce`.
"""

from __future__ import annotations

from collections.abc import Callable

import segmentation_models_pytorch as smp
import torch
from torch import nn


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
