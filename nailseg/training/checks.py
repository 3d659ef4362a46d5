"""Checks of a composed training config, run before any work: each error names the key and
value that would otherwise fail late (inside the fit) or not at all (a split smaller than a batch
trains nothing and exits 0)."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch
from hydra.utils import get_class, instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.seed import max_seed_value, min_seed_value
from lightning.pytorch.accelerators import Accelerator, AcceleratorRegistry, CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nailseg.config import DIRECTIONS, ConfigError
from nailseg.data.augment import rgb_triple
from nailseg.device import check_name
from nailseg.model.module import monitorable, schedule_length_args
from nailseg.model.scales import scales_problem
from nailseg.synth.builtin import check_data
from nailseg.training.private_api import check_precision

EVAL_SPLITS = ("auto", "train", "valid", "test")
MODES = tuple(DIRECTIONS)
ACCELERATOR_CLASSES: dict[str, type[Accelerator]] = {
    name: entry["accelerator"] for name, entry in AcceleratorRegistry.items()
}
ACCELERATORS = ("auto", "gpu", *sorted(ACCELERATOR_CLASSES))  # Lightning's names
CLIP_ALGORITHMS = ("norm", "value")
# trainer counts: the lowest value, and a value below it with a meaning of its own
TRAINER_COUNTS: dict[str, tuple[float, tuple[int, str] | None]] = {
    "max_epochs": (1, (-1, "no limit")),
    "max_steps": (1, (-1, "no limit")),
    "min_epochs": (0, None),
    "min_steps": (0, None),
    "num_nodes": (1, None),
    "check_val_every_n_epoch": (1, None),
    "accumulate_grad_batches": (1, None),
    "log_every_n_steps": (0, None),  # 0: no step logged
    "num_sanity_val_steps": (0, (-1, "all")),
    "reload_dataloaders_every_n_epochs": (0, None),
    "fast_dev_run": (0, None),
    "gradient_clip_val": (0, None),
}
BATCH_LIMITS = (
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
    "overfit_batches",
)


def check_values(cfg: DictConfig) -> None:
    """Ranges and choices of the training config's own keys."""
    size = list(cfg.dataset.image_size)
    if len(size) != 2 or any(int(v) < 1 for v in size):
        raise ConfigError(f"dataset.image_size={size}: must be [height, width], both >= 1")
    synthetic = cfg.dataset.synthetic  # the built-in set, which train.py generates
    if synthetic is not None and synthetic.n < 1:
        raise ConfigError(f"dataset.synthetic.n={synthetic.n}: must be at least 1")
    if cfg.loader.batch_size < 1:
        raise ConfigError(f"loader.batch_size={cfg.loader.batch_size}: must be at least 1")
    if not 0.0 < cfg.module.threshold < 1.0:
        raise ConfigError(f"module.threshold={cfg.module.threshold}: must be in (0, 1)")
    scales = cfg.module.eval_scales
    if scales is not None and (problem := scales_problem("module.eval_scales", list(scales))):
        raise ConfigError(problem)
    if not min_seed_value <= cfg.seed <= max_seed_value:
        raise ConfigError(f"seed={cfg.seed}: must be in [{min_seed_value}, {max_seed_value}]")
    lr = cfg.optimizer.get("lr")
    if lr is not None and not lr > 0:  # 0: a fit that never changes the net
        raise ConfigError(f"optimizer.lr={lr}: must be > 0")
    if cfg.eval_split not in EVAL_SPLITS:
        raise ConfigError(f"eval_split={cfg.eval_split}: must be one of {', '.join(EVAL_SPLITS)}")
    if not monitorable(cfg.optimized_metric):
        raise ConfigError(
            f"optimized_metric={cfg.optimized_metric}: not a value training logs; e.g. val/dice, "
            "val/loss, val/iou, val/dice_group_<group>, val/dice_best, train/loss"
        )
    if cfg.optimized_mode not in MODES:
        raise ConfigError(f"optimized_mode={cfg.optimized_mode}: must be max or min")
    if cfg.overlay_every_n_epochs < 1:
        raise ConfigError(f"overlay_every_n_epochs={cfg.overlay_every_n_epochs}: must be >= 1")
    if not cfg.train and not cfg.ckpt_path:
        raise ConfigError("train=false evaluates a checkpoint: pass ckpt_path=<file or last>")
    try:
        rgb_triple(cfg.normalize.mean, "normalize.mean")
        rgb_triple(cfg.normalize.std, "normalize.std", positive=True)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_loader(cfg.loader)
    check_trainer(cfg.trainer, cfg.train)
    check_strategy(cfg.trainer.strategy)


