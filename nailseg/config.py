"""Typed schemas for every config, registered in Hydra's ConfigStore: types only, every value in a
YAML file under `conf/`. A field is MISSING (the YAML sets it) or None ("not set": the code's
documented meaning). Each YAML file lists its schema first, so a wrong key or type fails at
composition, naming the key. Schemas are stored outside every group (`/<name>@_here_`), so they
are never offered as a group's options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from nailseg.device import auto_accelerator, auto_precision

_PACKAGE = Path(__file__).resolve().parent
_INSTALLED = (_PACKAGE / "conf").is_dir()  # a wheel carries conf/ inside (pyproject.toml maps it)
# every entry point's config folder: one resolution, whichever way a command is started
CONF_DIR = str(_PACKAGE / "conf" if _INSTALLED else _PACKAGE.parent / "conf")
# the checkout (the folder holding conf/ and train.py), where `paths.root_dir` anchors every
# default; None when installed, where the current folder does
PROJECT_ROOT = None if _INSTALLED else str(_PACKAGE.parent)


@dataclass
class PathsConfig:
    """Where runs and data go by default (conf/paths/default.yaml): under the checkout, wherever a
    command is started from; installed, under the current folder."""

    root_dir: str = MISSING
    data_dir: str = MISSING
    log_dir: str = MISSING  # single runs' folders (<log_dir>/<task_name>/<time>) and tools' results
    sweep_dir: str = MISSING  # sweeps' folders (a run's own folder is train.py's `run_dir`)


@dataclass
class SyntheticConfig:
    n: int = MISSING
    seed: int = MISSING
    framing: str = MISSING  # close | wild (synth/scene.py's FRAMINGS)


@dataclass
class MixSourceConfig:
    """Another prepared root whose train split is mixed into training (`dataset.mix`)."""

    name: str = MISSING  # its groups are named <name>/<group> in the per-group metrics
    root: str = MISSING  # prepared data: the output of prepare.py
    weight: float = MISSING  # its share of each epoch: weight / (dataset.weight + all weights)


@dataclass
class DatasetConfig:
    """Where a dataset's raw photos and prepared arrays live, and the input size it trains at."""

    name: str = MISSING
    root: str = MISSING  # prepared data: the output of prepare.py
    raw_dir: str | None = None  # Images/ + Masks/; what prepare.py reads by default
    group_regex: str | None = None  # subject id from a file stem: one subject, one split
    image_size: list[int] = MISSING  # height, width
    synthetic: SyntheticConfig | None = None  # set: prepare.py generates raw_dir first
    weight: float = MISSING  # the root's share of each epoch when other sources are mixed in
    mix: list[MixSourceConfig] = MISSING  # other sources' train splits mixed into training


@dataclass
class SplitConfig:
    valid_fraction: float = MISSING
    test_fraction: float = MISSING
    seed: int = MISSING
    group_regex: str | None = None
    folds: int = MISSING
    fold: int = MISSING
    holdout_groups: list[str] = MISSING  # groups (Images/<group>) whose every photo is test


@dataclass
class PrepareConfig:
    paths: PathsConfig = MISSING
    dataset: DatasetConfig = MISSING
    input_dir: str = MISSING
    output_dir: str = MISSING
    mask_threshold: int = MISSING
    strict: bool = MISSING
    prune: bool = MISSING  # delete the outputs of pairs gone from the input
    num_workers: int | None = None  # None: one per CPU core
    split: SplitConfig = MISSING


@dataclass
class AugOpConfig:
    """One op of an `aug=` spec; only the range keys its op takes may be set (see augment.py)."""

    op: str = MISSING
    p: float = MISSING
    degrees: list[float] | None = None
    scale: list[float] | None = None
    ratio: list[float] | None = None
    sigma: list[float] | None = None
    factor: list[float] | None = None
    gamma: list[float] | None = None
    quality: list[float] | None = None


@dataclass
class AugConfig:
    _target_: str = MISSING
    ops: list[AugOpConfig] = MISSING


