"""`train.py`'s job: build the run (`build.py`), fit, evaluate the best checkpoint, and write
`metrics.json` into the run folder (its keys: docs/TRAINING.md). A resumed session that trains
nothing keeps the earlier report's figures that only training measures (`MEASURED`).

What a run shows and keeps: the resolved config as a tree (also `config_tree.txt`), the model's
parameters, and no library chatter. Lightning's loggers, imported before Hydra configures
logging, keep a console handler of their own and never reach Hydra's log file:
`route_library_logs` sends them to the root logger.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint, RichModelSummary
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.model_summary import get_formatted_model_size
from lightning.pytorch.utilities.model_summary import get_human_readable_count as count
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table
from rich.tree import Tree

from nailseg.collector import frozen_heap
from nailseg.tables import print_table
from nailseg.training.build import Built, build
from nailseg.training.callbacks import TimeToTarget, TrainSpeedMonitor, start_job_clock
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
MEASURED = (
    "fit",
    "throughput",
    "time_to_target",
    "startup",
)  # what only a session that trains measures
SUMMARISED = ("dice", "iou", "loss")  # the final evaluation's metrics in the run's summary


LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
# the top-level keys shown first, in the order data flows; the rest follow as composed
ORDER = ("dataset", "loader", "aug", "normalize", "model", "optimizer", "scheduler", "module")
CONFIG_TREE = "config_tree.txt"  # the printed tree, kept in the run folder
# Lightning's info messages that say nothing about the run: its advertisements, that our
# ParameterSummary replaces its own summary, and how it counts the schedule's steps
LIGHTNING_CHATTER = (
    "💡 Tip:",
    "Trainer already configured with model summary callbacks",
    "Loading `train_dataloader` to estimate number of stepping batches",
)
# (category, message regex, module regex) of library warnings known to be harmless here
KNOWN_WARNINGS = (
    (  # Lightning 2.6 still uses the LeafSpec that torch deprecated
        FutureWarning,
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        r"lightning\.pytorch\.utilities\._pytree",
    ),
)


def _drop_chatter(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(LIGHTNING_CHATTER)


def quiet_libraries() -> None:
    """Silence what libraries print on every run that says nothing about it: Lightning's tips,
    the known warnings, W&B's banner (the run's summary names its folder; WANDB_SILENT=false
    brings it back)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_drop_chatter)
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message, category, module)
    os.environ.setdefault("WANDB_SILENT", "true")


def _pruned(value: Any) -> Any:
    """`value` without its null leaves and empty mappings or lists (they set nothing)."""
    if isinstance(value, dict):
        kept = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not None and v != {} and v != []}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def _flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1000).removesuffix("...\n").strip()


def _as_yaml(value: Any) -> str:
    """YAML with collections of plain values on one line (`image_size: [384, 384]`)."""
    if not isinstance(value, dict):
        return _flow(value)
    lines = []
    for key, item in value.items():
        inner = item.values() if isinstance(item, dict) else item if isinstance(item, list) else []
        if any(isinstance(v, dict | list) for v in inner):
            dump = yaml.safe_dump({key: item}, default_flow_style=None, sort_keys=False, width=1000)
            lines.append(dump.rstrip())
        else:
            lines.append(f"{key}: {_flow(item)}")
    return "\n".join(lines)


def config_tree(cfg: DictConfig, choices: dict[str, str] | None = None) -> Tree:
    """The resolved config, one branch per top-level key (groups first, in data-flow order, each
    with the option chosen), without null or empty values."""
    choices = choices or {}
    tree = Tree("config", guide_style="dim")
    values = _pruned(OmegaConf.to_container(cfg, resolve=True))
    keys = [k for k in ORDER if k in values] + [k for k in values if k not in ORDER]
    for key in keys:
        node = values[key]
        label = f"[bold]{key}[/]" + (f" ({escape(choices[key])})" if key in choices else "")
        if isinstance(node, dict):
            syntax = Syntax(_as_yaml(node), "yaml", theme="ansi_dark", word_wrap=True)
            tree.add(label).add(syntax)
        else:
            tree.add(f"{label}: {escape(_as_yaml(node))}")
    for key in [k for k in choices if k in cfg and k not in values]:  # sets nothing: logger=none
        tree.add(f"[bold]{key}[/] ({escape(choices[key])})")
    return tree


def print_config_tree(
    cfg: DictConfig, console: Console | None = None, choices: dict[str, str] | None = None
) -> str:
    """Print `config_tree`; returns it as plain text (the run folder's `CONFIG_TREE`)."""
    tree = config_tree(cfg, choices)
    (console or Console()).print(tree)
    plain = Console(file=io.StringIO(), width=1000, color_system=None)
    plain.print(tree)
    return "\n".join(line.rstrip() for line in plain.file.getvalue().splitlines()) + "\n"


class ParameterSummary(RichModelSummary):
    """Lightning's table of the model's parameters without its FLOPs, which it counts only for a
    module with an `example_input_array` (0 otherwise)."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        columns = [(name, cells) for name, cells in summary_data if name != "FLOPs"]
        table = Table(header_style="bold magenta")
        for name, _ in columns:
            table.add_column(name, justify="right" if name == "Params" else "left")
        for row in zip(*(cells for _, cells in columns), strict=True):
            table.add_row(*row)
        print_table(table)
        frozen = total_parameters - trainable_parameters
        Console().print(
            f"parameters: {count(trainable_parameters).strip()} trainable, "
            f"{count(frozen).strip()} frozen "
            f"({get_formatted_model_size(model_size)} MB)",
            highlight=False,
        )


def route_library_logs() -> None:
    """Lightning's messages go to the root logger's handlers (Hydra's console and log file), once
    logging is configured; before that they keep their own console handler."""
    if not logging.getLogger().handlers:
        return
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True


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
        "startup": timers[0].startup() if timers else None,
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
