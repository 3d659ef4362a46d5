"""Loader benchmark: which data path keeps the device busiest, for one model and one aug spec.

    python -m nailseg bench output_dir=DIR [loaders=...] [model=...] [image_size=[384,384]]

For every loader x aug, in one run: images/s of the loader alone (`loader_img_s`), of a training
loop it feeds (`train_img_s`, with `data_wait_frac`, the share of its time spent waiting for a
batch), and of that loop on one resident batch (`ceiling_img_s`: the most any loader could give,
once per batch size); the model's training FLOPs per image, and MFU against the device's bf16
matrix-multiply peak, measured once on CUDA (`peak_tflops=N` fixes it; no MFU on the CPU). With
`compile=true`, `eager_ceiling_img_s` is the uncompiled ceiling of the same run. Each figure is
the median of `repeats` windows after a warm-up; training is measured on CUDA only by default
(`measure_train: auto`). Writes bench.csv, bench.png and bench.json into `output_dir`, a folder
of its own, and prints a table.
"""

from __future__ import annotations

import copy
import itertools
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import hydra
import matplotlib
import pandas as pd
import torch
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import MISSING, DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table
from torch.utils.flop_counter import FlopCounterMode

from nailseg.config import (
    CONF_DIR,
    AugConfig,
    DatasetConfig,
    ModelConfig,
    NormalizeConfig,
    PathsConfig,
)
from nailseg.data.datamodule import NailDataModule
from nailseg.device import resolve_device
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OwnedFolder
from nailseg.model.metrics import build_loss
from nailseg.model.net import compile_net
from nailseg.prep.builtin import prepare_builtin
from nailseg.tables import print_table
from nailseg.training.build import use_channels_last

matplotlib.use("Agg")
import matplotlib.pyplot as plt


@dataclass
class BenchConfig:
    """`python -m nailseg bench`; values in conf/bench.yaml."""

    paths: PathsConfig = MISSING
    dataset: DatasetConfig = MISSING
    model: ModelConfig = MISSING
    optimizer: Any = MISSING  # the training's (an optimizer group option, its own schema)
    loaders: dict[str, Any] = MISSING  # name -> a loader group option (its own schema)
    augs: dict[str, AugConfig] = MISSING
    normalize: NormalizeConfig = MISSING
    output_dir: str = MISSING
    image_size: list[int] = MISSING
    device: str = MISSING  # auto | cpu | cuda
    measure_train: Any = MISSING  # auto | true | false
    precision: str = MISSING  # auto | bf16 | fp32
    channels_last: bool | None = MISSING  # null: on for CUDA only (the YAML says true)
    compile: bool = MISSING
    compile_mode: str = MISSING
    cudnn_benchmark: bool = MISSING
    peak_tflops: float | None = MISSING  # null: measured on CUDA
    loss: str = MISSING
    seed: int = MISSING
    warmup_batches: int = MISSING
    measure_batches: int = MISSING
    repeats: int = MISSING


ConfigStore.instance().store(name="bench_schema", node=BenchConfig)  # conf/bench.yaml
OUTPUTS = ["bench.csv", "bench.png", "bench.json"]
COLUMNS = [
    "loader", "aug", "device", "model", "batch_size", "image_size", "workers",
    "loader_img_s", "train_img_s", "ceiling_img_s", "ceiling_batch_size", "train_vs_ceiling",
    "data_wait_frac", "gpu_busy_pct", "ceiling_gpu_busy_pct", "eager_ceiling_img_s", "compile",
    "gflop_per_image", "peak_tflops", "ceiling_mfu", "train_mfu",
]  # fmt: skip
# the printed columns and their formats ("": as is); a column empty in every row is left out
SHOWN = {
    "loader": "", "aug": "", "batch_size": "", "loader_img_s": ".1f", "train_img_s": ".1f",
    "ceiling_img_s": ".1f", "gpu_busy_pct": ".1f", "train_vs_ceiling": ".3f",
    "data_wait_frac": ".3f", "gflop_per_image": ".2f", "ceiling_mfu": ".3f", "train_mfu": ".3f",
}  # fmt: skip
PEAK_MATMUL_SIZE = 8192  # square bf16 operands: large enough to run at the tensor cores' peak
PEAK_MATMULS, PEAK_WINDOWS = 20, 10  # products per timed window; the fastest window counts


