"""`train.py`'s job: build the run (`build.py`), fit, evaluate the best checkpoint, and write
`metrics.json` (its keys: docs/TRAINING.md); what a run prints, and the library chatter it keeps
quiet. A resumed session that trains nothing keeps the earlier figures only training measures.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.model_summary import get_human_readable_count as count
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.tree import Tree

from nailseg.collector import frozen_heap
from nailseg.training.build import Built, build
from nailseg.training.callbacks import TimeToTarget, TrainSpeedMonitor, start_job_clock
from nailseg.training.jobs import isolated_job, sweep_job
from nailseg.training.loggers import draw_curves, start_loggers
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
MEASURED = ("fit", "throughput", "time_to_target", "startup")  # only a session that trains
SUMMARISED = ("dice", "iou", "loss")  # the final evaluation's metrics in the run's summary


LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
# the top-level keys shown first, in the order data flows; the rest follow as composed
ORDER = ("dataset", "loader", "aug", "normalize", "model", "optimizer", "scheduler", "module")
CONFIG_TREE = "config_tree.txt"  # the config tree, kept in the run folder
CURVES = "curves.png"  # the fit's values by epoch, drawn from the CSV log
# Lightning's info messages that say nothing the run's own lines do not (the summary names the
# checkpoints, the epoch lines the fit's end), and the loggers that give them
LIGHTNING_CHATTER = (
    "💡 Tip:",
    "Trainer already configured with model summary callbacks",
    "Loading `train_dataloader` to estimate number of stepping batches",
    "Seed set to",
    "TPU available:",
    "HPU available:",
    "`Trainer.fit` stopped:",
    "Restoring states from the checkpoint path",
    "Loaded model weights from the checkpoint",
)
CHATTY = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.seed")
# (category, message regex, module regex) of library warnings known to be harmless here
KNOWN_WARNINGS = [  # Lightning 2.6 still uses the LeafSpec that torch deprecated
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch"),
    # epoch values are what the run reports; a short epoch logs no step value
    (UserWarning, r"The number of training batches \(\d+\) is smaller than the logging", ""),
    # a resumed fit's own folders (its CSV log continues); an evaluation's checkpoint read elsewhere
    (UserWarning, r"(Experiment logs|Checkpoint) directory .* exists and is not empty", ""),
    (UserWarning, r"The dirpath has changed from", ""),
]


def _not_chatter(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(LIGHTNING_CHATTER)


def quiet_libraries() -> None:
    """Silence Lightning's tips, the known warnings and W&B's banner (WANDB_SILENT=false); once
    logging is configured, Lightning's messages go to its handlers (console and log file)."""
    for name in CHATTY:
        logging.getLogger(name).addFilter(_not_chatter)
    for category, message, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message, category, module)
    os.environ.setdefault("WANDB_SILENT", "true")
    for name in LIBRARY_LOGGERS if logging.getLogger().handlers else ():
        logging.getLogger(name).handlers.clear()  # its own console handler, set at import
        logging.getLogger(name).propagate = True


