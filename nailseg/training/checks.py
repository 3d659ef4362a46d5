"""Each value checked once, before Hydra writes the run folder: types by the schema, what no
library checks by `check_values` (torch-free: a typo answers before torch loads), the rest by the
libraries: the Trainer, optimizer and schedule built early (`check_objects`), their exception
made the one line. A refusal exits (HYDRA_FULL_ERROR=1 re-raises it, for the trace).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import MissingConfigException
from hydra.experimental.callback import Callback
from hydra.utils import get_method, get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
from rich.progress import track

from nailseg.config import DIRECTIONS
from nailseg.data.augment import rgb_triple
from nailseg.device import check_name
from nailseg.errors import ConfigError, refusal

# Hydra's basic sweeper (its jobs can be composed before they run) and launcher (this process)
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
EVAL_SPLITS = ("auto", "train", "valid", "test")
SEEDS = (0, 2**32 - 1)  # what numpy, which Lightning seeds too, takes
# the lowest value of counts no library checks before the fit (numpy takes no negative seed)
LOWEST = {"loader.batch_size": 1, "loader.prefetch": 1, "loader.seed": 0, "dataset.synthetic.n": 1}
LOWEST |= {"overlay_every_n_epochs": 1}
# trainer values Lightning misreads or refuses only in the fit: the lowest, and a special value
TRAINER_COUNTS: dict[str, tuple[float, tuple[int, str] | None]] = {
    "max_epochs": (1, (-1, "no limit")),  # 0: a fit that trains nothing
    "check_val_every_n_epoch": (1, None),
    "max_steps": (1, (-1, "no limit")),
    "min_epochs": (0, None),
    "min_steps": (0, None),
    "accumulate_grad_batches": (1, None),
    "log_every_n_steps": (0, None),  # 0: no step logged
    "num_sanity_val_steps": (0, (-1, "all")),
    "gradient_clip_val": (0, None),
}
# the trainer keys that name this machine's devices: jobs run elsewhere (SLURM) leave them out
DEVICE_KEYS = ("accelerator", "devices", "num_nodes", "strategy", "precision", "sync_batchnorm")
HYDRA_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")


class PreCheck(Callback):
    """`check_values`, then `check_objects`, on the run's config or every job of a basic sweep (a
    sampling sweeper: its base config); `check` (prepare's) replaces both."""

    def __init__(self, check: str | None = None) -> None:
        self.check = get_method(check) if check else None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._run_checks([("", config)], here=True)

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **_) -> None:
        here = config.hydra.launcher._target_ == BASIC_LAUNCHER
        if config.hydra.sweeper._target_ != BASIC_SWEEPER:
            self._run_checks([("the sweep's base config: ", config)], here)
        else:
            self._run_checks(list(composed_jobs(config, config_name)), here)

    def _run_checks(self, configs: list[tuple[str, DictConfig]], here: bool) -> None:
        stages = [self.check] if self.check else [check_values, lambda c: check_objects(c, here)]
        for stage in stages:  # every job's torch-free checks before the first import
            for where, config in configs:
                try:
                    stage(config)
                except Exception as err:
                    leave(where, err)


def composed_jobs(config: DictConfig, config_name: str | None) -> Iterator[tuple[str, DictConfig]]:
    """Each job of a basic-sweeper sweep composed as it will run (with the command line's hydra
    overrides: hydra.searchpath), with `job 1 of 4 (overrides): ` to start a message."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    params = config.hydra.sweeper.params or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += list(OmegaConf.to_container(config.hydra.overrides.task))
    parsed = OverridesParser.create().parse_overrides(arguments)
    jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    hydra_overrides = list(config.hydra.overrides.hydra)
    shown = track(
        jobs, "checking the sweep's jobs", transient=True, disable=not sys.stdout.isatty()
    )
    for number, overrides in enumerate(shown):
        where = f"job {number} of {len(jobs)} ({' '.join(overrides)}): "
        try:
            job = compose(config_name, overrides=[*hydra_overrides, *overrides])
        except Exception as err:  # a choice or key that exists in no config
            leave(where, err)
        yield where, job


def leave(where: str, err: Exception) -> NoReturn:
    """Stop before Hydra writes; with HYDRA_FULL_ERROR=1, re-raise (a warning with the trace)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise err
    sys.exit(refusal(os.path.basename(sys.argv[0]) or "nailseg", err, where))