@dataclass
class TrainStep:
    """One optimisation step of the benchmark model, as `fit` would run it on this device."""

    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: torch.nn.Module
    device: torch.device
    autocast_dtype: torch.dtype | None
    channels_last: bool

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The forward pass and the loss, in the step's memory format and precision."""
        image = batch["image"].to(self.device, non_blocking=True)
        mask = batch["mask"].to(self.device, non_blocking=True)
        if self.channels_last:
            image = image.contiguous(memory_format=torch.channels_last)
        with torch.autocast(
            self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
            return self.loss_fn(self.net(image), mask)

    def __call__(self, batch: dict[str, torch.Tensor]) -> None:
        loss = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def training_flops_per_image(step: TrainStep, image_size: tuple[int, int]) -> float:
    """FLOPs of one image's forward and backward pass through `step`'s net (the matrix multiplies
    and convolutions `FlopCounterMode` counts), on a copy of its eager net: the step's weights,
    BatchNorm statistics, gradients and optimizer stay as they were."""
    images = 2  # BatchNorm in training mode needs more than one value per channel
    batch = {
        "image": torch.randn(images, 3, *image_size, device=step.device),
        "mask": torch.zeros(images, 1, *image_size, device=step.device),
    }
    counted = copy.copy(step)
    counted.net = copy.deepcopy(step.net)
    with FlopCounterMode(display=False) as counter:
        counted.loss(batch).backward()
    return counter.get_total_flops() / images


def measured_peak_tflops(device: torch.device) -> float:
    """The device's dense bf16 matrix-multiply peak in TFLOP/s: the fastest of a few timed windows
    of large square products after a warm-up (MFU's denominator, as this machine runs it)."""
    n = PEAK_MATMUL_SIZE
    a, b, out = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(3))
    for _ in range(PEAK_MATMULS):  # warm-up: cuBLAS picks its kernel, the clocks rise
        torch.mm(a, b, out=out)
    fastest = float("inf")
    for _ in range(PEAK_WINDOWS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(PEAK_MATMULS):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        fastest = min(fastest, start.elapsed_time(end) / 1000)  # ms to s
    return 2 * n**3 * PEAK_MATMULS / fastest / 1e12


def _batches(loader) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches: a new full pass whenever one ends."""
    while True:
        yield from loader


def _window(
    batches: Iterator[dict[str, torch.Tensor]],
    n: int,
    device: torch.device,
    step: Callable[[dict[str, torch.Tensor]], None] | None,
) -> tuple[float, float]:
    """(images/s, wait fraction) over `n` batches; wait = time blocked in `next()`. The device
    is synchronised at the window's ends only: the CPU queues the next step while it works."""
    images, wait = 0, 0.0
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    sync(device)
    start = time.perf_counter()
    for _ in range(n):
        before = time.perf_counter()
        batch = next(batches)
        wait += time.perf_counter() - before
        images += len(batch["image"])
        if step is not None:
            step(batch)
    sync(device)
    elapsed = time.perf_counter() - start
    return images / elapsed, wait / elapsed


def _gpu_busy(device: torch.device, stop: threading.Event, samples: list[float]) -> None:
    """GPU utilisation (NVML, as nvidia-smi reports it) every 50 ms until `stop`; none on the CPU
    or where NVML is missing (the mean is then NaN rather than a failed benchmark)."""
    try:
        while device.type == "cuda" and not stop.wait(0.05):
            samples.append(torch.cuda.utilization(device))
    except Exception:
        samples.clear()


def _measure(
    batches, cfg: DictConfig, device: torch.device, step=None
) -> tuple[float, float, float]:
    """Median images/s, wait fraction and mean GPU busy % over `repeats` windows after a warm-up."""
    _window(batches, cfg.warmup_batches, device, step)
    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=_gpu_busy, args=(device, stop, samples), daemon=True)
    sampler.start()
    results = [_window(batches, cfg.measure_batches, device, step) for _ in range(cfg.repeats)]
    stop.set()
    sampler.join()
    busy = statistics.mean(samples) if samples else float("nan")
    return statistics.median(r[0] for r in results), statistics.median(r[1] for r in results), busy