def _pruned(value: Any) -> Any:
    """`value` without its null leaves and empty mappings or lists (they set nothing)."""
    if isinstance(value, dict):
        kept = {k: _pruned(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not None and v != {} and v != []}
    return [_pruned(v) for v in value] if isinstance(value, list) else value


class _Compact(yaml.SafeDumper):
    """YAML with lists of plain values on one line (`image_size: [384, 384]`)."""

    def represent_list(self, data: list) -> yaml.Node:
        flat = not any(isinstance(v, dict | list) for v in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Compact.add_representer(list, _Compact.represent_list)


def config_tree(cfg: DictConfig, choices: dict[str, str]) -> str:
    """The resolved config as a tree, one branch per top-level key (groups first, in data-flow
    order, each with the option chosen), without null or empty values, as plain text."""
    tree = Tree("config", guide_style="dim")
    values = _pruned(OmegaConf.to_container(cfg, resolve=True))
    keys = [k for k in ORDER if k in values] + [k for k in values if k not in ORDER]
    keys += [k for k in choices if k in cfg and k not in values]  # sets nothing: logger=none
    for key in keys:
        label = f"{key} ({choices[key]})" if key in choices else key
        text = yaml.dump(values.get(key), Dumper=_Compact, sort_keys=False, width=1000)
        text = text.removesuffix("...\n").strip()  # a plain value's end-of-document mark
        if isinstance(values.get(key), dict):
            tree.add(label).add(text)
        else:
            tree.add(f"{label}: {text}" if key in values else label)
    plain = Console(file=io.StringIO(), width=1000, color_system=None)
    plain.print(tree, markup=False, highlight=False)
    return "\n".join(line.rstrip() for line in plain.file.getvalue().splitlines()) + "\n"


class ParameterSummary(ModelSummary):
    """The model's parameters in one line, in place of Lightning's table."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            total = sum(p.numel() for p in pl_module.parameters())
            trainable = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
            size = sum(p.numel() * p.element_size() for p in pl_module.parameters()) / 1e6
            log.info(
                "parameters: %s trainable, %s frozen (%.1f MB)",
                count(trainable).strip(), count(total - trainable).strip(), size,
            )  # fmt: skip


def _choices() -> dict[str, str]:
    """The config group options this run was composed from (loader=dali, aug=heavy, ...)."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    return {k: str(v) for k, v in choices.items() if not k.startswith("hydra")}


def _overrides() -> list[str]:
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
    """optimized_metric's best value and checkpoint, from the checkpoint callback watching it;
    without one (fast_dev_run), the last value."""
    cfg, trainer = built.cfg, built.trainer
    watching = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    watching = [c for c in watching if c.monitor == cfg.optimized_metric]
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
        # on rank 0, whose fit returns once its checkpoint writes are done
        "epoch": _epoch(path) if path and trainer.is_global_zero and is_ours(path) else None,
    }


def _epoch(checkpoint: str) -> int:
    """The epoch a checkpoint was saved in (its file name is the user's to choose)."""
    return int(torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["epoch"])


def _measured_before(path: Path, global_step: int) -> dict[str, Any]:
    """The figures only training measures from the earlier report at `path`, if it ended at
    `global_step` (the fit this session resumed and trained no further)."""
    try:
        earlier = json.loads(path.read_text()) if is_ours(path) else {}
    except ValueError:  # damaged: nothing of it is kept
        return {}
    if not isinstance(earlier, dict) or earlier.get("global_step") != global_step:
        return {}
    return {key: earlier[key] for key in MEASURED if earlier.get(key)}


def _logger_lines(loggers: list[Logger]) -> list[str]:
    """Where each logger's record of the run is, and how to view it."""
    lines = []
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            wandb_run, sync = logger.experiment, f"wandb sync {logger.experiment.settings.sync_dir}"
            lines.append(f"W&B (offline): {sync}" if wandb_run.offline else f"W&B: {wandb_run.url}")
        elif isinstance(logger, TensorBoardLogger):
            lines.append(f"TensorBoard: tensorboard --logdir {logger.log_dir}")
    return lines + [f"CSV log: {path}" for path in _csv_logs(loggers) if path.is_file()]


def _csv_logs(loggers: list[Logger]) -> Iterator[Path]:
    for logger in loggers:
        if isinstance(logger, CSVLogger):
            yield Path(logger.log_dir) / ExperimentWriter.NAME_METRICS_FILE


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
    lines += [f"curves: {run_dir / CURVES}"] if (run_dir / CURVES).is_file() else []
    lines += [f"kept, not nailseg's (so not written): {path}" for path in kept]
    return "\n  ".join(["run summary", *lines, *_logger_lines(built.loggers)])


def _fit(built: Built) -> dict[str, Any]:
    """Fit; the report's fit, throughput, best and step counts."""
    trainer, run_dir = built.trainer, Path(built.cfg.run_dir)
    checkpoint = built.resume.checkpoint if built.resume else None
    with frozen_heap():  # no full collection walks the built run's objects mid-fit
        trainer.fit(built.module, built.datamodule, ckpt_path=checkpoint, weights_only=True)
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


def _report(built: Built) -> dict[str, Any]:
    """Fit and evaluate as `cfg.train` and `cfg.test` say; what metrics.json holds."""
    cfg = built.cfg
    checkpoint = built.resume.checkpoint if built.resume else None
    report: dict[str, Any] = {
        "choices": _choices(),
        "overrides": _overrides(),  # compare shows a metrics.json only under its own
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
    if cfg.test or not cfg.train:  # the final evaluation of `checkpoint` on the final split
        trainer, module, data = built.trainer, built.module, built.datamodule
        trainer.test(
            module, datamodule=data, ckpt_path=checkpoint, weights_only=True, verbose=False
        )
        metrics = _plain_metrics(trainer.callback_metrics, f"{module.test_prefix}/")
        report["evaluated_on"] = data.final_split
        report["final"] = {
            "checkpoint": str(checkpoint) if checkpoint else None,
            "metrics": metrics,
        }
    return report


def _finish(built: Built, report: dict[str, Any]) -> None:
    """Write metrics.json, close the loggers (TensorBoard's `hp_metric`: the best value) and print
    the summary (rank 0)."""
    run_dir, rank_zero = Path(built.cfg.run_dir), built.trainer.is_global_zero
    if rank_zero:
        csv_log = next(_csv_logs(built.loggers))
        if csv_log.is_file():  # none after fast_dev_run, which logs nothing
            report["history"] = os.path.relpath(csv_log, run_dir)
        if built.cfg.train and csv_log.is_file():
            draw_curves(csv_log, run_dir / CURVES)
        text = json.dumps(report, indent=2, sort_keys=True)
        write_file(run_dir / "metrics.json", text.encode())
        hold(run_dir).update_marker(failed=None)  # an earlier attempt's, now resumed
        summary = _summary(report, run_dir, built, kept())
    metrics, prefix = report.get("final", {}).get("metrics", {}), built.module.test_prefix
    rows = [  # the final evaluation per group, as a W&B table
        [name, *(metrics.get(f"{prefix}/{k}_group_{name}") for k in ("dice", "iou", "samples"))]
        for name in built.datamodule.group_names
        if f"{prefix}/samples_group_{name}" in metrics
    ]
    best = (report.get("best") or {}).get("value")
    for logger in built.loggers:
        if isinstance(logger, WandbLogger):
            if rows and rank_zero:
                columns = ["group", "dice", "iou", "samples"]
                logger.log_table(key=f"{prefix}/groups", columns=columns, data=rows)
            logger.experiment.finish()
        elif isinstance(logger, TensorBoardLogger) and best is not None:  # its HPARAMS' column
            logger.log_hyperparams(logger.hparams, {"hp_metric": best}, report["global_step"])
            logger.finalize("success")  # written out: nothing closes it later
    if rank_zero:
        log.info(summary)


def _resume_hint(built: Built) -> None:
    """How to continue an interrupted fit: the command as given, resuming its own last.ckpt."""
    last, script = Path(built.cfg.run_dir) / "checkpoints" / "last.ckpt", sys.argv[0]
    if not (built.trainer.interrupted and built.trainer.is_global_zero):
        return
    given = [o for o in _overrides() if not o.startswith("ckpt_path=")]
    program = f"python {os.path.basename(script)}" if script.endswith(".py") else script  # nailseg
    command = " ".join([program, *given, f"ckpt_path={last}"])
    log.warning("interrupted; %s", f"to continue: {command}" if is_ours(last) else "no checkpoint")


def run(cfg: DictConfig) -> float | None:
    """Build, fit, evaluate the best checkpoint (`train=false`: `ckpt_path` only) and report;
    returns the best `cfg.optimized_metric` (what a sweeper ranks), None without a fit."""
    start_job_clock()
    quiet_libraries()
    main_thread = threading.current_thread() is threading.main_thread()
    interrupt = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl-C once it handled one
    try:
        built = build(cfg)  # claims the run folder (run_folder.hold); other ranks attach
        cfg = built.cfg
        log_to = _job_log(Path(cfg.run_dir))
        with job_log(log_to) if log_to else contextlib.nullcontext():
            if built.trainer.is_global_zero:
                tree = config_tree(cfg, _choices())
                write_file(Path(cfg.run_dir) / CONFIG_TREE, tree.encode())
                if cfg.extras.print_config:
                    print(tree, end="")
            if built.resume is not None:
                log.info("checkpoint %s; writing to %s", built.resume.checkpoint, cfg.run_dir)
            if built.finished:  # nothing is trained, evaluated or rewritten, no logger starts
                ckpt = built.resume.checkpoint
                log.info(
                    "%s finished its fit (step %d): nothing to resume. To train it further, "
                    "ckpt_path=%s with more trainer.max_epochs and scheduler=none (a resumed "
                    "schedule keeps its length), or fine-tune its whole net in a new run: "
                    "init_from=%s", cfg.run_dir, built.resume.global_step, ckpt, ckpt,
                )  # fmt: skip
                return None
            start_loggers(built.loggers, cfg, _choices())
            try:
                report = _report(built)
            except SystemExit:  # Lightning's, after Ctrl-C or SIGTERM ended the fit
                _resume_hint(built)
                raise
            _finish(built, report)
    finally:
        release(cfg.run_dir)
        if main_thread and interrupt is not None:  # a caller's Ctrl-C works again
            signal.signal(signal.SIGINT, interrupt)
    return report["best"]["value"] if cfg.train else None


def run_job(cfg: DictConfig) -> float | None:
    """`train.py`'s job: in a sweep (`-m`) a failing job's error is kept in its folder's marker
    (compare reports it; a later run that completes there clears it) and the sweep goes on."""
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
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