def did_you_mean(key: str, taken: Iterable[str], node: str) -> str:
    """`; did you mean <node>.<closest>?` when a taken key is close to `key`, else ``."""
    close = difflib.get_close_matches(key, [str(k) for k in taken], n=1)
    return f"; did you mean {node}.{close[0]}?" if close else ""


def composition_error(err: Exception) -> ConfigError | None:
    """Hydra's error for a value, key or option no config takes, as one line naming it (and the
    closest key or option); None for any other error (Hydra reports it)."""
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        full_key = str(cause.full_key)
        given = [a for a in sys.argv[1:] if a.lstrip("+~").partition("=")[0] == full_key]
        node, _, key = full_key.rpartition(".")
        reason = cause.msg.splitlines()[0]
        if isinstance(cause, ConfigKeyError | ConfigAttributeError) and node:
            reason = "no such key" + did_you_mean(key, cause.parent_node.keys(), node)
        return ConfigError(f"{given[0] if given else full_key}: {reason}")
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options:
        group, _, option = err.missing_cfg_file.rpartition("/")
        hint = did_you_mean(option, err.options, group).replace(f" {group}.", f" {group}=")
        return ConfigError(f"{group}={option}: no such option ({', '.join(err.options)}){hint}")
    return None


@contextmanager
def command_line(command: str) -> Iterator[None]:
    """Within the block (a command's Hydra app): a misspelt key or option exits in one line
    (Hydra advises `+key=`, which makes the typo a new key); `--help` lists the config groups
    only for a template that prints them (the listing deep-copies every group: a second)."""
    from hydra._internal import utils
    from hydra._internal.hydra import Hydra

    original, original_help = utils.run_and_report, Hydra.get_help

    def run_and_report(func: Callable[[], Any]) -> Any:
        def reported() -> Any:
            try:
                return func()
            except Exception as err:
                full = os.environ.get("HYDRA_FULL_ERROR") == "1"
                if full or (line := composition_error(err)) is None:
                    raise
                sys.exit(refusal(command, line))

        return original(reported)

    def get_help(self: Hydra, help_cfg: Any, *args: Any, **kwargs: Any) -> str:
        if "CONFIG_GROUPS" not in help_cfg.template:  # shadows the method for this call
            self.format_config_groups = lambda *_, **__: ""
        try:
            return original_help(self, help_cfg, *args, **kwargs)
        finally:
            vars(self).pop("format_config_groups", None)

    with (
        mock.patch.object(utils, "run_and_report", run_and_report),
        mock.patch.object(Hydra, "get_help", get_help),
    ):
        yield