def _train_step(cfg: DictConfig, device: torch.device, compile: bool) -> TrainStep:
    """The benchmark's training step; `compile` applies `cfg.compile_mode`."""
    net = instantiate(cfg.model).to(device)
    channels_last = use_channels_last(cfg.channels_last, device.type == "cuda")
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    dtype = torch.bfloat16 if device.type == "cuda" and cfg.precision in ("auto", "bf16") else None
    optimizer = instantiate(cfg.optimizer)(net.parameters())
    model = compile_net(net.train(), cfg.compile_mode) if compile else net.train()
    return TrainStep(model, optimizer, build_loss(cfg.loss), device, dtype, channels_last)


def _ceiling(
    batch: dict[str, torch.Tensor], cfg: DictConfig, device: torch.device, step: TrainStep
) -> dict[str, float]:
    """`step` on `batch` made resident, comparable only to training at its batch size; with
    `compile`, also the eager model on it, so what compiling bought is measured in the same run."""
    resident = {k: v.to(device) for k, v in batch.items()}
    img_s, _, busy = _measure(itertools.repeat(resident), cfg, device, step)
    eager_img_s = img_s
    if cfg.compile:
        eager = _train_step(cfg, device, compile=False)
        eager_img_s, _, _ = _measure(itertools.repeat(resident), cfg, device, eager)
    return {
        "ceiling_img_s": img_s, "ceiling_batch_size": len(resident["image"]),
        "ceiling_gpu_busy_pct": busy, "eager_ceiling_img_s": eager_img_s,
    }  # fmt: skip


def _train_figures(
    batches: Iterator[dict[str, torch.Tensor]],
    batch_size: int,
    ceilings: dict[int, dict[str, float]],
    cfg: DictConfig,
    device: torch.device,
    step: TrainStep,
) -> dict[str, float]:
    """One loader's training figures against the ceiling at its own batch size, measured on the
    first loader of that size and kept in `ceilings` for the rest of the run."""
    if batch_size not in ceilings:
        ceilings[batch_size] = _ceiling(next(batches), cfg, device, step)
    ceiling = ceilings[batch_size]
    train_img_s, wait, busy = _measure(batches, cfg, device, step)
    return {
        **ceiling, "train_img_s": train_img_s, "data_wait_frac": wait, "gpu_busy_pct": busy,
        "train_vs_ceiling": train_img_s / ceiling["ceiling_img_s"],
    }  # fmt: skip