@dataclass
class NormalizeConfig:
    """`(x/255 - mean) / std` per RGB channel: what every loader, predict and export apply."""

    mean: list[float] = MISSING
    std: list[float] = MISSING


@dataclass
class LoaderConfig:
    """A loader backend; built per split by the datamodule (`_partial_`: records etc. come later)."""

    _target_: str = MISSING
    _partial_: bool = MISSING
    batch_size: int = MISSING
    device: str = MISSING  # auto | cpu | gpu
    num_workers: int = MISSING  # CPU parallelism: DALI threads, DataLoader worker processes
    prefetch: int = MISSING
    seed: int = MISSING


@dataclass
class TorchLoaderConfig(LoaderConfig):
    pin_memory: bool = MISSING
    persistent_workers: bool = MISSING


@dataclass
class ModelConfig:
    """Any segmentation-models-pytorch architecture (`arch`), built by `smp.create_model`."""

    _target_: str = MISSING
    arch: str = MISSING
    encoder_name: str = MISSING
    encoder_weights: str | None = None  # "imagenet" downloads weights: opt-in only
    options: dict[str, Any] = MISSING  # extra arch keyword arguments (plain values)


@dataclass
class AdamWConfig:
    _target_: str = MISSING
    _partial_: bool = MISSING
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: list[float] = MISSING
    fused: bool | None = None  # None: torch's choice (its multi-tensor kernels); True: one kernel


@dataclass
class SGDConfig:
    _target_: str = MISSING
    _partial_: bool = MISSING
    lr: float = MISSING
    momentum: float = MISSING
    weight_decay: float = MISSING
    nesterov: bool = MISSING


@dataclass
class CosineConfig:
    """CosineAnnealingLR stepped every optimizer step; T_max None: the whole fit."""

    _target_: str = MISSING
    _partial_: bool = MISSING
    T_max: int | None = None
    eta_min: float = MISSING


@dataclass
class OneCycleConfig:
    _target_: str = MISSING
    _partial_: bool = MISSING
    max_lr: float = MISSING
    total_steps: int | None = None  # None: the whole fit
    pct_start: float = MISSING
    div_factor: float = MISSING
    final_div_factor: float = MISSING
    cycle_momentum: bool = MISSING  # true: the schedule drives momentum / beta1 (see the YAML)
    base_momentum: float = MISSING
    max_momentum: float = MISSING


@dataclass
class WarmupCosineConfig:
    """Linear warm-up, then cosine to `min_lr_ratio`; total_steps None: the whole fit."""

    _target_: str = MISSING
    _partial_: bool = MISSING
    total_steps: int | None = None
    warmup_fraction: float = MISSING
    min_lr_ratio: float = MISSING


@dataclass
class ModuleConfig:
    loss: str = MISSING  # dice | bce | focal | lovasz | dice_bce
    threshold: float = MISSING
    channels_last: bool | None = MISSING  # null: on for CUDA only (the YAML says true)
    compile: bool = MISSING  # torch.compile the net: fewer kernel launches
    compile_mode: str = MISSING  # reduce-overhead: also CUDA graphs (SegFormer is launch-bound)
    eval_scales: list[float] | None = MISSING  # validation and test at these factors of the size


@dataclass
class ExtrasConfig:
    print_config: bool = MISSING  # the config tree on the console (always in config_tree.txt)