def check_config(cfg: DictConfig) -> None:
    """Every check that needs no data: before Hydra writes the run folder (`PreCheck`), and
    first in `build`."""
    check_request(cfg)
    check_devices(cfg)


def check_request(cfg: DictConfig) -> None:
    """`check_config` but for this machine's devices (for jobs run on other machines)."""
    check_values(cfg)
    optimizer = instantiate(cfg.optimizer)
    check_arguments(optimizer, "optimizer")
    scheduler = instantiate(cfg.scheduler) if cfg.scheduler is not None else None
    if scheduler is not None:
        check_arguments(scheduler, "scheduler")
    check_optimization(optimizer, scheduler)
    check_schedule_length(cfg.trainer, scheduler)
    check_data(cfg)


def check_loader(loader: DictConfig) -> None:
    """The loader's own settings, which its backend would refuse only when the fit starts."""
    try:
        check_name(loader.device)
    except ValueError as err:
        raise ConfigError(f"loader.{err}") from None
    fewest = get_class(loader._target_).MIN_WORKERS
    if loader.num_workers < fewest:
        raise ConfigError(
            f"loader.num_workers={loader.num_workers}: must be at least {fewest} for "
            f"{loader._target_.rsplit('.', 1)[1]}"
        )
    if loader.prefetch < 1:
        raise ConfigError(f"loader.prefetch={loader.prefetch}: must be at least 1")
    if loader.seed < 0:  # numpy's seed sequences, which draw the shuffles, take no negatives
        raise ConfigError(f"loader.seed={loader.seed}: must be >= 0")


def check_trainer(trainer: DictConfig, train: bool) -> None:
    """The trainer's values that Lightning checks only once the loggers started, or never."""
    if trainer.accelerator not in (None, *ACCELERATORS):
        raise ConfigError(
            f"trainer.accelerator={trainer.accelerator}: use one of {', '.join(ACCELERATORS)}"
        )
    if trainer.accelerator == "cpu" and trainer.devices not in (None, "auto"):
        try:  # a number of processes on the CPU, which every machine has
            CPUAccelerator.parse_devices(trainer.devices)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"trainer.devices={trainer.devices}: {err}") from None
    for key, (lowest, special) in TRAINER_COUNTS.items():
        value = trainer.get(key)
        if value is None or (special is not None and value == special[0]):
            continue
        if not isinstance(value, int | float) or not value >= lowest:
            either = f" (or {special[0]}: {special[1]})" if special is not None else ""
            raise ConfigError(f"trainer.{key}={value}: must be >= {lowest}{either}")
    for key in BATCH_LIMITS:
        value = trainer.get(key)
        if value is not None and not _batch_limit(value):
            raise ConfigError(
                f"trainer.{key}={value}: a fraction of the batches in [0.0, 1.0] or a whole "
                "number of batches"
            )
    if train and trainer.limit_train_batches == 0 and not trainer.overfit_batches:
        raise ConfigError(
            "trainer.limit_train_batches=0: the fit would train no batch; train=false "
            "evaluates without training"
        )
    interval = trainer.val_check_interval
    if interval is not None and not (
        (_batch_limit(interval) and interval > 0) or _duration(interval)
    ):
        raise ConfigError(
            f"trainer.val_check_interval={interval}: a fraction of the epoch in (0.0, 1.0], a "
            "whole number of batches, or a time DD:HH:MM:SS"
        )
    if trainer.max_time is not None and not _duration(trainer.max_time):
        raise ConfigError(f"trainer.max_time={trainer.max_time}: a time DD:HH:MM:SS")
    if trainer.precision is not None:
        try:
            check_precision(trainer.precision)
        except ValueError as err:
            raise ConfigError(f"trainer.precision={trainer.precision}: {err}") from None
    if trainer.gradient_clip_algorithm not in (None, *CLIP_ALGORITHMS):
        raise ConfigError(
            f"trainer.gradient_clip_algorithm={trainer.gradient_clip_algorithm}: use one of "
            f"{', '.join(CLIP_ALGORITHMS)}"
        )


