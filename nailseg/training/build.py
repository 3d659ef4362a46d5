"""`build(cfg)`: every object a training run uses, from the composed config, in one place.

`train.py`, the evaluation-only run (`train=false`) and the tests all build through here, so what
the tests check is what users run. Each part is the config group's `_target_`, instantiated;
everything is checked (`checks.py`) before the first file is written, and nothing here writes.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from omegaconf import DictConfig, OmegaConf

from nailseg.data.datamodule import NailDataModule
from nailseg.io.atomic import write_text
from nailseg.model.checkpoint import make_card
from nailseg.model.module import SegModule, schedule_length_args
from nailseg.model.net import compile_net
from nailseg.prep.builtin import prepare_builtin
from nailseg.training import checks, evaluation, resume
from nailseg.training.callbacks import CheckpointCard
from nailseg.training.checkpoint_io import BackgroundCheckpointIO
from nailseg.training.private_api import drop_unset_wandb_anonymous

log = logging.getLogger(__name__)
GPU_ACCELERATORS = ("gpu", "cuda")
# where W&B keeps its service logs and caches, and stages tables, unless told: under the home
# folder. A run writes only into its run dir, so they go into `<run>/wandb/<sub>`.
WANDB_DIRS = {"WANDB_CACHE_DIR": "cache", "WANDB_DATA_DIR": "data"}
_wandb_dirs_set: dict[str, str] = {}  # the values set here, which a sweep's next job moves


@dataclass
class Built:
    """A training run, ready to fit: `cfg.run_dir` is the folder it writes to."""

    cfg: DictConfig
    datamodule: NailDataModule
    module: SegModule
    trainer: L.Trainer
    loggers: list[Logger]
    resume: resume.Resume | None
    run_id: str  # the run its checkpoints' cards and its folder's marker name (resume.py)


def sweep_job() -> bool:
    """Whether this run is one job of a `-m` sweep."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def final_prefix(split: str, after_fit: bool) -> str:
    """What the final evaluation logs under: `test` only for the test split; the validation
    split after a fit is `val_best` (the checkpoint was chosen on it), otherwise `<split>_eval`."""
    if split == "test":
        return "test"
    short = "val" if split == "valid" else split
    return f"{short}_best" if after_fit else f"{short}_eval"


def build_loggers(cfg: DictConfig, resumed: resume.Resume | None) -> list[Logger]:
    """The `logger=` group's loggers. W&B resumes the checkpoint's run when there is one; in a
    sweep its runs share a group named after the sweep folder and each is named by its own
    overrides, unless `logger.wandb.group` / `.name` say otherwise. A resumed fit's CSV log keeps
    the rows of the steps before its checkpoint."""
    loggers = []
    for name, conf in (cfg.logger or {}).items():
        extra: dict[str, Any] = {}
        if name == "wandb":
            keep_wandb_inside(Path(conf.get("save_dir") or cfg.run_dir) / "wandb")
            if resumed is not None and resumed.card.get("wandb_run_id") is not None:
                extra |= {"id": resumed.card["wandb_run_id"], "resume": "allow"}
            if sweep_job():
                hydra = HydraConfig.get()
                if conf.get("group") is None:
                    extra["group"] = Path(hydra.sweep.dir).name
                if conf.get("name") is None:
                    extra["name"] = run_name(hydra.overrides.task)
        if name == "csv" and resumed is not None and cfg.train:
            extra["keep_steps_before"] = resumed.global_step
        logger = instantiate(conf, **extra)
        if isinstance(logger, WandbLogger):
            drop_unset_wandb_anonymous(logger)
        loggers.append(logger)
    return loggers


def keep_wandb_inside(folder: Path) -> None:
    """Point W&B's cache and data folders (else ~/.cache/wandb, ~/.local/share/wandb) into
    `folder`, before its run starts. A value the user set is kept; one set here for an earlier
    job of a sweep moves to this job's folder. Its settings folder (WANDB_CONFIG_DIR) is only
    read during a run, and holds the user's W&B settings: it stays."""
    for var, sub in WANDB_DIRS.items():
        if os.environ.get(var) in (None, _wandb_dirs_set.get(var)):
            _wandb_dirs_set[var] = os.environ[var] = str(folder / sub)


