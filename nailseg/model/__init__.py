"""The net (smp's), its losses, metrics and schedules, and the LightningModule that trains them."""

import sys
from types import ModuleType
from typing import Any

PLAIN = (str, int, float, bool, type(None))  # the values a card or a model description may hold
_SHOWN_CHARS = 80  # of a refused value, in its one-line message


def import_smp() -> ModuleType:
    """segmentation_models_pytorch, imported at first use (the commands' checks run before it)
    with W&B hidden from timm, which smp imports and which imports W&B (~1 s) for training
    utilities nailseg never calls: a run that logs to W&B imports it itself."""
    if "segmentation_models_pytorch" not in sys.modules and "wandb" not in sys.modules:
        sys.modules["wandb"] = None  # type: ignore[assignment]
        try:
            import segmentation_models_pytorch
        finally:
            del sys.modules["wandb"]
    import segmentation_models_pytorch

    return segmentation_models_pytorch


def refusal(where: str, key: str, value: Any, problem: str) -> str:
    """`WHERE<key>=<value>: problem`, the value cut to a line's share."""
    shown = repr(value)
    shown = shown[:_SHOWN_CHARS] + "…" if len(shown) > _SHOWN_CHARS else shown
    return f"{where}{key}={shown}: {problem}".replace("\n", " ")