@dataclass
class TrainerConfig:
    """Lightning Trainer keyword arguments; every key is overridable as trainer.<key>=...

    None means "not set": the key is not passed, so Lightning's own default applies.
    """

    _target_: str = MISSING
    accelerator: str | None = None
    # a Lightning strategy name (ddp, ...) or a node with `_target_`, e.g. DDPStrategy with DDP's
    # own options (static_graph, bucket_cap_mb, ddp_comm_hook): conf/trainer/ddp.yaml
    strategy: Any = None
    devices: Any = None
    num_nodes: int | None = None
    precision: str | None = None
    fast_dev_run: Any = None
    max_epochs: int | None = None
    min_epochs: int | None = None
    max_steps: int | None = None
    min_steps: int | None = None
    max_time: str | None = None
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    limit_test_batches: Any = None
    limit_predict_batches: Any = None
    overfit_batches: Any = None
    val_check_interval: Any = None
    check_val_every_n_epoch: int | None = None
    num_sanity_val_steps: int | None = None
    log_every_n_steps: int | None = None
    enable_checkpointing: bool | None = None
    enable_progress_bar: bool | None = None
    enable_model_summary: bool | None = None
    accumulate_grad_batches: int | None = None
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    deterministic: Any = None
    benchmark: bool | None = None
    inference_mode: bool | None = None
    use_distributed_sampler: bool | None = None
    profiler: str | None = None
    detect_anomaly: bool | None = None
    barebones: bool | None = None
    sync_batchnorm: bool | None = None
    reload_dataloaders_every_n_epochs: int | None = None
    default_root_dir: str | None = None


@dataclass
class TrainConfig:
    paths: PathsConfig = MISSING
    task_name: str = MISSING  # names the run folder: <paths.log_dir>/<task_name>/<time>
    tags: list[str] = MISSING  # given to the loggers that take tags (W&B), kept in metrics.json
    dataset: DatasetConfig = MISSING
    loader: LoaderConfig = MISSING
    aug: AugConfig = MISSING
    normalize: NormalizeConfig = MISSING
    model: ModelConfig = MISSING
    optimizer: Any = MISSING
    scheduler: Any = None  # scheduler=none: a constant learning rate
    module: ModuleConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: dict[str, Any] | None = None
    callbacks: dict[str, Any] | None = None
    run_dir: str = MISSING
    seed: int = MISSING
    train: bool = MISSING  # false: only evaluate `ckpt_path` on `eval_split`
    ckpt_path: str | None = None  # "last" (the newest valid last.ckpt) or a path: resume
    init_from: str | None = None  # a checkpoint whose whole net starts a new run (a fine-tune)
    test: bool = MISSING  # after fit, evaluate the best checkpoint and write metrics.json
    eval_split: str = MISSING  # auto (test when prepared, else valid) | train | valid | test
    optimized_metric: str = MISSING  # what train.py returns to sweepers (its best value)
    optimized_mode: str = MISSING  # max | min: which value of optimized_metric is best
    overlay_every_n_epochs: int = MISSING
    extras: ExtrasConfig = MISSING


# stored at the top, in no group: a group's options are its YAML files only
@dataclass
class SyntheticCliConfig:
    """`python -m nailseg.synth`; values in conf/synthetic.yaml."""

    out: str = MISSING
    n: int = MISSING
    seed: int = MISSING
    framing: str = MISSING
    num_workers: int = MISSING


@dataclass
class InferenceConfig:
    """Keys that predict and export share: the checkpoint and overrides of what its card says
    (None: take the checkpoint's value)."""

    ckpt: str = MISSING
    model: ModelConfig | None = None  # model=unet model.encoder_name=...: a `model=` group
    image_size: list[int] | None = None  # [height, width] the net runs at
    mean: list[float] | None = None  # normalisation, per RGB channel
    std: list[float] | None = None


@dataclass
class TileConfig:
    """Types only: the values are in conf/predict.yaml."""

    long_side: int | None = None  # the photo's long side, in pixels, before tiling (None: no tiles)
    overlap: float = MISSING  # neighbouring tiles' least overlap, a fraction of a tile


