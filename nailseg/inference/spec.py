"""Running a trained net on photos: what predict, the threshold sweep and export share.

The input size, normalisation and threshold come from the checkpoint's card (model/checkpoint.py),
each overridable, so a model runs as it was validated, even away from its run. Photos are resized
as the evaluation loader does (bilinear, antialiased, then `(x/255 - mean) / std`); probabilities
are brought back to each photo's size bilinearly before the threshold: smooth full-size edges.
"""

from __future__ import annotations

import itertools
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import MISSING, DictConfig

from nailseg.config import ModelConfig
from nailseg.data.augment import rgb_triple
from nailseg.model.checkpoint import (
    CheckpointError,
    card_of,
    legacy_card,
    plain_model,
    read_checkpoint,
    run_dir_of,
)

DEFAULT_THRESHOLD = 0.5
# the net, or what runs it elsewhere (export.OnnxNet): a normalised float batch in, logits out
Net = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class InferenceConfig:
    """Keys that predict and export share: the checkpoint and overrides of what its card says
    (None: take the checkpoint's value)."""

    ckpt: str = MISSING
    model: ModelConfig | None = None  # model=unet model.encoder_name=...: a `model=` group
    image_size: list[int] | None = None  # [height, width] the net runs at
    mean: list[float] | None = None  # normalisation, per RGB channel
    std: list[float] | None = None


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
    card = card_of(read_checkpoint(ckpt), ckpt)
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
    data_root = card.get("data_root")
    return InferenceSpec(
        ckpt=ckpt,
        model=model,
        image_size=(int(image_size[0]), int(image_size[1])),
        mean=_triple(mean, "mean"),
        std=_triple(std, "std", positive=True),
        threshold=float(card.get("threshold", DEFAULT_THRESHOLD)),
        data_root=Path(data_root) if data_root else None,
    )


def checkpoint_file(ckpt: str) -> Path:
    """`ckpt` as a path, when it is a file torch.save could have written (a zip archive); else
    a CheckpointError naming `ckpt=` and what it is instead."""
    path = Path(ckpt)
    if path.is_dir():
        raise CheckpointError(
            f"ckpt={ckpt} is a folder: pass a checkpoint file (a run keeps its checkpoints in "
            "<run>/checkpoints/)"
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


def _triple(
    values: Sequence[float], name: str, positive: bool = False
) -> tuple[float, float, float]:
    try:
        return rgb_triple(values, name, positive)
    except ValueError as err:
        raise CheckpointError(str(err)) from err


def image_tensors(images: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """RGB uint8 HxWx3 arrays as the C×H×W uint8 tensors the functions below take, packed into one
    host buffer and moved in one copy. To a GPU the buffer is pinned and the copy asynchronous: a
    plain copy would first wait for all the work already queued there (a whole batch of
    predictions), and a pinned buffer per photo costs an allocation each."""
    sizes = [image.size for image in images]
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    for part, image in zip(host.split(sizes), images, strict=True):
        part.numpy()[:] = image.reshape(-1)
    moved = host.to(device, non_blocking=True)
    return [
        part.view(image.shape).permute(2, 0, 1)
        for part, image in zip(moved.split(sizes), images, strict=True)
    ]


def to_batch(
    images: Sequence[torch.Tensor], spec: InferenceSpec, size: tuple[int, int] | None = None
) -> torch.Tensor:
    """RGB uint8 C×H×W photos of any sizes (on one device) → one normalised float B×3×h×w batch
    at `size` (None: the input size), in their order (channels-last on CUDA, the layout the net
    runs fastest in there). Each run of consecutive photos of one size is resized in one call: on
    a GPU the calls, not the arithmetic, are the cost (`full_size_probabilities` orders photos by
    size)."""
    device = images[0].device
    resized = [
        F.interpolate(
            torch.stack(run).float(),
            size=size or spec.image_size,
            mode="bilinear",
            align_corners=False,
            antialias=True,
        )
        for run in runs_of_one_size(images)
    ]
    # `torch.tensor(..., device=cuda)` would wait for all the work queued there (the batches
    # before); a copy from pageable memory with non_blocking=True does not, and is safe
    mean, std = (
        torch.tensor([spec.mean, spec.std]).view(2, 1, 3, 1, 1).to(device, non_blocking=True)
    )
    batch = (torch.cat(resized) / 255.0 - mean) / std
    return batch.contiguous(memory_format=torch.channels_last) if device.type == "cuda" else batch


def runs_of_one_size(images: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`images` cut where the shape changes: consecutive photos of one size together."""
    return [list(run) for _, run in itertools.groupby(images, key=lambda image: image.shape)]


def probabilities(net: Net, batch: torch.Tensor, tta: bool = False) -> torch.Tensor:
    """Foreground probabilities B×1×h×w; with `tta`, the mean over the identity, a horizontal and a
    vertical flip (each flipped back), run as one batch of 3B. On CUDA the net runs under bf16
    autocast, as training validated it (`trainer=gpu`); probabilities are float32."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=batch.device.type == "cuda"):
        if not tta:
            return torch.sigmoid(net(batch).float())
        n = len(batch)
        probs = torch.sigmoid(net(torch.cat([batch, batch.flip(3), batch.flip(2)])).float())
    return (probs[:n] + probs[n : 2 * n].flip(3) + probs[2 * n :].flip(2)) / 3.0


@torch.inference_mode()
def full_size_probabilities(
    net: Net,
    images: Sequence[torch.Tensor],
    spec: InferenceSpec,
    tta: bool = False,
    size: tuple[int, int] | None = None,
) -> list[torch.Tensor]:
    """One H×W probability map per C×H×W photo, at the photo's own size (on its device), in the
    photos' order, the net run at `size` (None: the input size). Photos are taken in order of
    size, so each size is resized in and out in one call (bilinear works on each photo alone: the
    values are those of one call per photo)."""
    order = sorted(range(len(images)), key=lambda i: tuple(images[i].shape))
    ordered = [images[i] for i in order]
    probs = probabilities(net, to_batch(ordered, spec, size), tta)
    maps: list[torch.Tensor] = []
    for run in runs_of_one_size(ordered):
        run_probs, probs = probs[: len(run)], probs[len(run) :]
        full = F.interpolate(run_probs, size=run[0].shape[1:], mode="bilinear", align_corners=False)
        maps += full[:, 0].unbind()
    by_photo = dict(zip(order, maps, strict=True))
    return [by_photo[i] for i in range(len(images))]
