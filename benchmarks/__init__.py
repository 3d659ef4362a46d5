"""The project's own measurements, outside the package: the wheel carries `nailseg` alone.

Each module is a Hydra app run from make (`make bench-prepare`, `bench-predict`, `bench-scale`, `bench-zoomed`:
`python -m benchmarks.<name> ...`) with its config in conf/; `trace` and `timeline` are training
callbacks given on train.py's command line (`+callbacks.trace._target_=benchmarks.trace.StepTrace`).
Their schemas are stored here, so importing any of them makes its config typed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from nailseg.config import AugConfig, LoaderConfig, NormalizeConfig, PathsConfig


@dataclass
class BenchPrepareConfig:
    """`make bench-prepare` (`python -m benchmarks.prepare`); values in conf/bench_prepare.yaml."""

    paths: PathsConfig = MISSING
    input_dir: str = MISSING
    output_dir: str = MISSING
    group_regex: str | None = None
    num_workers: int | None = None  # None: one per CPU core
    repeats: int = MISSING
    synthetic_n: int = MISSING


@dataclass
class BenchScaleConfig:
    """`make bench-scale` (`python -m benchmarks.scale`); values in conf/bench_scale.yaml."""

    paths: PathsConfig = MISSING
    loader: LoaderConfig = MISSING
    aug: AugConfig = MISSING
    normalize: NormalizeConfig = MISSING
    output_dir: str = MISSING
    counts: list[int] = MISSING
    image_size: list[int] = MISSING
    num_workers: int | None = None  # None: one per CPU core
    seed: int = MISSING
    keep_data: bool = MISSING
    train: list[str] = MISSING


@dataclass
class BenchPredictConfig:
    """`make bench-predict` (`python -m benchmarks.predict`); values in conf/bench_predict.yaml."""

    paths: PathsConfig = MISSING
    ckpt: str = MISSING
    input_dir: str = MISSING
    output_dir: str = MISSING
    jpeg_scales: list[int] = MISSING
    jpeg_quality: int = MISSING
    batch_size: int = MISSING
    runs: dict[str, dict[str, Any]] = MISSING  # name -> predict overrides
    limit: dict[str, int] = MISSING  # run name -> its first N photos only
    onnx: bool = MISSING
    onnx_batch: int = MISSING
    repeats: int = MISSING


@dataclass
class BenchZoomedConfig:
    """`make bench-zoomed` (`python -m benchmarks.zoomed`); values in conf/bench_zoomed.yaml."""

    paths: PathsConfig = MISSING
    ckpt: str = MISSING
    input_dir: str = MISSING
    output_dir: str = MISSING
    num_workers: int | None = None  # prepare's; None: one per CPU core
    limit: int | None = None  # the first N validation photos; None: all
    seeds: list[int] = MISSING
    nail_px: list[float] = MISSING
    canvas: list[int] = MISSING
    background: str = MISSING
    runs: dict[str, dict[str, Any]] = MISSING  # name -> nailseg.load options
    long_sides: list[int] = MISSING
    device: str = MISSING
    batch_size: int = MISSING


for _name, _node in {
    "bench_prepare_schema": BenchPrepareConfig,
    "bench_scale_schema": BenchScaleConfig,
    "bench_predict_schema": BenchPredictConfig,
    "bench_zoomed_schema": BenchZoomedConfig,
}.items():
    ConfigStore.instance().store(name=_name, node=_node)