def check_values(cfg: DictConfig) -> None:
    """What no library checks before the fit, torch-free: ranges and choices of the config's own
    keys, keys no schema has (`+key=`), the data's and the pretrained weights' presence."""
    size = list(cfg.dataset.image_size)
    if len(size) != 2 or any(int(v) < 1 for v in size):
        raise ConfigError(f"dataset.image_size={size}: must be [height, width], both >= 1")
    if not SEEDS[0] <= cfg.seed <= SEEDS[1]:
        raise ConfigError(f"seed={cfg.seed}: must be in [{SEEDS[0]}, {SEEDS[1]}]")
    for key, lowest in LOWEST.items():
        if (value := OmegaConf.select(cfg, key)) is not None and value < lowest:
            raise ConfigError(f"{key}={value}: must be at least {lowest}")
    if (framing := OmegaConf.select(cfg, "dataset.synthetic.framing")) is not None:
        from nailseg.synth.scene import FRAMINGS  # OpenCV, no torch: a generated set only

        if framing not in FRAMINGS:
            raise ConfigError(f"dataset.synthetic.framing={framing}: one of {list(FRAMINGS)}")
    try:
        check_name(cfg.loader.device)
    except ValueError as err:
        raise ConfigError(f"loader.{err}") from None
    try:
        rgb_triple(cfg.normalize.mean, "normalize.mean")
        rgb_triple(cfg.normalize.std, "normalize.std", positive=True)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not 0.0 < cfg.module.threshold < 1.0:
        raise ConfigError(f"module.threshold={cfg.module.threshold}: must be in (0, 1)")
    lr = cfg.optimizer.get("lr")
    if lr is not None and not lr > 0:  # 0: a fit that never changes the net
        raise ConfigError(f"optimizer.lr={lr}: must be > 0")
    if cfg.eval_split not in EVAL_SPLITS:
        raise ConfigError(f"eval_split={cfg.eval_split}: must be one of {', '.join(EVAL_SPLITS)}")
    if cfg.optimized_mode not in DIRECTIONS:
        raise ConfigError(f"optimized_mode={cfg.optimized_mode}: must be max or min")
    if not cfg.train and not cfg.ckpt_path:
        raise ConfigError("train=false evaluates a checkpoint: pass ckpt_path=<file or last>")
    if cfg.init_from is not None:
        from nailseg.model.checkpoint import CheckpointError, checkpoint_file

        if cfg.ckpt_path is not None or not cfg.train:
            raise ConfigError(
                f"init_from={cfg.init_from}: starts a new fit from a checkpoint's weights; "
                "ckpt_path resumes or evaluates one: pass one of them"
            )
        try:
            checkpoint_file(cfg.init_from)
        except CheckpointError as err:
            raise ConfigError(f"init_from: {err}") from None
    check_trainer(cfg.trainer, cfg.train)
    check_schema_keys(cfg)
    check_weights(cfg.model)
    from nailseg.prep.builtin import missing_data  # pandas: not for a command's misspelt key

    if (problem := missing_data(cfg.dataset)) is not None:
        raise ConfigError(problem)


def check_trainer(trainer: DictConfig, train: bool) -> None:
    for key, (lowest, special) in TRAINER_COUNTS.items():
        value = trainer.get(key)
        if value is None or (special is not None and value == special[0]):
            continue
        if not isinstance(value, int | float) or not value >= lowest:
            either = f" (or {special[0]}: {special[1]})" if special is not None else ""
            raise ConfigError(f"trainer.{key}={value}: must be >= {lowest}{either}")
    interval = trainer.val_check_interval
    if isinstance(interval, int | float) and not interval > 0:
        raise ConfigError(f"trainer.val_check_interval={interval}: must be > 0")
    if train and trainer.limit_train_batches == 0 and not trainer.overfit_batches:
        raise ConfigError(
            "trainer.limit_train_batches=0: the fit would train no batch; train=false "
            "evaluates without training"
        )


def check_schema_keys(cfg: DictConfig, node: str = "") -> None:
    """A key added with `+` to a typed node is read by nothing, unless the node's `_target_`
    takes it (`check_target_keys`); one close to a schema key is a typo (+trainer.max_epoch)."""
    fields = getattr(OmegaConf.get_type(cfg), "__dataclass_fields__", None)
    for key in cfg:
        path = f"{node}.{key}" if node else str(key)
        if (
            path == "hydra"
            or OmegaConf.is_interpolation(cfg, key)
            or OmegaConf.is_missing(cfg, key)
        ):
            continue
        typo = difflib.get_close_matches(str(key), fields or (), n=1, cutoff=0.8)
        if fields is not None and key not in fields and ("_target_" not in cfg or typo):
            raise ConfigError(f"{path}: no such key{did_you_mean(str(key), fields, node)}")
        if isinstance(cfg[key], DictConfig):
            check_schema_keys(cfg[key], path)