def _plot(rows: pd.DataFrame, folder: OwnedFolder) -> None:
    """Grouped bars per aug: loader-only and training images/s per loader, each loader's ceiling
    (at its own batch size) as a dashed line over its bars."""
    augs = list(dict.fromkeys(rows["aug"]))
    fig, axes = plt.subplots(1, len(augs), figsize=(5 * len(augs), 4), squeeze=False)
    for ax, aug in zip(axes[0], augs, strict=True):
        part = rows[rows["aug"] == aug]
        x = range(len(part))
        ax.bar([i - 0.2 for i in x], part["loader_img_s"], width=0.4, label="loader only")
        if part["train_img_s"].notna().any():
            ax.bar([i + 0.2 for i in x], part["train_img_s"], width=0.4, label="training")
            ax.hlines(
                part["ceiling_img_s"], [i - 0.4 for i in x], [i + 0.4 for i in x],
                colors="k", linestyles="--", label="ceiling",
            )  # fmt: skip
        ax.set_xticks(list(x), [f"{r.loader}\nbatch {r.batch_size}" for r in part.itertuples()])
        ax.set_title(f"aug={aug}")
        ax.set_ylabel("images/s")
        ax.legend()
    first = rows.iloc[0]
    fig.suptitle(f"{first['model']}, {first['image_size']}, {first['device']}")
    fig.tight_layout()
    folder.write("bench.png", lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


def _print(rows: pd.DataFrame, flops: float, peak: float | None, given: bool) -> None:
    """The table, and under it what the MFU columns divide by, or why they are empty."""
    note = (
        f"MFU = images/s x {flops / 1e9:.2f} GFLOP per image (forward and backward) / {peak:.4g} "
        f"TFLOP/s (dense bf16 matrix-multiply peak, {'as given' if given else 'measured'})"
        if peak is not None
        else "no MFU: the bf16 matrix-multiply peak is measured on CUDA only "
        "(peak_tflops=N gives one)"
    )
    first = rows.iloc[0]  # the model is named: a ceiling is only comparable for the same one
    table = Table(
        title=f"loader benchmark, {first['model']}, {first['image_size']}, {first['device']} "
        "(images/s, median of repeats; each ceiling at its row's batch size)",
        caption=note,
    )
    shown = [column for column in SHOWN if rows[column].notna().any()]
    for column in shown:
        table.add_column(column, justify="right")
    for row in rows[shown].itertuples(index=False):
        table.add_row(*(
            "" if pd.isna(value) else format(value, SHOWN[column])
            for column, value in zip(shown, row, strict=True)
        ))  # fmt: skip
    print_table(table)


def run(cfg: DictConfig) -> pd.DataFrame:
    out = OwnedFolder.claim(cfg.output_dir, "bench", key="output_dir")
    out.check_free(OUTPUTS)
    prepare_builtin(cfg.dataset)  # the built-in synthetic data, as train.py makes it
    device = resolve_device(cfg.device)
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
    measure_train = (
        device.type == "cuda" if cfg.measure_train == "auto" else bool(cfg.measure_train)
    )
    image_size = tuple(cfg.image_size)
    # counted on an eager step of its own, before anything is compiled or measured
    flops = training_flops_per_image(_train_step(cfg, device, compile=False), image_size)
    peak = cfg.peak_tflops
    if peak is None and device.type == "cuda":
        peak = measured_peak_tflops(device)
    step = _train_step(cfg, device, cfg.compile) if measure_train else None
    ceilings: dict[int, dict[str, float]] = {}
    rows = []
    for aug_name, aug_cfg in cfg.augs.items():
        spec = instantiate(aug_cfg, mean=cfg.normalize.mean, std=cfg.normalize.std, _convert_="all")
        for loader_name, loader_cfg in cfg.loaders.items():
            datamodule = NailDataModule(
                cfg.dataset.root,
                image_size,
                instantiate(loader_cfg),
                spec,
                final_split="auto",
                mix=[],  # the loaders on the primary root alone
                weight=cfg.dataset.weight,
            )
            loader = datamodule.train_dataloader()
            batches = _batches(loader)
            loader_img_s, _, _ = _measure(batches, cfg, device)
            train = (
                _train_figures(batches, loader_cfg.batch_size, ceilings, cfg, device, step)
                if step is not None
                else {}  # loaders only: the training columns stay NaN
            )
            rows.append({
                "loader": loader_name, "aug": aug_name, "device": device.type,
                "model": f"{cfg.model.arch}-{cfg.model.encoder_name}",
                "batch_size": loader_cfg.batch_size, "image_size": "x".join(map(str, image_size)),
                "workers": loader_cfg.num_workers, "loader_img_s": loader_img_s,
                "compile": cfg.compile_mode if cfg.compile else "off", **train,
            })  # fmt: skip
            datamodule.teardown("fit")  # its loader and its lock on the root
    # columns of training left unmeasured are NaN; the ceiling's batch stays an integer
    frame = pd.DataFrame(rows, columns=COLUMNS).astype({"ceiling_batch_size": "Int64"})
    frame["gflop_per_image"] = flops / 1e9
    frame["peak_tflops"] = float("nan") if peak is None else peak
    frame["ceiling_mfu"] = frame["ceiling_img_s"] * flops / (frame["peak_tflops"] * 1e12)
    frame["train_mfu"] = frame["train_img_s"] * flops / (frame["peak_tflops"] * 1e12)
    out.write("bench.csv", frame.to_csv(index=False, float_format="%.4f").encode())
    _plot(frame, out)
    config = OmegaConf.to_container(cfg, resolve=True)
    out.write("bench.json", json.dumps({"config": config}, indent=2).encode())
    _print(frame, flops, peak, given=cfg.peak_tflops is not None)
    Console().print(f"written: {out.path / 'bench.csv'}, bench.png, bench.json")
    return frame


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except NotOursError as err:  # a user's folder, or a user's file where an output goes
        sys.exit(f"nailseg bench: {err}")


if __name__ == "__main__":
    main()
