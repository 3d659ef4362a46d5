"""A tiny trained run laid out as `train.py` leaves it, and the predict/export configs to run on it."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

import nailseg.inference.export  # registers export_schema
import nailseg.inference.predict  # noqa: F401  (registers predict_schema)
from nailseg.io.folder import OwnedFolder
from nailseg.training.run import run as train_run
from support.train import CONF, compose_train, small_overrides


def make_run(root: Path, run_dir: Path) -> Path:
    """Train the tiny UNet one epoch on `root`; write `.hydra/config.yaml` as Hydra would.
    Returns the run's last checkpoint."""
    cfg = compose_train(
        small_overrides(root, "logger=none", "trainer.max_epochs=1", "test=false"), run_dir
    )
    train_run(cfg)  # first: it claims run_dir, which must be new or nailseg's
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    return run_dir / "checkpoints" / "last.ckpt"


def own_run(ckpt: Path, run_dir: Path) -> Path:
    """A run folder of its own at `run_dir` (nailseg's, as train.py makes one) holding `ckpt` and
    its run's `.hydra/config.yaml`: a test may write beside it. Returns its checkpoint."""
    with OwnedFolder.claim(run_dir, "run") as folder:
        for rel in (f"checkpoints/{ckpt.name}", ".hydra/config.yaml"):
            folder.write(rel, (ckpt.parents[1] / rel).read_bytes())
    return run_dir / "checkpoints" / ckpt.name


def constant_checkpoint(ckpt: Path, logit: float, name: str = "constant.ckpt") -> Path:
    """A copy of `ckpt` (beside it, so it belongs to the same run) whose net outputs `logit`
    everywhere: the segmentation head's weights zeroed, its bias set."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    state = checkpoint["state_dict"]
    state["net.segmentation_head.0.weight"].zero_()
    state["net.segmentation_head.0.bias"].fill_(logit)
    out = ckpt.with_name(name)
    torch.save(checkpoint, out)
    return out


def compose_cli(config: str, overrides: list[str]) -> DictConfig:
    """The config `python -m nailseg <command> <overrides>` would run (`config`: its name)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config, overrides=overrides)
