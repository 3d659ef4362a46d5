"""`build(cfg)`: every object a training run uses, wired from the composed config in one place
(train.py, the evaluation and the tests); nothing here writes into the run folder."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

from nailseg.data.datamodule import NailDataModule
from nailseg.errors import ConfigError
from nailseg.model.checkpoint import load_net, make_card, plain_model
from nailseg.model.module import SegModule, schedule_length_args
from nailseg.model.net import compile_net
from nailseg.prep.builtin import prepare_builtin
from nailseg.training import checks, resume
from nailseg.training.callbacks import CheckpointCard
from nailseg.training.checkpoint_io import BackgroundCheckpointIO
from nailseg.training.jobs import sweep_job
from nailseg.training.loggers import build_loggers, reserve_folders
from nailseg.training.run_folder import hold, inside, is_ours, read_failure

GPU_ACCELERATORS = ("gpu", "cuda")


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
    finished: bool = False  # a resumed fit whose checkpoint ends it: nothing left to train


def build(cfg: DictConfig) -> Built:
    """Check `cfg`, make the built-in data if it is the dataset, build the run; a UserError names
    what cannot work before anything is written (`cfg.run_dir`: a resumed run's own folder)."""
    checks.check(cfg)  # before the built-in data is made
    prepare_builtin(cfg.dataset)
    resumed = resume.resolve_for(cfg, sweep_job())
    L.seed_everything(cfg.seed, workers=True)  # before the net: its initial weights follow it
    datamodule = build_datamodule(cfg)
    module = build_module(cfg, datamodule, resumed)
    loggers = build_loggers(cfg, resumed)
    callbacks = build_callbacks(cfg, datamodule, resumed)
    trainer: L.Trainer = instantiate(
        checks.trainer_kwargs(cfg.trainer),
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[BackgroundCheckpointIO()],
    )
    check_built(cfg, datamodule, module.scheduler_factory, trainer, resumed)
    # claimed after every check, so that a refusal writes nothing (DDP's later ranks attach)
    own = resumed is not None and resumed.run_id is not None
    run_id = hold(cfg.run_dir, "ckpt_path" if own else "hydra.run.dir").id
    callbacks[-1].card["run_id"] = run_id  # the CheckpointCard's: the folder's id, known now
    for conf in (cfg.callbacks or {}).values():  # Lightning would follow a link to its folder
        if conf.get("dirpath"):
            inside(conf.dirpath)
    reserve_folders(loggers, cfg.run_dir)
    if cfg.trainer.accelerator in GPU_ACCELERATORS:
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: the tensor cores' fast path
    # finished: its fit ended, and its report was written after it with no failure since
    reported = is_ours(Path(cfg.run_dir) / "metrics.json") and not read_failure(Path(cfg.run_dir))
    done = cfg.train and resumed is not None and reported
    done = done and resumed.global_step >= fit_steps(trainer, datamodule)
    return Built(cfg, datamodule, module, trainer, loggers, resumed, run_id, done)


def build_datamodule(cfg: DictConfig) -> NailDataModule:
    aug = instantiate(cfg.aug, mean=cfg.normalize.mean, std=cfg.normalize.std, _convert_="all")
    return NailDataModule(
        root=cfg.dataset.root,
        image_size=image_size(cfg),
        loader=instantiate(cfg.loader),
        aug=aug,
        final_split=cfg.eval_split,
        # other sources' train splits (dataset.mix); a missing key fails here, naming it
        mix=OmegaConf.to_container(cfg.dataset.mix, resolve=True, throw_on_missing=True),
        weight=cfg.dataset.weight,
    )


def image_size(cfg: DictConfig) -> tuple[int, int]:
    return int(cfg.dataset.image_size[0]), int(cfg.dataset.image_size[1])


def build_module(
    cfg: DictConfig, datamodule: NailDataModule, resumed: resume.Resume | None
) -> SegModule:
    """The net (without the encoder's initial weights when a checkpoint brings every weight),
    its optimizer and schedule, and the loss."""
    try:
        if cfg.init_from is not None:  # a fine-tune: every weight the checkpoint's
            net = load_net(cfg.init_from, plain_model(cfg.model, "model")).train()
        else:
            weights = {"encoder_weights": None} if resumed is not None else {}
            net = instantiate(cfg.model, **weights)
    except InstantiationException as err:  # a misspelt model.options key, missing weights
        raise ConfigError(f"model: {err.__cause__ or err}") from err
    stride = getattr(getattr(net, "encoder", None), "output_stride", 1)  # smp: 32 for most
    size = image_size(cfg)
    if getattr(net, "requires_divisible_input_shape", False) and (
        size[0] % stride or size[1] % stride
    ):
        fit = [-(-side // stride) * stride for side in size]
        raise ConfigError(
            f"dataset.image_size={list(size)}: {cfg.model.arch}/{cfg.model.encoder_name} needs "
            f"sides divisible by {stride}; e.g. dataset.image_size={fit}"
        )
    module = SegModule(
        net=net,
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.scheduler) if cfg.scheduler is not None else None,
        loss=cfg.module.loss,
        group_names=datamodule.group_names,
        threshold=cfg.module.threshold,
        eval_scales=cfg.module.eval_scales,
        channels_last=use_channels_last(
            cfg.module.channels_last,
            cfg.trainer.accelerator in GPU_ACCELERATORS and torch.cuda.is_available(),
        ),
    )
    module.test_prefix = final_prefix(datamodule.final_split, after_fit=cfg.train)
    if cfg.module.compile:
        compile_net(module.net, cfg.module.compile_mode)
    return module


def build_callbacks(
    cfg: DictConfig, datamodule: NailDataModule, resumed: resume.Resume | None
) -> list[Callback]:
    """The `callbacks=` group's, and the card every checkpoint carries (last)."""
    confs = list((cfg.callbacks or {}).values())
    try:  # the callbacks group is untyped: each callback checks its own values
        callbacks = [instantiate(c) for c in confs]
    except InstantiationException as err:
        raise ConfigError(f"callbacks: {err.__cause__ or err}") from None
    wandb_run_id = resumed.card.get("wandb_run_id") if resumed else None
    card = make_card(cfg, datamodule.group_names)
    return [*callbacks, CheckpointCard(card, wandb_run_id)]


def check_built(
    cfg: DictConfig, data: NailDataModule, scheduler: Any, trainer: L.Trainer, resumed: Any
) -> None:
    """A full batch per rank, a row per rank in every evaluation, a resumed schedule's length."""
    rows, batch, world = len(data.train_rows), cfg.loader.batch_size, trainer.world_size
    if cfg.train and rows // world < batch:  # Lightning would train on nothing
        raise ConfigError(
            f"loader.batch_size={batch}: the train split has {rows} rows for {world} rank(s), "
            f"fewer than one full batch each; lower loader.batch_size (at most "
            f"{max(1, rows // world)}) or prepare more data"
        )
    fit, final = cfg.train and not trainer.overfit_batches, cfg.test or not cfg.train
    data.check_evaluations(world, fit=fit, final=final)
    if cfg.train and resumed is not None and scheduler is not None:
        length = schedule_length_args(scheduler, lambda: fit_steps(trainer, data))
        resume.check_schedule(resumed, next(iter(length.values()), None), cfg)


def final_prefix(split: str, after_fit: bool) -> str:
    """What the final evaluation logs under: `test` for the test split; else `val_best` after a
    fit (the checkpoint was chosen on it), or `<split>_eval`."""
    if split == "test":
        return "test"
    short = "val" if split == "valid" else split
    return f"{short}_best" if after_fit else f"{short}_eval"


def fit_steps(trainer: L.Trainer, datamodule: NailDataModule) -> float:
    """The fit's optimizer steps before it starts, as Lightning's `estimated_stepping_batches`
    counts them inside it; inf: a fit without a finite length."""
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
    """`module.channels_last` (bench's `channels_last`): None means on for CUDA only."""
    return on_cuda if setting is None else bool(setting)
