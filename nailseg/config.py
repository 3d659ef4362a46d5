"""Typed schemas for every config, registered in Hydra's ConfigStore.

Each YAML file lists its schema first in its defaults, so an unknown key or a value of the wrong
type fails when the config is composed, naming the key — not at epoch 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="prepare_schema", node=PrepareConfig)
    cs.store(group="dataset", name="dataset_schema", node=DatasetConfig)


register()
