"""Typed schemas for every config, registered in Hydra's ConfigStore.

Each YAML file lists its schema first in its defaults, so an unknown key or a value of the wrong
type fails when the config is composed, naming the key — not at epoch 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class SyntheticConfig:
    """Procedural data the project generates itself (the default on a fresh clone)."""

    n: int = 200
    seed: int = 0


@dataclass
class DatasetConfig:
    """Where a dataset's raw photos and prepared arrays live, and the input size it trains at."""

    name: str = MISSING
    root: str = MISSING  # prepared data: the output of prepare.py
    raw_dir: str | None = None  # Images/ + Masks/; what prepare.py reads by default
    group_regex: str | None = None  # subject id from a file stem: one subject, one split
    image_size: list[int] = field(default_factory=lambda: [128, 128])  # height, width
    synthetic: SyntheticConfig | None = None


@dataclass
class SplitConfig:
    valid_fraction: float = 0.2
    test_fraction: float = 0.0
    seed: int = 42
    group_regex: str | None = None
    folds: int = 1
    fold: int = 0


@dataclass
class PrepareConfig:
    dataset: DatasetConfig = MISSING
    input_dir: str = MISSING
    output_dir: str = MISSING
    mask_threshold: int = 127
    strict: bool = False
    num_workers: int | None = None  # None: one per CPU core
    split: SplitConfig = field(default_factory=SplitConfig)


@dataclass
class AugOpConfig:
    """One op of an `aug=` spec; only the range keys its op takes may be set (see augment.py)."""

    op: str = MISSING
    p: float = 1.0
    degrees: list[float] | None = None
    scale: list[float] | None = None
    ratio: list[float] | None = None
    sigma: list[float] | None = None
    factor: list[float] | None = None


@dataclass
class AugConfig:
    _target_: str = "nailseg.data.augment.AugSpec.from_config"
    ops: list[AugOpConfig] = field(default_factory=list)
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])


@dataclass
class LoaderConfig:
    """A loader backend; built per split by the datamodule (`_partial_`: records etc. come later)."""

    _target_: str = MISSING
    _partial_: bool = True
    batch_size: int = 16
    device: str = "auto"  # auto | cpu | gpu
    num_workers: int = 2  # CPU parallelism: DALI threads, DataLoader worker processes
    prefetch: int = 2
    seed: int = 0


@dataclass
class TorchLoaderConfig(LoaderConfig):
    """`loader=torch` and `loader=kornia`: a torch DataLoader underneath."""

    pin_memory: bool = True
    persistent_workers: bool = True


@dataclass
class ModelConfig:
    """Any segmentation-models-pytorch architecture (`arch`), built by `smp.create_model`."""

    _target_: str = "nailseg.model.net.build_net"
    arch: str = MISSING
    encoder_name: str = MISSING
    encoder_weights: str | None = None  # "imagenet" downloads weights: opt-in only
    options: dict[str, Any] = field(default_factory=dict)  # extra arch keyword arguments


@dataclass
class ModuleConfig:
    """The LightningModule's knobs: loss, threshold, optimiser and schedule (`_partial_`)."""

    loss: str = "dice_bce"
    threshold: float = 0.5
    channels_last: bool | None = None  # None: on for CUDA, off for CPU
    compile: bool = False  # torch.compile the module: fewer kernel launches
    compile_mode: str = "default"  # reduce-overhead: also CUDA graphs (SegFormer is launch-bound)
    optimizer: Any = field(
        default_factory=lambda: {
            "_target_": "torch.optim.AdamW",
            "_partial_": True,
            "lr": 1e-3,
            "weight_decay": 1e-4,
        }
    )
    scheduler: Any = field(
        default_factory=lambda: {
            "_target_": "torch.optim.lr_scheduler.CosineAnnealingLR",
            "_partial_": True,
            "T_max": "${trainer.max_epochs}",
        }
    )


@dataclass
class TrainerConfig:
    """Lightning Trainer keyword arguments; every key here is overridable as trainer.<key>=..."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "auto"
    strategy: str = "auto"
    devices: Any = "auto"
    num_nodes: int = 1
    precision: str | None = None
    fast_dev_run: Any = False
    max_epochs: int | None = 10
    min_epochs: int | None = None
    max_steps: int = -1
    min_steps: int | None = None
    max_time: str | None = None
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    limit_test_batches: Any = None
    limit_predict_batches: Any = None
    overfit_batches: Any = 0.0
    val_check_interval: Any = None
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int | None = None
    log_every_n_steps: int | None = None
    enable_checkpointing: bool | None = None
    enable_progress_bar: bool | None = None
    enable_model_summary: bool | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    deterministic: Any = None
    benchmark: bool | None = None
    inference_mode: bool = True
    use_distributed_sampler: bool = True
    profiler: str | None = None
    detect_anomaly: bool = False
    barebones: bool = False
    sync_batchnorm: bool = False
    reload_dataloaders_every_n_epochs: int = 0
    default_root_dir: str | None = None


@dataclass
class TrainConfig:
    dataset: DatasetConfig = MISSING
    loader: LoaderConfig = MISSING
    aug: AugConfig = MISSING
    model: ModelConfig = MISSING
    module: ModuleConfig = field(default_factory=ModuleConfig)
    trainer: TrainerConfig = MISSING
    logger: dict[str, Any] | None = None
    callbacks: dict[str, Any] | None = None
    run_dir: str = "${hydra:runtime.output_dir}"
    seed: int = 42
    ckpt_path: str | None = None  # "last" (newest last.ckpt under outputs/) or a path
    test: bool = True  # after fit, test the best checkpoint and write metrics.json
    optimized_metric: str = "val/dice"  # what train.py returns to sweepers
    overlay_every_n_epochs: int = 5


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="prepare_schema", node=PrepareConfig)
    cs.store(name="train_schema", node=TrainConfig)
    for group, node in (
        ("dataset", DatasetConfig),
        ("aug", AugConfig),
        ("loader", LoaderConfig),
        ("model", ModelConfig),
        ("trainer", TrainerConfig),
    ):
        cs.store(group=group, name=f"{group}_schema", node=node)
    cs.store(group="loader", name="torch_loader_schema", node=TorchLoaderConfig)


register()
