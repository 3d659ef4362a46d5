"""`train.py`'s job: build the run (`build.py`), fit, evaluate the best checkpoint, and write
`metrics.json` into the run folder (its keys: docs/TRAINING.md). A resumed session that trains
nothing keeps the earlier report's figures that only training measures (`MEASURED`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from nailseg.collector import frozen_heap
from nailseg.training.build import Built, build
from nailseg.training.callbacks import TimeToTarget, TrainSpeedMonitor, start_job_clock
from nailseg.training.console import (
    CONFIG_TREE,
    print_config_tree,
    quiet_libraries,
    route_library_logs,
)
from nailseg.training.jobs import isolated_job, sweep_job
from nailseg.training.loggers import describe_metrics
from nailseg.training.run_folder import (
    hold,
    is_ours,
    job_log,
    kept,
    rank_error,
    record_failure,
    release,
    write_file,
)

log = logging.getLogger(__name__)
MEASURED = ("fit", "throughput", "time_to_target")  # what only a session that trains measures
SUMMARISED = ("dice", "iou", "loss")  # the final evaluation's metrics in the run's summary


def _choices() -> dict[str, str]:
    """The config group options this run was composed from (loader=dali, aug=heavy, ...)."""
    if not HydraConfig.initialized():
        return {}
    return {
        k: str(v) for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")
    }


def _overrides() -> list[str]:
    """The job's own command-line overrides, as Hydra keeps them: metrics.json records them, so
    compare never shows its scores under another job's overrides."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _job_log(run_dir: Path) -> Path | None:
    """Where a resumed fit's session log goes besides the session's own folder: its run's."""
    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if Path(hydra.runtime.output_dir).absolute() == run_dir.absolute():
        return None  # the session's folder: the log is there already (run_folder.RunFolders)
    return run_dir / f"{hydra.job.name}.log"


