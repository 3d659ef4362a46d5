"""The `logger=` group's loggers, each one's folder reserved before it writes there: W&B kept
inside the run folder, named for a sweep's job; a CSV log that a resumed fit continues."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from omegaconf import DictConfig, OmegaConf

from nailseg.io.atomic import NotOursError
from nailseg.io.folder import read_regular
from nailseg.training.jobs import sweep_job
from nailseg.training.resume import Resume
from nailseg.training.run_folder import first_rank, reserve, write_file

# where W&B keeps its caches and stages tables, unless told (else under the home folder)
WANDB_DIRS = {"WANDB_CACHE_DIR": "cache", "WANDB_DATA_DIR": "data"}
_wandb_dirs_set: dict[str, str] = {}  # the values set here, which a sweep's next job moves


def build_loggers(cfg: DictConfig, resumed: Resume | None) -> list[Logger]:
    """The `logger=` group's loggers and a CSV log beside them, which a resumed fit continues."""
    loggers, keep = [], resumed.global_step if resumed is not None and cfg.train else None
    for name, conf in (cfg.logger or {}).items():
        fit = resumed if keep is not None else None  # an evaluation is a W&B run of its own
        extra = _wandb_args(conf, cfg.run_dir, fit) if name == "wandb" else {}
        if name == "csv":
            extra["keep_steps_before"] = keep
        loggers.append(instantiate(conf, **extra))
    if not any(isinstance(logger, CSVLogger) for logger in loggers):
        loggers.append(ContinuedCSVLogger(cfg.run_dir, "csv", "", keep_steps_before=keep))
    return loggers


def draw_curves(csv_log: Path, path: Path) -> None:
    """`path` (curves.png) from the CSV log: the losses, val Dice per group, the learning rate."""
    import pandas as pd
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no figure to close

    frame = pd.read_csv(io.BytesIO(read_regular(csv_log)))
    epochs = frame.groupby("epoch").last() if "epoch" in frame else pd.DataFrame()
    dice = [c for c in epochs if c == "val/dice" or c.startswith("val/dice_group_")]
    fig = Figure(figsize=(15, 4))
    axes = fig.subplots(1, 3)
    for ax, title, columns in (
        (axes[0], "loss", [c for c in ("train/loss", "val/loss") if c in epochs]),
        (axes[1], "val Dice: all and per group", dice),
    ):
        for column in columns:
            ax.plot(epochs.index, epochs[column], marker="o", label=column)
        ax.set(title=title, xlabel="epoch")
        ax.xaxis.get_major_locator().set_params(integer=True)
    for column in [c for c in frame if c.startswith("lr-")]:
        rows = frame[["step", column]].dropna()
        axes[2].plot(rows["step"], rows[column], marker=".", label=column)
    axes[2].set(title="learning rate", xlabel="step")
    for ax in [ax for ax in axes if ax.lines]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    write_file(path, lambda f: fig.savefig(f, format="png", dpi=100))


def reserve_folders(loggers: list[Logger], run_dir: str) -> None:
    """Each logger's folder reserved before it writes there (by the first rank: the only writer)."""
    for logger in loggers if first_rank() else []:
        if isinstance(logger, WandbLogger):  # its service process writes on after the run
            reserve(Path(logger.save_dir or run_dir) / "wandb", lasting=True)
        elif isinstance(logger, CSVLogger | TensorBoardLogger):
            reserve(logger.log_dir)


def _wandb_args(conf: DictConfig, run_dir: str, resumed: Resume | None) -> dict[str, Any]:
    """W&B's caches in the run folder (a value the user set is kept, one set here for an earlier
    job moves); the run id a resumed checkpoint names; in a sweep, a group named after the sweep
    folder and a name from the job's overrides, paths left out (unless `group`, `name` are set)."""
    for var, sub in WANDB_DIRS.items():
        if os.environ.get(var) in (None, _wandb_dirs_set.get(var)):
            folder = Path(conf.get("save_dir") or run_dir) / "wandb" / sub
            _wandb_dirs_set[var] = os.environ[var] = str(folder)
    extra: dict[str, Any] = {}
    if resumed is not None and resumed.card.get("wandb_run_id") is not None:
        extra |= {"id": resumed.card["wandb_run_id"], "resume": "allow"}
    if sweep_job():
        hydra = HydraConfig.get()
        if conf.get("group") is None:
            extra["group"] = Path(hydra.sweep.dir).name
        if conf.get("name") is None:
            shown = [o for o in hydra.overrides.task if "/" not in o.split("=", 1)[-1]]
            extra["name"] = ",".join(shown) or "defaults"
    mode = conf.get("mode") or os.environ.get("WANDB_MODE") or "online"  # as wandb.init reads it
    if conf.get("log_model") and (mode not in ("online", "shared") or conf.get("offline")):
        extra["log_model"] = False  # an offline run has nowhere to upload it
    return extra


class BestModelWandbLogger(WandbLogger):
    """Lightning's W&B logger; `log_model=true` logs the monitored checkpoint (the best) at the
    end of a fit, not `last.ckpt`, which would take the `best` alias as the last one logged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous", 0) is None:  # W&B warns about it on every run
            del self._wandb_init["anonymous"]

    def after_save_checkpoint(self, checkpoint_callback: ModelCheckpoint) -> None:
        if checkpoint_callback.monitor is not None:
            super().after_save_checkpoint(checkpoint_callback)


def start_loggers(loggers: list[Logger], cfg: DictConfig, choices: dict[str, str]) -> None:
    """The config to every logger; W&B's summary shows the best `val/dice` and the lowest loss."""
    for logger in loggers:
        logger.log_hyperparams(
            {"config": OmegaConf.to_container(cfg, resolve=True), "choices": choices}
        )
        if isinstance(logger, WandbLogger):
            for name, summary in (("val/dice", "max"), ("val/loss", "min")):
                logger.experiment.define_metric(
                    name, step_metric="trainer/global_step", summary=summary
                )


class ContinuedCSVLogger(CSVLogger):
    """Lightning's CSVLogger; a resumed fit keeps the rows logged before its checkpoint's step
    (`keep_steps_before`; a crash may have logged later steps, which the fit runs again)."""

    def __init__(self, *args: Any, keep_steps_before: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keep_steps_before = keep_steps_before
        self._started = False

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._started:
            return super().experiment
        self._started = True
        metrics = Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE
        kept = _rows_before(metrics, self.keep_steps_before)
        writer = super().experiment  # Lightning removes the metrics.csv it finds
        if kept is not None:
            writer.metrics_keys, text = kept
            write_file(metrics, text.encode())
        return writer


def _rows_before(path: Path, step: int | None) -> tuple[list[str], str] | None:
    """The columns of the CSV log at `path` (Lightning's order) and its text with the rows of
    steps before `step`; None without a step or a log."""
    if step is None or not path.is_file():
        return None
    try:
        reader = csv.DictReader(io.StringIO(read_regular(path).decode(), newline=""))
        rows = [row for row in reader if int(row["step"]) < step]
    except (KeyError, TypeError, ValueError) as err:  # a damaged log
        raise NotOursError(
            f"{path} is not a CSV log nailseg can continue ({type(err).__name__}: {err}): move "
            "it away, or resume with logger=none"
        ) from None
    columns = sorted(reader.fieldnames or [])
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    return columns, text.getvalue()
