"""Learning-rate schedules that torch lacks (stepped after each optimizer step; as long as the
whole fit unless the config fixes it: `SegModule.configure_optimizers`), and a schedule's length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

# the keyword argument that sets a schedule's length, in the schedules the config groups offer
LENGTH_ARGS = ("T_max", "total_steps")


class WarmupCosineLR(LambdaLR):
    """Linear warm-up over `warmup_fraction` of `total_steps`, then cosine decay that reaches
    `min_lr_ratio` × the base LR at the last step (step `total_steps - 1`)."""

    def __init__(
        self, optimizer: Optimizer, total_steps: int, warmup_fraction: float, min_lr_ratio: float
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"scheduler.total_steps={total_steps}: must be at least 1")
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError(f"scheduler.warmup_fraction={warmup_fraction}: must be in [0, 1)")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"scheduler.min_lr_ratio={min_lr_ratio}: must be in [0, 1]")
        self.total_steps = total_steps
        # at most all steps but the last, which is the decay's end (min_lr_ratio)
        self.warmup_steps = min(round(warmup_fraction * total_steps), total_steps - 1)
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        """The LR multiplier used at (0-based) optimizer step `step`."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = self.total_steps - 1 - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine


def schedule_length(state: Mapping[str, Any]) -> int | None:
    """The steps a schedule spans, from its `state_dict()` (None: no fixed length)."""
    for name in LENGTH_ARGS:
        value = state.get(name)
        if isinstance(value, int):
            return value
    return None
