"""Building any loader backend by name on prepared test data, and reading what it yields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from nailseg.config import CONF_DIR
from nailseg.data.augment import AugOp, AugSpec
from nailseg.data.datamodule import read_split
from nailseg.data.loaders.base import read_records
from nailseg.data.loaders.dali import DaliLoader
from nailseg.data.loaders.kornia_batch import KorniaLoader
from nailseg.data.loaders.torch_workers import TorchLoader

SIZE = (32, 32)
GROUPS = {"a": 0, "b": 1}
SEED = 0  # the tests' loaders draw from one fixed seed
_NORMALIZE = OmegaConf.load(Path(CONF_DIR) / "normalize" / "imagenet.yaml")
MEAN, STD = tuple(_NORMALIZE.mean), tuple(_NORMALIZE.std)  # normalize=imagenet, the default


def spec(*ops: AugOp) -> AugSpec:
    """A spec of `ops` with the default normalisation."""
    return AugSpec(ops, MEAN, STD)


def spec_from(ops: list[dict[str, Any]]) -> AugSpec:
    """A spec from the config form of `ops` with the default normalisation."""
    return AugSpec.from_config(ops, MEAN, STD)


def loader_settings(backend: type, **overrides: Any) -> dict[str, Any]:
    """The settings conf/loader/ gives `backend` (its YAML is their one source; `seed`: `SEED`),
    with `overrides` over them."""
    for path in sorted((Path(CONF_DIR) / "loader").glob("*.yaml")):
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        if values["_target_"].endswith(f".{backend.__name__}"):
            kept = {k: v for k, v in values.items() if not k.startswith("_") and k != "defaults"}
            return {**kept, "seed": SEED, **overrides}
    raise LookupError(f"no conf/loader/*.yaml builds {backend.__name__}")


def trainer_stand_in(
    rank: int = 0, world_size: int = 1, overfit_batches: int = 0, epoch: int = 0
) -> SimpleNamespace:
    """What the datamodule reads of its Lightning trainer, for a rank of any world size without
    starting one: its place, `overfit_batches` and the epoch the fit runs next."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=epoch))
    return SimpleNamespace(
        global_rank=rank,
        world_size=world_size,
        overfit_batches=overfit_batches,
        fit_loop=SimpleNamespace(epoch_progress=progress),
    )


def make_loader(kind: str, root: Path, spec: AugSpec, split: str = "train", **kwargs):
    records = read_records(read_split(root, split), root, GROUPS)
    settings = {"train": split == "train", "batch_size": 20, "image_size": SIZE}
    if kind != "dali":
        settings["num_workers"] = 2 if kind == "torch-workers" else 0
    backend = {"dali": DaliLoader, "kornia": KorniaLoader}.get(kind, TorchLoader)
    return backend(records, spec, **loader_settings(backend, **{**settings, **kwargs}))


@dataclass
class Outputs:
    rows: np.ndarray
    images: np.ndarray
    masks: np.ndarray


def run(loader, epochs: int = 1) -> Outputs:
    rows, images, masks = [], [], []
    for _ in range(epochs):
        for batch in loader:
            rows.append(batch["index"].cpu().numpy())
            images.append(batch["image"].cpu().numpy())
            masks.append(batch["mask"].cpu().numpy())
    return Outputs(np.concatenate(rows), np.concatenate(images), np.concatenate(masks))


EVERYTHING = spec_from(
    [
        {"op": "random_resized_crop", "p": 0.5, "scale": [0.5, 1.0], "ratio": [0.75, 1.33]},
        {"op": "zoom_out", "p": 0.5, "scale": [0.5, 1.0]},
        {"op": "rotate", "p": 0.5, "degrees": [-30, 30]},
        {"op": "hflip", "p": 0.5},
        {"op": "vflip", "p": 0.5},
        {"op": "hue", "p": 0.5, "degrees": [-30, 30]},
        {"op": "saturation", "p": 0.5, "factor": [0.5, 1.5]},
        {"op": "grayscale", "p": 0.2},
        {"op": "gamma", "p": 0.5, "gamma": [0.7, 1.5]},
        {"op": "jpeg", "p": 0.5, "quality": [30, 90]},
        {"op": "gaussian_noise", "p": 0.5, "sigma": [0.0, 0.33]},
        {"op": "gaussian_blur", "p": 0.5, "sigma": [0.5, 1.5]},
        {"op": "brightness", "p": 0.5, "factor": [0.7, 1.3]},
        {"op": "contrast", "p": 0.5, "factor": [0.9, 1.1]},
    ]
)
