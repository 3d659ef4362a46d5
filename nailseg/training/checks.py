"""Checks of a composed training config, run before any work: each error names the key and value.

Without them a wrong value fails late or, worse, not at all: a train split smaller than one batch
per rank trains nothing and exits 0 (Lightning drops the partial batch), an input size the model
cannot take fails inside the first step, a typo in an optimizer argument only when the fit starts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from hydra.utils import get_class, instantiate
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nailseg.config import DIRECTIONS
from nailseg.data.augment import rgb_triple
from nailseg.device import check_name
from nailseg.model.module import monitorable, schedule_length_args
from nailseg.prep.builtin import missing_data

EVAL_SPLITS = ("auto", "train", "valid", "test")
MODES = tuple(DIRECTIONS)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and the value."""


def check_values(cfg: DictConfig) -> None:
    """Ranges and choices of the training config's own keys."""
    size = list(cfg.dataset.image_size)
    if len(size) != 2 or any(int(v) < 1 for v in size):
        raise ConfigError(f"dataset.image_size={size}: must be [height, width], both >= 1")
    if cfg.loader.batch_size < 1:
        raise ConfigError(f"loader.batch_size={cfg.loader.batch_size}: must be at least 1")
    if not 0.0 < cfg.module.threshold < 1.0:
        raise ConfigError(f"module.threshold={cfg.module.threshold}: must be in (0, 1)")
    max_epochs = cfg.trainer.max_epochs
    if max_epochs is not None and max_epochs != -1 and max_epochs < 1:
        raise ConfigError(f"trainer.max_epochs={max_epochs}: must be >= 1 (or -1: no limit)")
    every = cfg.trainer.check_val_every_n_epoch
    if every is not None and every < 1:
        raise ConfigError(f"trainer.check_val_every_n_epoch={every}: must be >= 1 (or null)")
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
    check_strategy(cfg.trainer.strategy)


def check_config(cfg: DictConfig) -> None:
    """Every check that needs no data: `build` runs it first, before the built-in data is made
    or anything written."""
    check_values(cfg)
    optimizer = instantiate(cfg.optimizer)
    check_arguments(optimizer, "optimizer")
    scheduler = instantiate(cfg.scheduler) if cfg.scheduler is not None else None
    if scheduler is not None:
        check_arguments(scheduler, "scheduler")
    check_optimization(optimizer, scheduler)
    check_data(cfg.dataset)


def check_data(dataset: DictConfig) -> None:
    """The dataset's root is prepared, or is the built-in set's own, which train.py makes: any
    other would fail once the run folder and the W&B run exist, and is never filled here."""
    problem = missing_data(dataset)
    if problem is not None:
        raise ConfigError(problem)


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


def check_optimization(optimizer: functools.partial, scheduler: functools.partial | None) -> None:
    """Build the optimizer on a stand-in parameter and the schedule on it (a stand-in length
    where the fit would give it): torch checks their values (a negative lr, onecycle's
    pct_start) only when they are built, inside the fit, after the loggers' folders."""
    try:
        stand_in = optimizer([nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError) as err:
        raise ConfigError(f"optimizer: {err}") from None
    if scheduler is None:
        return
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
    """A strategy given as a node names a class that takes every option: DDPStrategy takes its
    own and passes the rest to torch's DistributedDataParallel, which would refuse a typo only
    when the fit starts."""
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
