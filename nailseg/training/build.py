"""`build(cfg)`: every object a training run uses, wired from the composed config in one place.

`train.py`, the evaluation-only run (`train=false`) and the tests all build through here. Each
part is its config group's `_target_`, instantiated; every check that needs no data runs first,
and nothing here writes into the run folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig, OmegaConf

from nailseg.data.datamodule import NailDataModule
from nailseg.model.checkpoint import make_card
from nailseg.model.module import SegModule, schedule_length_args
from nailseg.model.net import compile_net
from nailseg.synth.builtin import prepare_builtin
from nailseg.training import checks, resume
from nailseg.training.callbacks import CheckpointCard
from nailseg.training.checkpoint_io import BackgroundCheckpointIO
from nailseg.training.jobs import sweep_job
from nailseg.training.loggers import build_loggers, reserve_folders
from nailseg.training.run_folder import hold, inside

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


def build(cfg: DictConfig) -> Built:
    """Check `cfg`, make the built-in data if it is the dataset, and build the run.

    Args:
        cfg: train.py's composed config. `cfg.run_dir` becomes the resumed run's own folder when
            `ckpt_path` continues a fit there; an evaluation takes the checkpoint's model.

    Returns:
        The data, module, trainer and loggers, and what the run resumes.

    Raises:
        ConfigError, CheckpointError, SplitFileError, FileNotFoundError: a value, checkpoint or
            file that cannot work, named, before anything is written into the run folder.
    """
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
    check_built(cfg, datamodule, module, trainer, resumed)
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
    return Built(cfg, datamodule, module, trainer, loggers, resumed, run_id)


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
        net = instantiate(cfg.model, **({"encoder_weights": None} if resumed is not None else {}))
    except InstantiationException as err:  # a misspelt model.options key, missing weights
        raise checks.ConfigError(f"model: {err.__cause__ or err}") from err
    checks.check_input_size(net, image_size(cfg), cfg.model)
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
        raise checks.ConfigError(f"callbacks: {err.__cause__ or err}") from None
    wandb_run_id = resumed.card.get("wandb_run_id") if resumed else None
    card = make_card(cfg, datamodule.group_names)
    return [*callbacks, CheckpointCard(card, wandb_run_id)]


def check_built(
    cfg: DictConfig,
    datamodule: NailDataModule,
    module: SegModule,
    trainer: L.Trainer,
    resumed: resume.Resume | None,
) -> None:
    """What needs the data and the trainer: a full batch per rank, a row per rank in every
    evaluation (overfitting validates on the train rows), a resumed schedule's length."""
    if cfg.train:
        checks.check_train_split(
            len(datamodule.train_rows), cfg.loader.batch_size, trainer.world_size
        )
    datamodule.check_evaluations(
        trainer.world_size,
        fit=cfg.train and not trainer.overfit_batches,
        final=cfg.test or not cfg.train,
    )
    scheduler = module.scheduler_factory
    if cfg.train and resumed is not None and scheduler is not None:
        length = schedule_length_args(scheduler, lambda: fit_steps(trainer, datamodule))
        resume.check_schedule(resumed, next(iter(length.values()), None), cfg)


def final_prefix(split: str, after_fit: bool) -> str:
    """What the final evaluation logs under: `test` only for the test split; the validation
    split after a fit is `val_best` (the checkpoint was chosen on it), otherwise `<split>_eval`."""
    if split == "test":
        return "test"
    short = "val" if split == "valid" else split
    return f"{short}_best" if after_fit else f"{short}_eval"


def fit_steps(trainer: L.Trainer, datamodule: NailDataModule) -> float:
    """The optimizer steps of the whole fit before it starts, as Lightning's
    `estimated_stepping_batches` counts them inside it (what sizes the LR schedule); inf: a fit
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
    cores run channels-last convolutions faster under AMP (the configs set true: oneDNN's CPU
    convolutions gain too, docs/BENCHMARKS.md)."""
    return on_cuda if setting is None else bool(setting)
