"""How to run a checkpoint: what predict, the threshold sweep and export share.

The input size, normalisation and threshold come from the checkpoint's card (model/checkpoint.py),
each overridable, so a model runs as it was validated, even away from its run. A folder that
`export format=smp` wrote runs as its checkpoint: its card is beside the weights.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from nailseg.data.augment import rgb_triple
from nailseg.errors import UserError
from nailseg.io.folder import read_regular
from nailseg.model.checkpoint import (
    CheckpointError,
    card_of,
    legacy_card,
    plain_model,
    read_checkpoint,
    run_dir_of,
    validate_card,
)

DEFAULT_THRESHOLD = 0.5
# the net, or what runs it elsewhere (engine.OnnxNet): a normalised float batch in, logits out
Net = Callable[[torch.Tensor], torch.Tensor]


class PredictError(UserError, RuntimeError):
    """A request predict refuses, or a run it cannot finish: the message says why."""


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


def resolve_spec(cfg: DictConfig) -> InferenceSpec:
    """The spec for `cfg.ckpt`: its card (or, for a checkpoint older than cards, its run folder's
    plain config values) with `cfg`'s non-null overrides applied."""
    ckpt = checkpoint_file(cfg.ckpt)
    card = _exported_card(ckpt) if ckpt.is_dir() else card_of(read_checkpoint(ckpt), ckpt)
    if card is None:
        run_dir = run_dir_of(ckpt)
        card = legacy_card(run_dir) if run_dir is not None else {}
    if cfg.model is not None:
        model = plain_model(cfg.model, "model")
    elif card.get("model") is not None:
        model = plain_model(card["model"], f"the model recorded in {ckpt}")
    else:
        model = None
    image_size = cfg.image_size if cfg.image_size is not None else card.get("image_size")
    mean = cfg.mean if cfg.mean is not None else card.get("mean")
    std = cfg.std if cfg.std is not None else card.get("std")
    if model is None or image_size is None or mean is None or std is None:
        raise CheckpointError(
            f"{ckpt} carries no description of its model and inputs (a checkpoint written "
            "before nailseg recorded them, away from its run folder): pass model=<unet|"
            "segformer|...>, image_size=[h,w], mean=[...] and std=[...] it was trained with"
        )
    if len(image_size) != 2 or min(int(side) for side in image_size) < 1:
        raise CheckpointError(
            f"image_size must be [height, width], both >= 1, got {list(image_size)}"
        )
    try:
        mean, std = rgb_triple(mean, "mean"), rgb_triple(std, "std", positive=True)
    except ValueError as err:
        raise CheckpointError(str(err)) from err
    data_root = card.get("data_root")
    return InferenceSpec(
        ckpt=ckpt,
        model=model,
        image_size=(int(image_size[0]), int(image_size[1])),
        mean=mean,
        std=std,
        threshold=float(card.get("threshold", DEFAULT_THRESHOLD)),
        data_root=Path(data_root) if data_root else None,
    )


def _exported_card(folder: Path) -> dict[str, Any]:
    """The card `export format=smp` wrote beside the weights, validated."""
    from nailseg.inference.export import CARD_FILE  # export imports this module

    try:
        card = json.loads(read_regular(folder / CARD_FILE))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder / CARD_FILE} cannot be read as a card: {err}") from err
    return validate_card(card, str(folder / CARD_FILE))


def checkpoint_file(ckpt: str) -> Path:
    """`ckpt` as a path, when it is a file torch.save could have written (a zip archive) or a
    folder `export format=smp` wrote; else a CheckpointError naming `ckpt=` and what it is."""
    from nailseg.inference.export import CARD_FILE

    path = Path(ckpt)
    if path.is_dir():
        if (path / CARD_FILE).exists():
            return path
        raise CheckpointError(
            f"ckpt={ckpt} is a folder: pass a checkpoint file (a run keeps its checkpoints in "
            "<run>/checkpoints/) or a folder `nailseg export format=smp` wrote"
        )
    if not path.is_file():
        raise CheckpointError(f"ckpt={ckpt}: no such checkpoint")
    if zipfile.is_zipfile(path):  # torch.save's format; what is inside is read_checkpoint's
        return path
    if path.suffix.lower() == ".onnx":
        raise CheckpointError(
            f"ckpt={ckpt} is an ONNX model, not a training checkpoint: pass the checkpoint it "
            "was exported from (predict's engine=onnx runs that with ONNX Runtime)"
        )
    raise CheckpointError(f"ckpt={ckpt} is not a checkpoint (torch.save writes a zip archive)")
