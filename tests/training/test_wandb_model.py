"""W&B logs the best checkpoint as a model artifact when online; offline it does not try."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from support.train import CONF

from nailseg.training.loggers import WANDB_DIRS, build_loggers


def _wandb_logger(tmp_path, monkeypatch, env_mode: str | None, **conf_values):
    for var in WANDB_DIRS:
        monkeypatch.delenv(var, raising=False)
    if env_mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env_mode)
    conf = OmegaConf.load(CONF / "logger" / "wandb.yaml")
    conf.wandb.tags = []
    conf.wandb.merge_with(conf_values)
    cfg = OmegaConf.create({"logger": conf, "run_dir": str(tmp_path), "task_name": "train"})
    logger, csv_log = build_loggers(cfg, None)  # its run starts on first use; a CSV log beside
    assert type(csv_log).__name__ == "ContinuedCSVLogger"
    assert logger._experiment is None  # nothing was started, nothing uploaded
    return logger


@pytest.mark.parametrize(
    ("env_mode", "conf_values", "logged"),
    [
        (None, {}, False),  # the config's default: offline
        (None, {"mode": "online"}, True),
        ("offline", {"mode": None}, False),
        (None, {"mode": None}, True),  # neither says: wandb.init's default is online
        ("offline", {"mode": "online"}, True),  # wandb.init's argument wins over WANDB_MODE
        (None, {"mode": "disabled"}, False),
        (None, {"mode": "online", "log_model": False}, False),
    ],
)
def test_the_best_checkpoint_is_logged_as_a_model_only_online(
    tmp_path, monkeypatch, env_mode, conf_values, logged
):
    logger = _wandb_logger(tmp_path, monkeypatch, env_mode, **conf_values)
    assert logger._log_model is logged


def test_only_the_monitored_checkpoint_is_logged(tmp_path, monkeypatch):
    """last.ckpt, logged after the best, would take its `best` alias."""
    logger = _wandb_logger(tmp_path, monkeypatch, None, mode="online")
    best = ModelCheckpoint(dirpath=tmp_path, monitor="val/dice", mode="max")
    last = ModelCheckpoint(dirpath=tmp_path, filename="last", monitor=None)
    for callback in (best, last):
        logger.after_save_checkpoint(callback)
    assert list(logger._checkpoint_callbacks.values()) == [best]