def _batch_limit(value: Any) -> bool:
    """Lightning's reading of a batch limit: a fraction in [0, 1], or a whole number above."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return 0 <= value <= 1 or (value > 1 and value % 1 == 0)


def _duration(value: Any) -> bool:
    """A time as Lightning takes it: DD:HH:MM:SS, or timedelta's keywords ({hours: 2})."""
    if isinstance(value, Mapping):
        return True
    return isinstance(value, str) and re.fullmatch(r"\d+:\d+:\d+:\d+", value.strip()) is not None


def check_schedule_length(trainer: DictConfig, scheduler: functools.partial | None) -> None:
    """A schedule as long as the whole fit needs a fit with an end (a step or epoch limit)."""
    if scheduler is None or trainer.fast_dev_run or trainer.max_steps not in (None, -1):
        return
    if trainer.max_epochs == -1:
        endless = "trainer.max_epochs=-1"
    elif trainer.max_epochs is None and trainer.max_time is not None:
        endless = f"trainer.max_time={trainer.max_time} (trainer.max_epochs unset)"
    else:
        return
    for arg, length in schedule_length_args(scheduler, lambda: None).items():
        if length is None:
            raise ConfigError(
                f"{endless}: a fit without an end has no length for the LR schedule, which spans "
                f"the whole fit; set trainer.max_steps=N, scheduler.{arg}=N or scheduler=none"
            )


def check_devices(cfg: DictConfig) -> None:
    """The devices the trainer and the loader ask for exist here (counted without a CUDA
    context)."""
    device = cfg.loader.device
    wanted = int(device[5:]) + 1 if device.startswith("cuda:") else int(device in ("gpu", "cuda"))
    if torch.cuda.device_count() < wanted:
        raise ConfigError(
            f"loader.device={device}: torch sees {torch.cuda.device_count()} CUDA device(s) "
            "here; use auto or cpu"
        )
    name, devices = cfg.trainer.accelerator, cfg.trainer.devices
    if isinstance(devices, ListConfig):
        devices = list(devices)
    accelerator = _accelerator_here(name)
    if accelerator is None:
        raise ConfigError(
            f"trainer.accelerator={name}: torch sees no {'GPU' if name == 'gpu' else name} "
            "device here; trainer=cpu trains on the CPU"
        )
    if devices in (None, "auto"):
        return
    try:
        if accelerator.parse_devices(devices) is None:  # Lightning's reading of 0 GPUs
            raise ValueError("asks for no device")
    except (MisconfigurationException, TypeError, ValueError) as err:
        reason = " ".join(str(err).split())  # Lightning's message spans lines
        raise ConfigError(f"trainer.devices={devices}: {reason} (accelerator {name})") from None


def _accelerator_here(name: str | None) -> type[Accelerator] | None:
    """The accelerator Lightning picks for `name` on this machine (`auto`: a GPU when there is
    one, else the CPU); None when `name`'s is not here."""
    if name in (None, "auto", "gpu"):
        for gpu in ("mps", "cuda"):
            if ACCELERATOR_CLASSES[gpu].is_available():
                return ACCELERATOR_CLASSES[gpu]
        return None if name == "gpu" else CPUAccelerator
    accelerator = ACCELERATOR_CLASSES[name]
    return accelerator if accelerator.is_available() else None