class ContinuedCSVLogger(CSVLogger):
    """Lightning's CSVLogger, which deletes the `metrics.csv` it finds. A resumed fit
    (`keep_steps_before`: the checkpoint's global step) keeps the rows logged before its
    checkpoint and appends its own: one file holds the whole fit, each step once."""

    def __init__(self, *args: Any, keep_steps_before: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keep_steps_before = keep_steps_before

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None and self.keep_steps_before is not None:
            self._experiment = _ContinuedWriter(self.log_dir, self.keep_steps_before)
        return super().experiment


class _ContinuedWriter(ExperimentWriter):
    """Keeps the existing `metrics.csv`'s rows of steps before `keep_steps_before` (a crash may
    have logged steps after the checkpoint, which the resumed fit runs again) and its columns."""

    def __init__(self, log_dir: str, keep_steps_before: int) -> None:
        self.keep_steps_before = keep_steps_before
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if not path.is_file():
            return
        with path.open(newline="") as file:
            reader = csv.DictReader(file)
            rows = list(reader)
            self.metrics_keys = sorted(reader.fieldnames or [])  # Lightning's column order
        kept = [row for row in rows if int(row["step"]) < self.keep_steps_before]
        if len(kept) < len(rows):
            text = io.StringIO()
            writer = csv.DictWriter(text, fieldnames=self.metrics_keys)
            writer.writeheader()
            writer.writerows(kept)
            write_text(path, text.getvalue())


def run_name(overrides: list[str]) -> str:
    """A sweep job's name from its overrides (paths left out: they rarely tell jobs apart)."""
    shown = [o for o in overrides if "/" not in o.split("=", 1)[-1]]
    return ",".join(shown) or "defaults"


def _trainer_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The trainer group without its unset (None) keys: those take Lightning's own defaults."""
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    return {key: value for key, value in trainer.items() if value is not None}


def fit_steps(trainer: L.Trainer, datamodule: NailDataModule) -> float:
    """The optimizer steps of the whole fit, known before it starts: Lightning's
    `trainer.estimated_stepping_batches` (what sizes the LR schedule), which Lightning counts only
    inside the fit, from this rank's train batches (`NailDataModule.train_batches`). inf: a fit
    without a finite length."""
    max_epochs, max_steps = trainer.max_epochs, trainer.max_steps
    if max_epochs is None:  # Lightning's default: 1000 epochs, unless steps or time bound the fit
        timed = any(isinstance(c, Timer) for c in trainer.callbacks)
        max_epochs = 1000 if max_steps == -1 and not timed else -1
    if max_epochs == -1:
        return float("inf") if max_steps == -1 else max_steps
    datamodule.trainer = trainer  # as the fit attaches it: this rank's loader
    batches = datamodule.train_batches()
    limit = trainer.limit_train_batches
    batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
    steps = math.ceil(batches / trainer.accumulate_grad_batches) * max(max_epochs, 1)
    return steps if max_steps == -1 else min(steps, max_steps)


def use_channels_last(setting: bool | None, on_cuda: bool) -> bool:
    """`module.channels_last` (bench: `channels_last`): None means on for CUDA only, where tensor
    cores run channels-last convolutions faster under AMP. The configs say true: on the CPU
    oneDNN runs UNet's convolutions faster channels-last too (2 cores, the default UNet-r18 at
    128²: +22% training images/s; docs/BENCHMARKS.md, ninth session)."""
    return on_cuda if setting is None else bool(setting)


def build(cfg: DictConfig) -> Built:
    """Check `cfg`, prepare the built-in data if it is the dataset, resolve what `ckpt_path`
    resumes, seed, and build data, module and trainer."""
    checks.check_config(cfg)  # every check that needs no data, before the built-in data is made
    prepare_builtin(cfg.dataset)  # the built-in synthetic data: when missing or n/seed changed
    # a fit resumes only a checkpoint that fits its config (`last`: the newest that does)
    resumed = resume.resolve(
        cfg.ckpt_path, Path(cfg.run_dir), sweep_job(), cfg if cfg.train else None
    )
    if resumed is not None:
        if not cfg.train:  # an evaluation: the checkpoint's model and input size (evaluation.py)
            evaluation.take_card(cfg, resumed.card, str(resumed.checkpoint))
            resume.check_matches(resumed, cfg)
        else:  # continue in the checkpoint's own run folder, if it has one (see resume.py)
            cfg.run_dir = str(resumed.run_dir)

    L.seed_everything(cfg.seed, workers=True)  # before the net: its initial weights follow it
    image_size = (int(cfg.dataset.image_size[0]), int(cfg.dataset.image_size[1]))
    aug = instantiate(cfg.aug, mean=cfg.normalize.mean, std=cfg.normalize.std, _convert_="all")
    datamodule = NailDataModule(
        root=cfg.dataset.root,
        image_size=image_size,
        loader=instantiate(cfg.loader),
        aug=aug,
        final_split=cfg.eval_split,
        # other sources' train splits (dataset.mix); a missing key fails here, naming it
        mix=OmegaConf.to_container(cfg.dataset.mix, resolve=True, throw_on_missing=True),
        weight=cfg.dataset.weight,
    )
    # a checkpoint holds every weight: the encoder's initial ones (a download or a local file)
    # are not needed, so a resume or evaluation runs without them
    try:
        net = instantiate(cfg.model, **({"encoder_weights": None} if resumed is not None else {}))
    except InstantiationException as err:  # a misspelt model.options key, missing weights
        raise checks.ConfigError(f"model: {err.__cause__ or err}") from err
    checks.check_input_size(net, image_size, cfg.model)
    optimizer = instantiate(cfg.optimizer)  # both checked by check_config
    scheduler = instantiate(cfg.scheduler) if cfg.scheduler is not None else None
    module = SegModule(
        net=net,
        optimizer=optimizer,
        scheduler=scheduler,
        loss=cfg.module.loss,
        group_names=datamodule.group_names,
        threshold=cfg.module.threshold,
        channels_last=use_channels_last(
            cfg.module.channels_last,
            cfg.trainer.accelerator in GPU_ACCELERATORS and torch.cuda.is_available(),
        ),
    )
    module.test_prefix = final_prefix(datamodule.final_split, after_fit=cfg.train)
    if cfg.module.compile:
        compile_net(module.net, cfg.module.compile_mode)

    wandb_run_id = resumed.card.get("wandb_run_id") if resumed else None
    loggers = build_loggers(cfg, resumed)
    try:  # the callbacks group is untyped: each callback checks its own values
        callbacks = [instantiate(c) for c in (cfg.callbacks or {}).values()]
    except InstantiationException as err:
        raise checks.ConfigError(f"callbacks: {err.__cause__ or err}") from None
    run_id = resume.folder_run_id(Path(cfg.run_dir))
    callbacks.append(CheckpointCard(make_card(cfg, datamodule.group_names, run_id), wandb_run_id))
    trainer: L.Trainer = instantiate(
        _trainer_kwargs(cfg),
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[BackgroundCheckpointIO()],
    )
    if cfg.train:
        checks.check_train_split(
            len(datamodule.train_rows), cfg.loader.batch_size, trainer.world_size
        )
    # an evaluation that would leave a rank without a batch is refused now, not after the fit
    # (overfitting validates on the train rows, checked above)
    datamodule.check_evaluations(
        trainer.world_size,
        fit=cfg.train and not trainer.overfit_batches,
        final=cfg.test or not cfg.train,
    )
    if cfg.train and resumed is not None and scheduler is not None:
        length = schedule_length_args(scheduler, lambda: fit_steps(trainer, datamodule))
        resume.check_schedule(resumed, next(iter(length.values()), None), cfg)
    if cfg.trainer.accelerator in GPU_ACCELERATORS:
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: the tensor cores' fast path
    return Built(cfg, datamodule, module, trainer, loggers, resumed, run_id)


def describe_metrics(loggers: list[Logger]) -> None:
    """W&B's run summary shows the best `val/dice` (not the last epoch's) and the lowest loss."""
    for logger in loggers:
        if isinstance(logger, WandbLogger):
            for name, summary in (("val/dice", "max"), ("val/loss", "min")):
                logger.experiment.define_metric(
                    name, step_metric="trainer/global_step", summary=summary
                )
