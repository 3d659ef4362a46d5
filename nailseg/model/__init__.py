"""The net (smp's), its losses, metrics and schedules, and the LightningModule that trains them."""

import sys

if "segmentation_models_pytorch" not in sys.modules and "wandb" not in sys.modules:
    # timm, which smp imports, imports W&B (~1 s) for training utilities nailseg never calls:
    # hidden from it, W&B is imported only by a run that logs to it
    sys.modules["wandb"] = None  # type: ignore[assignment]
    try:
        import segmentation_models_pytorch  # noqa: F401
    finally:
        del sys.modules["wandb"]