def check_optimization(optimizer: functools.partial, scheduler: functools.partial | None) -> None:
    """Build the optimizer on a stand-in parameter and the schedule on it: torch checks their
    values only when they are built, inside the fit."""
    try:
        stand_in = optimizer([nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError) as err:
        raise ConfigError(f"optimizer: {err}") from None
    if scheduler is None:
        return
    for arg, length in schedule_length_args(scheduler, lambda: None).items():
        if length is not None and length < 1:  # cosine's T_max=0 divides by zero at step 1
            raise ConfigError(f"scheduler.{arg}={length}: must be >= 1 (null: the whole fit)")
    if scheduler.keywords.get("eta_min", 0) < 0:  # the LR it decays to
        raise ConfigError(f"scheduler.eta_min={scheduler.keywords['eta_min']}: must be >= 0")
    try:
        scheduler(stand_in, **schedule_length_args(scheduler, lambda: 1000))
    except (ValueError, TypeError, ZeroDivisionError) as err:
        raise ConfigError(f"scheduler: {err}") from None


def strategy_class(strategy: Any) -> type | None:
    """The class of a strategy given as a node (`_target_` and options); None for a name."""
    if not isinstance(strategy, Mapping) or "_target_" not in strategy:
        return None
    try:
        return get_class(strategy["_target_"])
    except (ImportError, ValueError) as err:  # no such module or name; not a class
        raise ConfigError(f"trainer.strategy._target_={strategy['_target_']}: {err}") from None


def check_strategy(strategy: Any) -> None:
    """A strategy given as a node names a class that takes every option (DDPStrategy passes the
    rest to DistributedDataParallel)."""
    target = strategy_class(strategy)
    if target is None:
        return
    accepted = set(inspect.signature(target).parameters)
    if issubclass(target, DDPStrategy):
        accepted |= set(inspect.signature(DistributedDataParallel).parameters)
    for key in strategy:
        if key != "_target_" and key not in accepted:
            raise ConfigError(
                f"trainer.strategy.{key}: {target.__name__} takes no option {key!r}"
                + (" (nor does DistributedDataParallel)" if issubclass(target, DDPStrategy) else "")
            )


def check_arguments(factory: functools.partial, key: str) -> None:
    """Every keyword of a Hydra partial (`optimizer`, `scheduler`) is one its target takes."""
    try:
        inspect.signature(factory.func).bind_partial(None, *factory.args, **factory.keywords)
    except TypeError as err:
        raise ConfigError(f"{key}: {factory.func.__qualname__} {err}") from None


def check_input_size(net: nn.Module, image_size: tuple[int, int], model: DictConfig) -> None:
    """The net takes inputs of `image_size` (smp nets need sides divisible by the encoder's
    output stride, 32 for most)."""
    stride = getattr(getattr(net, "encoder", None), "output_stride", 1)
    if getattr(net, "requires_divisible_input_shape", False) and any(
        side % stride for side in image_size
    ):
        fit = [-(-side // stride) * stride for side in image_size]
        raise ConfigError(
            f"dataset.image_size={list(image_size)}: {model.arch}/{model.encoder_name} needs sides "
            f"divisible by {stride}; e.g. dataset.image_size={fit}"
        )


def check_train_split(rows: int, batch_size: int, world_size: int) -> None:
    """At least one full batch per rank: Lightning would otherwise train on nothing."""
    if rows // world_size < batch_size:
        raise ConfigError(
            f"loader.batch_size={batch_size}: the train split has {rows} rows for {world_size} "
            f"rank(s), fewer than one full batch each; lower loader.batch_size (at most "
            f"{max(1, rows // world_size)}) or prepare more data"
        )