def check_weights(model: DictConfig) -> None:
    """Pretrained weights smp would download (`imagenet`) are on disk already: a download at the
    start of a run is a minute of retries offline. timm's (`tu-`) are its own to find."""
    weights, encoder = model.encoder_weights, model.encoder_name
    if weights is None or "/" in weights or "." in weights or encoder.startswith("tu-"):
        return
    from huggingface_hub.constants import HF_HUB_CACHE

    repo = Path(HF_HUB_CACHE) / f"models--smp-hub--{encoder}.{weights}"
    if not any(repo.glob("snapshots/*/model.safetensors")):
        raise ConfigError(
            f"model.encoder_weights={weights}: {encoder}'s {weights} weights are not on disk "
            f"({repo}), and a run downloads nothing: save them once as a file where there is "
            f"internet and pass it, model.encoder_weights=/models/{encoder}.pth "
            "(docs/TRAINING.md, 'Pretrained encoders')"
        )


def check_objects(cfg: DictConfig, here: bool = True) -> None:
    """Build what the libraries check themselves (Trainer, optimizer, schedule), check each
    `_target_` node's keys; `here`: also this machine's devices (False for jobs run elsewhere)."""
    import torch

    from nailseg.model.module import monitorable
    from nailseg.model.scales import scales_problem

    if not monitorable(cfg.optimized_metric):
        raise ConfigError(
            f"optimized_metric={cfg.optimized_metric}: not a value training logs; e.g. val/dice, "
            "val/loss, val/iou, val/dice_group_<group>, val/dice_best, train/loss"
        )
    scales = cfg.module.eval_scales
    if scales is not None and (problem := scales_problem("module.eval_scales", list(scales))):
        raise ConfigError(problem)
    fewest = _target(cfg.loader, "loader").MIN_WORKERS
    if cfg.loader.num_workers < fewest:
        raise ConfigError(
            f"loader.num_workers={cfg.loader.num_workers}: must be at least {fewest} for "
            f"{cfg.loader._target_.rsplit('.', 1)[1]}"
        )
    for node in ("trainer", "trainer.strategy", "model", "optimizer", "scheduler", "loader", "aug"):
        check_target_keys(cfg, node)
    check_optimization(cfg)
    if here:
        device = cfg.loader.device
        wanted = (
            int(device[5:]) + 1 if device.startswith("cuda:") else int(device in ("gpu", "cuda"))
        )
        if torch.cuda.device_count() < wanted:
            raise ConfigError(
                f"loader.device={device}: torch sees {torch.cuda.device_count()} CUDA device(s) "
                "here; use auto or cpu"
            )
        name = cfg.trainer.accelerator  # Lightning's answer names no key and no way out
        gpus = torch.cuda.is_available() or (name == "gpu" and torch.backends.mps.is_available())
        if name in ("gpu", "cuda") and not gpus:
            raise ConfigError(
                f"trainer.accelerator={name}: torch sees no GPU here; trainer=cpu trains on the CPU"
            )
    kwargs = trainer_kwargs(cfg.trainer, ("default_root_dir", *(() if here else DEVICE_KEYS)))
    _built("trainer", _build_trainer_quietly, kwargs)


def _target(node: DictConfig, path: str) -> Any:
    try:
        return get_object(node._target_)
    except Exception as err:  # no such module or name
        raise ConfigError(f"{path}._target_={node._target_}: {err}") from None


def check_target_keys(cfg: DictConfig, path: str) -> None:
    """Every key of the `_target_` node at `path` is an argument its target takes (DDPStrategy
    passes the rest to DistributedDataParallel, which would refuse a typo only in the fit)."""
    node = OmegaConf.select(cfg, path)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    target = _target(node, path)
    taken = inspect.signature(target).parameters
    from lightning.pytorch.strategies import DDPStrategy

    if isinstance(target, type) and issubclass(target, DDPStrategy):
        from torch.nn.parallel import DistributedDataParallel

        taken = {**taken, **inspect.signature(DistributedDataParallel).parameters}
    elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
        return
    for key in node:
        if key not in taken and key not in HYDRA_KEYS:
            raise ConfigError(
                f"{path}.{key}: {getattr(target, '__name__', target)} takes no such argument"
                + did_you_mean(str(key), taken, path)
            )