def _plain_metrics(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    return {k: float(v) for k, v in sorted(metrics.items()) if k.startswith(prefix)}


def _best(built: Built) -> dict[str, Any]:
    """optimized_metric's best value and checkpoint, from the checkpoint callback watching it
    (restored from the checkpoint on resume); without one (fast_dev_run), the last value."""
    cfg, trainer = built.cfg, built.trainer
    watching = [
        c
        for c in trainer.checkpoint_callbacks
        if isinstance(c, ModelCheckpoint) and c.monitor == cfg.optimized_metric
    ]
    if watching and watching[0].best_model_score is not None:
        value, path = float(watching[0].best_model_score), watching[0].best_model_path or None
    else:
        last = trainer.callback_metrics.get(cfg.optimized_metric)
        value, path = (float(last) if last is not None else None), None
    return {
        "metric": cfg.optimized_metric,
        "mode": cfg.optimized_mode,
        "value": value,
        "checkpoint": path,
        # read on rank 0, whose fit returns once its checkpoint writes are done; another DDP
        # rank could read the file before it is whole (and reports nothing)
        "epoch": _epoch(path) if path and trainer.is_global_zero and is_ours(path) else None,
    }


def _epoch(checkpoint: str) -> int:
    """The epoch a checkpoint was saved in, read from the checkpoint itself (mapped, not read
    whole): its file name is the user's to choose."""
    return int(torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["epoch"])


def _measured_before(path: Path, global_step: int) -> dict[str, Any]:
    """The figures only training measures from the run's earlier report at `path`, if it is
    nailseg's and ended at `global_step` (the fit this session resumed and trained no further)."""
    try:
        earlier = json.loads(path.read_text()) if is_ours(path) else {}
    except ValueError:  # damaged: nothing of it is kept
        return {}
    if not isinstance(earlier, dict) or earlier.get("global_step") != global_step:
        return {}
    return {key: earlier[key] for key in MEASURED if earlier.get(key)}


def _log_group_table(built: Built, metrics: dict[str, float], prefix: str) -> None:
    """The final evaluation per group, as a W&B table (`<prefix>/groups`)."""
    rows = [
        [name, *(metrics.get(f"{prefix}/{k}_group_{name}") for k in ("dice", "iou", "samples"))]
        for name in built.datamodule.group_names
        if f"{prefix}/samples_group_{name}" in metrics
    ]
    for logger in built.loggers:
        if isinstance(logger, WandbLogger) and rows:
            logger.log_table(
                key=f"{prefix}/groups", columns=["group", "dice", "iou", "samples"], data=rows
            )


def _logger_lines(loggers: list[Logger]) -> list[str]:
    """Where each logger's record of the run is, and how to view it."""
    lines = []
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            wandb_run = logger.experiment
            if wandb_run.offline:
                lines.append(f"W&B (offline): wandb sync {wandb_run.settings.sync_dir}")
            else:
                lines.append(f"W&B: {wandb_run.url}")
        elif isinstance(logger, CSVLogger):
            lines.append(f"CSV log: {logger.experiment.metrics_file_path}")
        elif isinstance(logger, TensorBoardLogger):
            lines.append(f"TensorBoard: tensorboard --logdir {logger.log_dir}")
    return lines


def _summary(report: dict[str, Any], run_dir: Path, built: Built, kept: list[Path]) -> str:
    """The run's last lines: where it went, what it reached, and where to look next."""
    lines = [f"run folder: {run_dir}"]
    best = report.get("best")
    if best is not None and best["value"] is not None:
        epoch = f" (epoch {best['epoch']})" if best.get("epoch") is not None else ""
        lines.append(f"best {best['metric']}: {best['value']:.4g}{epoch}")
    if best is not None and best["checkpoint"]:
        lines.append(f"best checkpoint: {best['checkpoint']}")
    if "final" in report:
        final = report["final"]
        scores = {k: v for k, v in final["metrics"].items() if k.split("/")[-1] in SUMMARISED}
        shown = ", ".join(f"{k} {v:.4g}" for k, v in scores.items())
        lines.append(f"final evaluation ({report['evaluated_on']}): {shown}")
        if best is None and final["checkpoint"]:
            lines.append(f"evaluated checkpoint: {final['checkpoint']}")
    lines.append(f"metrics: {run_dir / 'metrics.json'}")
    lines += [f"kept, not nailseg's (so not written): {path}" for path in kept]
    return "\n  ".join(["run summary", *lines, *_logger_lines(built.loggers)])


def _fit(built: Built) -> dict[str, Any]:
    """Fit; the report's fit, throughput, best and step counts."""
    trainer, run_dir = built.trainer, Path(built.cfg.run_dir)
    checkpoint = built.resume.checkpoint if built.resume else None
    with frozen_heap():  # no full collection walks the built run's objects mid-fit
        trainer.fit(
            built.module, datamodule=built.datamodule, ckpt_path=checkpoint, weights_only=True
        )
    timers = [c for c in trainer.callbacks if isinstance(c, TimeToTarget)]
    speed = [c for c in trainer.callbacks if isinstance(c, TrainSpeedMonitor)]
    report = {
        "fit": _plain_metrics(trainer.callback_metrics),
        "throughput": speed[0].summary() if speed else None,
        "world_size": trainer.world_size,
        "time_to_target": timers[0].reached if timers else None,
        "best": _best(built),
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
    }
    if built.resume is not None and trainer.global_step == built.resume.global_step:
        report |= _measured_before(run_dir / "metrics.json", trainer.global_step)
    return report


def _evaluate(built: Built, checkpoint: str | Path | None) -> dict[str, Any]:
    """The final evaluation of `checkpoint` on the final split, for the report."""
    trainer, module, datamodule = built.trainer, built.module, built.datamodule
    trainer.test(module, datamodule=datamodule, ckpt_path=checkpoint, weights_only=True)
    return {
        "evaluated_on": datamodule.final_split,
        "final": {
            "checkpoint": str(checkpoint) if checkpoint else None,
            "metrics": _plain_metrics(trainer.callback_metrics, f"{module.test_prefix}/"),
        },
    }


def _report(built: Built) -> dict[str, Any]:
    """Fit and evaluate as `cfg.train` and `cfg.test` say; what metrics.json holds."""
    cfg = built.cfg
    checkpoint = built.resume.checkpoint if built.resume else None
    report: dict[str, Any] = {
        "choices": _choices(),
        "overrides": _overrides(),
        "tags": list(cfg.tags),
        "resumed_from": str(checkpoint) if checkpoint else None,
    }
    if cfg.train:
        report |= _fit(built)
        checkpoint = report["best"]["checkpoint"]
        # rank 0 wrote it, or found a user's file there: every rank follows its word
        if checkpoint and not built.trainer.strategy.broadcast(is_ours(checkpoint)):
            log.warning("no final evaluation: the best checkpoint was not written")
            return report
    if cfg.test or not cfg.train:
        report |= _evaluate(built, checkpoint)
    return report


def _start_loggers(built: Built) -> None:
    describe_metrics(built.loggers)
    for logger in built.loggers:
        logger.log_hyperparams(
            {"config": OmegaConf.to_container(built.cfg, resolve=True), "choices": _choices()}
        )


def _finish(built: Built, report: dict[str, Any]) -> None:
    """Write metrics.json, close the loggers and print the summary (rank 0)."""
    run_dir, rank_zero = Path(built.cfg.run_dir), built.trainer.is_global_zero
    if rank_zero:
        text = json.dumps(report, indent=2, sort_keys=True)
        write_file(run_dir / "metrics.json", text.encode())
        hold(run_dir).update_marker(failed=None)  # an earlier attempt's, now resumed
        if "final" in report:
            _log_group_table(built, report["final"]["metrics"], built.module.test_prefix)
        summary = _summary(report, run_dir, built, kept())
    for logger in built.loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.finish()
    if rank_zero:
        log.info(summary)


def run(cfg: DictConfig) -> float | None:
    """Build the run, fit, evaluate the best checkpoint and report (train.py's job).

    Args:
        cfg: train.py's composed config; `train=false` evaluates `ckpt_path` only.

    Returns:
        The best value of `cfg.optimized_metric` (what a sweeper ranks); None without a fit.

    Raises:
        UserError: a request that cannot run, named in one line.
    """
    start_job_clock()
    quiet_libraries()
    route_library_logs()
    try:
        built = build(cfg)  # claims the run folder (run_folder.hold); other ranks attach
        cfg = built.cfg
        log_to = _job_log(Path(cfg.run_dir))
        with job_log(log_to) if log_to else contextlib.nullcontext():
            if built.trainer.is_global_zero:
                tree = print_config_tree(cfg, choices=_choices())
                write_file(Path(cfg.run_dir) / CONFIG_TREE, tree.encode())
            if built.resume is not None:
                log.info("checkpoint %s; writing to %s", built.resume.checkpoint, cfg.run_dir)
            _start_loggers(built)
            report = _report(built)
            _finish(built, report)
    finally:
        release(cfg.run_dir)
    return report["best"]["value"] if cfg.train else None


def run_job(cfg: DictConfig) -> float | None:
    """`train.py`'s job: in a sweep (`-m`) a failing job's error is kept in its folder's marker and
    the sweep goes on (`python -m nailseg compare` reports it; a later run that completes in that
    folder, such as the job resumed, clears it); a single run raises as usual."""
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        # DDP ranks re-run this job only; nothing leaks into the next job
        with isolated_job():
            try:
                return run(cfg)
            except Exception as err:  # in here: the ranks' process group is still up
                raise rank_error(job_dir, err) from err
    except Exception as err:
        if not sweep_job():
            raise
        log.exception("job failed; the sweep continues")
        record_failure(job_dir, err)
        return None
