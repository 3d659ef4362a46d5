"""`train.py` body: build every part from the config, fit, test the best checkpoint, report.

The run directory (Hydra's output dir) holds `.hydra/`, `checkpoints/`, `overlays/`, the logger
folders (W&B offline runs included) and `metrics.json`.
"""

from __future__ import annotations

import json
import logging
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from nailseg.atomic import write_text
from nailseg.data.datamodule import NailDataModule
from nailseg.jobs import isolated_job
from nailseg.model.module import SegModule
from nailseg.model.net import compile_net

WANDB_ID_KEY = "nailseg_wandb_run_id"
log = logging.getLogger(__name__)


class WandbRunId(L.Callback):
    """Stores the W&B run id in every checkpoint, so a resumed fit logs to the same W&B run."""

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict
    ) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                checkpoint[WANDB_ID_KEY] = logger.version


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> Path | None:
    """`last`: the newest `last.ckpt` of the runs beside this one; else the path given."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        candidates = [
            p for p in run_dir.parent.glob("*/checkpoints/last.ckpt") if run_dir not in p.parents
        ]
        if not candidates:
            raise FileNotFoundError(
                f"ckpt_path=last: no */checkpoints/last.ckpt under {run_dir.parent}"
            )
        return max(candidates, key=lambda p: p.stat().st_mtime_ns)
    path = Path(ckpt_path)
    if not path.is_file():
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such checkpoint")
    return path


def _wandb_id(ckpt: Path | None) -> str | None:
    if ckpt is None:
        return None
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)
    return checkpoint.get(WANDB_ID_KEY)


def build_loggers(cfg: DictConfig, resume_id: str | None) -> list[Logger]:
    loggers = []
    for name, conf in (cfg.logger or {}).items():
        extra: dict[str, Any] = {}
        if name == "wandb" and resume_id is not None:
            extra = {"id": resume_id, "resume": "allow"}
        loggers.append(instantiate(conf, **extra))
    return loggers


def _choices() -> dict[str, str]:
    """The config group options this run was composed from (loader=dali, aug=heavy, ...)."""
    if not HydraConfig.initialized():
        return {}
    return {
        k: str(v) for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")
    }


def _write_json_atomic(path: Path, payload: dict) -> None:
    write_text(path, json.dumps(payload, indent=2, sort_keys=True))


def _plain_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in sorted(metrics.items())}


def run(cfg: DictConfig) -> float | None:
    """Fit, then test the best checkpoint; returns `cfg.optimized_metric` for sweepers."""
    L.seed_everything(cfg.seed, workers=True)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = resolve_ckpt_path(cfg.ckpt_path, run_dir)

    aug = instantiate(cfg.aug, _convert_="all")
    datamodule = NailDataModule(
        root=cfg.dataset.root,
        image_size=tuple(cfg.dataset.image_size),
        loader=instantiate(cfg.loader),
        aug=aug,
    )
    channels_last = cfg.module.channels_last
    if channels_last is None:
        channels_last = cfg.trainer.accelerator in ("gpu", "cuda") and torch.cuda.is_available()
    module = SegModule(
        net=instantiate(cfg.model),
        optimizer=instantiate(cfg.module.optimizer),
        scheduler=instantiate(cfg.module.scheduler) if cfg.module.scheduler else None,
        loss=cfg.module.loss,
        group_names=datamodule.group_names,
        threshold=cfg.module.threshold,
        channels_last=channels_last,
    )
    if cfg.module.compile:
        compile_net(module.net, cfg.module.compile_mode)
    loggers = build_loggers(cfg, _wandb_id(ckpt))
    callbacks = [instantiate(c) for c in (cfg.callbacks or {}).values()] + [WandbRunId()]
    if not loggers:  # logger=none: nothing to monitor the learning rate into (Lightning refuses)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False)
    for logger in loggers:
        logger.log_hyperparams(
            {"config": OmegaConf.to_container(cfg, resolve=True), "choices": _choices()}
        )

    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt, weights_only=True)
    fit_metrics = _plain_metrics(trainer.callback_metrics)
    checkpoint = next(
        (c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)), None
    )
    best = (
        checkpoint.best_model_path
        if checkpoint is not None and checkpoint.best_model_path
        else None
    )

    test_metrics: dict[str, float] = {}
    if cfg.test:
        trainer.test(module, datamodule=datamodule, ckpt_path=best, weights_only=True)
        test_metrics = {
            k: v
            for k, v in _plain_metrics(trainer.callback_metrics).items()
            if k.startswith("test/")
        }

    if trainer.is_global_zero:
        _write_json_atomic(
            run_dir / "metrics.json",
            {
                "fit": fit_metrics,
                "test": test_metrics,
                "best_checkpoint": best,
                "best_val_dice": float(checkpoint.best_model_score)
                if checkpoint and checkpoint.best_model_score is not None
                else None,
                "choices": _choices(),
                "global_step": trainer.global_step,
                "epochs": trainer.current_epoch,
            },
        )
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()
    return fit_metrics.get(cfg.optimized_metric)


def run_job(cfg: DictConfig) -> float | None:
    """`train.py`'s job: in a sweep (`-m`) a failing job writes `failed.json` into its run dir and
    the sweep goes on (`python -m nailseg.compare` reports it); a single run raises as usual."""
    try:
        with isolated_job():  # DDP ranks re-run this job only; nothing leaks into the next job
            return run(cfg)
    except Exception as err:
        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            raise
        log.exception("job failed; the sweep continues")
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(
            run_dir / "failed.json",
            {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()},
        )
        return None