def check_optimization(cfg: DictConfig) -> None:
    """torch checks an optimizer's and a schedule's values only when they are built: built here
    on a stand-in parameter. A schedule as long as the whole fit needs a fit with an end."""
    import torch

    from nailseg.model.module import schedule_length_args

    optimizer, trainer = instantiate(cfg.optimizer), cfg.trainer
    param = [torch.nn.Parameter(torch.zeros(1))]
    stand_in = _built("optimizer", lambda kw: optimizer.func(param, **kw), optimizer.keywords)
    if cfg.scheduler is None:
        return
    scheduler = instantiate(cfg.scheduler)
    for arg, length in schedule_length_args(scheduler, lambda: None).items():
        if length is not None and length < 1:  # cosine's T_max=0 divides by zero at step 1
            raise ConfigError(f"scheduler.{arg}={length}: must be >= 1 (null: the whole fit)")
        if length is not None or trainer.fast_dev_run or trainer.max_steps not in (None, -1):
            continue
        endless = None
        if trainer.max_epochs == -1:
            endless = "trainer.max_epochs=-1"
        elif trainer.max_epochs is None and trainer.max_time is not None:
            endless = f"trainer.max_time={trainer.max_time} (trainer.max_epochs unset)"
        if endless:
            raise ConfigError(
                f"{endless}: a fit without an end has no length for the LR schedule, which "
                f"spans the whole fit; set trainer.max_steps=N, scheduler.{arg}=N or "
                "scheduler=none"
            )
    if scheduler.keywords.get("eta_min", 0) < 0:  # the LR it decays to
        raise ConfigError(f"scheduler.eta_min={scheduler.keywords['eta_min']}: must be >= 0")
    kwargs = {**scheduler.keywords, **schedule_length_args(scheduler, lambda: 1000)}
    _built("scheduler", lambda kw: scheduler.func(stand_in, **kw), kwargs)


def _built(node: str, build: Callable[[dict[str, Any]], Any], kwargs: Mapping[str, Any]) -> Any:
    """`build(kwargs)`; a library's refusal becomes one line naming the key at fault: the one
    without which it builds."""
    try:
        return build(dict(kwargs))
    except Exception as err:  # maybe wrapped by Hydra's instantiate, with the cause
        text = " ".join(str(err.__cause__ or err).split())
    for key in kwargs:
        try:
            build({k: v for k, v in kwargs.items() if k != key})
        except Exception:
            continue
        if key not in HYDRA_KEYS:
            raise ConfigError(f"{node}.{key}={kwargs[key]}: {text}")
    raise ConfigError(f"{node}: {text}")


def trainer_kwargs(trainer: DictConfig, leave_out: Iterable[str] = ()) -> dict[str, Any]:
    """The trainer group without its unset keys (Lightning's defaults) nor those of `leave_out`."""
    kept = {k: trainer[k] for k in trainer if k not in leave_out and trainer[k] is not None}
    return {
        k: OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig | ListConfig) else v
        for k, v in kept.items()
    }


def _build_trainer_quietly(kwargs: dict[str, Any]) -> None:
    lightning = logging.getLogger("lightning.pytorch")
    level = lightning.level
    lightning.setLevel(logging.WARNING)  # its device report
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            instantiate(kwargs, logger=False, enable_checkpointing=False)
    finally:
        lightning.setLevel(level)


def check(cfg: DictConfig) -> None:
    """Every check that needs no data or net, as `PreCheck` runs them (`build` starts with it)."""
    check_values(cfg)
    check_objects(cfg)