@dataclass
class PredictConfig(InferenceConfig):
    """Types only: the values are in conf/predict.yaml."""

    input: Any = MISSING  # a folder (searched recursively), a file, or a list of either
    output: str = MISSING
    masks: str | None = None  # true masks, matched by key: writes scores.csv
    tta: bool = MISSING  # mean of identity, horizontal and vertical flip probabilities
    scales: list[float] | None = None  # factors of the input size, maps averaged (None: 1 size)
    tile: TileConfig = MISSING  # photos in tiles of the input size (long_side None: whole)
    auto_scale: bool = MISSING  # small nails run again at their training size (no scales, tile)
    threshold: str | None = None  # None: the checkpoint's; a number; "auto": Dice-best on valid
    data_root: str | None = None  # prepared data for threshold=auto (None: the checkpoint's)
    batch_size: int = MISSING
    device: str = MISSING  # auto | cpu | cuda | cuda:N
    gpu_decode: bool = MISSING  # on a GPU: JPEGs decoded by nvJPEG (else by the worker processes)
    engine: str = MISSING  # torch | onnx (ONNX Runtime, CPU only)
    cuda_graphs: bool = MISSING  # on a GPU: the net's forward replayed as a CUDA graph
    overlays: bool = MISSING  # also write OUT/overlays/<key>.png
    num_workers: int | None = None  # processes reading and writing files (None: worker_count)
    mask_threshold: int = MISSING  # a true mask's value > this is nail (0/1 masks taken as is)


@dataclass
class ExportConfig(InferenceConfig):
    """Types only: the values are in conf/export.yaml."""

    format: str = MISSING
    output: str | None = None  # None: next to the checkpoint, <name>.onnx or the folder <name>-smp
    opset: int = MISSING
    verify: bool = MISSING  # check ONNX Runtime against PyTorch before writing


SCHEMAS: dict[str, type] = {
    "prepare_schema": PrepareConfig,
    "train_schema": TrainConfig,
    "paths_schema": PathsConfig,
    "dataset_schema": DatasetConfig,
    "aug_schema": AugConfig,
    "normalize_schema": NormalizeConfig,
    "loader_schema": LoaderConfig,
    "torch_loader_schema": TorchLoaderConfig,
    "model_schema": ModelConfig,
    "adamw_schema": AdamWConfig,
    "sgd_schema": SGDConfig,
    "cosine_schema": CosineConfig,
    "onecycle_schema": OneCycleConfig,
    "cosine_warmup_schema": WarmupCosineConfig,
    "trainer_schema": TrainerConfig,
    "synthetic_schema": SyntheticCliConfig,
    "predict_schema": PredictConfig,
    "export_schema": ExportConfig,
}


# optimized_mode as an Optuna study direction: `${nailseg.direction:${optimized_mode}}`
DIRECTIONS = {"max": "maximize", "min": "minimize"}


def study_direction(mode: str) -> str:
    """The direction that improves `optimized_metric`, so a search never optimizes it backwards."""
    if mode not in DIRECTIONS:
        raise ValueError(f"optimized_mode={mode}: must be max or min")
    return DIRECTIONS[mode]


def study_seed(seed: int, storage: str | None, study_name: str) -> int:
    """The Optuna sampler's seed: the run's plus the trials the stored study holds, so a rerun
    adds new trials rather than repeating the first ones. A SQLite file that does not exist is
    not created here (resolving a config writes nothing)."""
    if not storage or (
        storage.startswith("sqlite:///") and not Path(storage.removeprefix("sqlite:///")).exists()
    ):
        return seed
    import optuna

    try:
        return seed + len(optuna.load_study(study_name=study_name, storage=storage).trials)
    except KeyError:  # no study of that name in the storage yet
        return seed


def register() -> None:
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(name=name, node=node)
    # every entry point imports this module before Hydra composes (and a sweeper resolves)
    OmegaConf.register_new_resolver("nailseg.root", lambda: PROJECT_ROOT or os.getcwd())
    OmegaConf.register_new_resolver("nailseg.task", lambda train: "train" if train else "eval")
    OmegaConf.register_new_resolver("nailseg.direction", study_direction)
    OmegaConf.register_new_resolver("nailseg.study_seed", study_seed)
    # trainer=auto's device and precision: the one choice loader.device=auto makes too
    OmegaConf.register_new_resolver("nailseg.accelerator", auto_accelerator)
    OmegaConf.register_new_resolver("nailseg.precision", auto_precision)


register()
