"""Compose and run the real `train.py` config in-process, as Hydra would, on small settings."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import ClassVar

import lightning as L
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from nailseg.config import CONF_DIR
from nailseg.training.run import run

CONF = Path(CONF_DIR)

# a UNet small enough to train in seconds on 2 cores
TINY_UNET = [
    "model=unet",
    "+model.options.encoder_depth=3",
    "+model.options.decoder_channels=[16,8,4]",
]


def compose_train(overrides: list[str], run_dir: Path | None = None) -> DictConfig:
    """The config `python train.py <overrides>` would run, with Hydra's runtime info set."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    if run_dir is not None:
        cfg.hydra.runtime.output_dir = str(run_dir)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    if run_dir is not None:
        cfg.run_dir = str(run_dir)
    return cfg


def small_overrides(
    root: Path, *extra: str, device: str = "cpu", logger: str | None = "none"
) -> list[str]:
    """Tiny images, tiny model, no progress bar, no logger: an epoch of the fixture data takes ~1 s
    on CPU. `extra` wins (`logger=wandb` where W&B is the subject: it starts in ~1.5 s);
    `logger=None` leaves the logger to the config (the default, W&B, or a debug preset's).

    `device="gpu"` runs the same on CUDA (trainer=gpu, DALI GPU operators)."""
    return [
        *([f"logger={logger}"] if logger else []),
        f"dataset.root={root}",
        "dataset.image_size=[32,32]",
        "loader.batch_size=4",
        f"loader.device={device}",
        f"trainer={device}",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "trainer.log_every_n_steps=1",
        "~callbacks.progress_bar",
        *TINY_UNET,
        *extra,
    ]


def train(root: Path, run_dir: Path, *extra: str, device: str = "cpu") -> float | None:
    return run(compose_train(small_overrides(root, *extra, device=device), run_dir))


class FreezeProbe(L.Callback):
    """Records, at each training epoch's start, how many objects Python's collector holds frozen
    (`+callbacks.freeze._target_=support.train.FreezeProbe`)."""

    seen: ClassVar[list[int]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        FreezeProbe.seen.append(gc.get_freeze_count())
