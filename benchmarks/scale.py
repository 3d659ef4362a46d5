"""Cost as the work grows: generate, prepare, one loader epoch and one training epoch at 1k, 10k,
100k photos.

    make bench-scale    (python -m benchmarks.scale output_dir=DIR [counts=[1000,10000,100000]])

For each count, each stage runs in a process of its own, started fresh (spawn), so its peak
resident memory (`getrusage`) is that stage's alone: the stage process's own peak and its largest
child's (`RUSAGE_CHILDREN`: generate's and prepare's pools, the torch loader's workers). Linux
counts a forked child's pages shared with its parent at the fork, even when it then runs another
program, so the child's figure is at least the stage's size when it forked: an upper bound.

1. `generate`: the synthetic photos (`nailseg.synth`), photos/s;
2. `prepare`: them into a prepared root with conf/prepare.yaml's settings, photos/s, and the bytes
   on disk per photo of photos and root together;
3. `loader`: one epoch of the configured loader over the train split, no model, images/s;
4. `train`: `train.py` for one epoch on the prepared root at the bench's image size and batch
   size (`train`: more of its overrides, e.g. `[experiment=gpu_384]`), its training images/s
   from its metrics.json and its process's peak (a DALI loader's threads are in it).

Linear cost shows as the same photos/s at every count, flat memory as the same peak: each count's
per-photo seconds and peaks are printed divided by the count's before it. The data of a count
lives in a scratch folder inside `output_dir`, removed once measured (`keep_data=true`: kept in
`data-<count>`, reserved in the folder's journal); a count whose estimated disk need (the count before it's bytes per photo) exceeds
the free space is refused in one line, after the counts before it are written. Writes
`bench_scale.csv`, `bench_scale.png` and `bench_scale.json` (the config) into `output_dir`, a
folder of its own (`benchmarks.output`), and prints a table.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
import pandas as pd
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from benchmarks.output import claim_output, scratch
from benchmarks.prepare import seconds
from nailseg.config import CONF_DIR, PROJECT_ROOT
from nailseg.io.folder import OwnedFolder
from nailseg.lifetime import die_with_parent
from nailseg.prep.prepare import PrepareSettings, compose_prepare, prepare
from nailseg.synth.scene import generate, manifest
from nailseg.tables import print_table

OUTPUTS = ["bench_scale.csv", "bench_scale.png", "bench_scale.json"]
STAGES = ("generate", "prepare", "loader", "train")
# each stage's rate column: photos (images, for the loader and training) per second
_RATES = {
    "generate": "generate_photos_s",
    "prepare": "prepare_photos_s",
    "loader": "loader_img_s",
    "train": "train_img_s",
}
COMMAND = "benchmarks.scale"
_MIB = 1024  # ru_maxrss is in KiB on Linux


class StageError(RuntimeError):
    """A stage's process failed: its traceback, or how it ended."""


def _peak_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / _MIB


def _stage_main(send, parent: int, stage: Callable[..., dict[str, Any]], args: tuple) -> None:
    """The stage process: run `stage(*args)`, then send its result and peaks (or the traceback);
    a stage that measures its own peak (`train`: its train.py process's) reports it."""
    die_with_parent(parent)
    try:
        result = stage(*args)
        peaks = {
            "peak_mib": _peak_mib(resource.RUSAGE_SELF),
            "workers_peak_mib": _peak_mib(resource.RUSAGE_CHILDREN),
        }
        send.send(("ok", peaks | result))
    except BaseException:
        send.send(("error", traceback.format_exc()))
    finally:
        send.close()


def in_fresh_process(stage: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """`stage(*args)` in a new process started for it alone (spawn: nothing of this process's
    memory in it), with `peak_mib` (its own peak RSS) and `workers_peak_mib` (its largest
    finished child's) added. Raises StageError when it fails."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_stage_main, args=(send, os.getpid(), stage, args))
    process.start()
    send.close()
    try:
        status, value = receive.recv()
    except EOFError:
        status, value = "died", None
    finally:
        receive.close()
        process.join()
    if status == "ok":
        return value
    if status == "died":
        value = f"{stage.__name__} ended with exit code {process.exitcode} before reporting"
    raise StageError(value)


def generate_stage(raw: Path, count: int, seed: int, workers: int) -> dict[str, Any]:
    """Stage 1: the synthetic photos into `raw`."""
    return {"seconds": seconds(lambda: generate(raw, count, seed, num_workers=workers))}


def prepare_stage(raw: Path, root: Path, settings: PrepareSettings, source: dict) -> dict[str, Any]:
    """Stage 2: `raw` prepared into `root`."""
    return {"seconds": seconds(lambda: prepare(raw, root, settings, source))}


def loader_stage(
    root: Path, image_size: list[int], loader: dict, aug: dict, normalize: dict
) -> dict[str, Any]:
    """Stage 3: one epoch of the loader over `root`'s train split, as train.py builds it; the
    epoch's clock starts at its first `next()` and stops once the last batch is on the device."""
    # imported here: the other stages' processes never load torch, DALI or the loaders
    import torch
    from hydra.utils import instantiate

    from nailseg.data.datamodule import NailDataModule

    spec = instantiate(aug, mean=normalize["mean"], std=normalize["std"], _convert_="all")
    datamodule = NailDataModule(  # the root alone: with nothing mixed in, its weight is unused
        root, tuple(image_size), instantiate(loader), spec, final_split="auto", mix=[], weight=1.0
    )
    batches = datamodule.train_dataloader()
    images, last = 0, None
    start = time.perf_counter()
    for batch in batches:
        images += len(batch["image"])
        last = batch["image"]
    if last is not None and last.device.type == "cuda":
        torch.cuda.synchronize(last.device)
    seconds = time.perf_counter() - start
    batches.close()
    return {"seconds": seconds, "images": images}


def train_stage(
    root: Path, count: int, seed: int, run_dir: Path, overrides: list[str]
) -> dict[str, Any]:
    """Stage 4: `python train.py` for one epoch on `root` (the synthetic set of `count` photos and
    `seed` it holds), no final test, no logger; its first epoch's training images/s (validation
    excluded) from its metrics.json; the end of its output if it fails."""
    command = [
        sys.executable, str(Path(PROJECT_ROOT) / "train.py"), "dataset=synthetic",
        f"dataset.root={root}", f"dataset.raw_dir={root.parent / 'raw'}",
        f"dataset.synthetic.n={count}", f"dataset.synthetic.seed={seed}",
        "dataset.synthetic.framing=wild", "trainer.max_epochs=1",  # generate()'s default
        "test=false", "logger=none", f"hydra.run.dir={run_dir}", *overrides,
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, preexec_fn=die_with_parent, check=False
    )
    if done.returncode != 0:
        raise StageError(f"train.py exited with {done.returncode}:\n{done.stderr[-3000:]}")
    epoch = json.loads((run_dir / "metrics.json").read_text())["throughput"]["per_epoch"][0]
    train_s = epoch["images"] / epoch["images_per_s"]
    return {
        "seconds": train_s,
        "images": epoch["images"],
        "data_wait_frac": epoch["data_wait_frac"],
        "peak_mib": _peak_mib(resource.RUSAGE_CHILDREN),
    }


def _bytes_on_disk(folder: Path) -> int:
    """What the files below `folder` take on disk (allocated blocks, as free space counts)."""
    return sum(
        (Path(top) / name).stat().st_blocks * 512
        for top, _, names in os.walk(folder)
        for name in names
    )


def disk_refusal(count: int, before: dict[str, Any] | None, free: int, folder: Path) -> str | None:
    """The one-line refusal of `count` when the count before it (its row, `before`) says its
    photos and prepared root would not fit in `free` bytes; None when they would or nothing is
    known yet."""
    if before is None:
        return None
    need = before["bytes_per_photo"] * count
    if need <= free:
        return None
    return (
        f"{COMMAND}: {count} photos would take about {need / 2**30:.1f} GiB "
        f"({before['bytes_per_photo'] / 1024:.0f} KiB a photo at {before['count']}), but "
        f"{folder} has {free / 2**30:.1f} GiB free: not measured (the counts before it are in "
        f"{folder / OUTPUTS[0]})"
    )


def _data_folder(folder: OwnedFolder, count: int, keep: bool) -> AbstractContextManager[Path]:
    """Where a count's photos and root go: a scratch folder removed once measured, or kept."""
    if keep:
        kept = folder.reserve(f"data-{count}")
        kept.mkdir()
        return nullcontext(kept)
    return scratch(folder)


def _measure_count(
    count: int, folder: Path, cfg: DictConfig, settings: PrepareSettings, console: Console
) -> dict[str, Any]:
    """The four stages at `count` photos in `folder`, a line of progress before and after each."""
    raw, root = folder / "raw", folder / "prepared"
    loader = OmegaConf.to_container(cfg.loader, resolve=True)
    height, width = cfg.image_size
    train = [
        f"dataset.image_size=[{height},{width}]", f"loader.batch_size={cfg.loader.batch_size}",
        *cfg.train,
    ]  # fmt: skip
    runs = {
        "generate": (generate_stage, raw, count, cfg.seed, settings.num_workers),
        "prepare": (prepare_stage, raw, root, settings, manifest(count, cfg.seed)),
        "loader": (
            loader_stage, root, list(cfg.image_size), loader,
            OmegaConf.to_container(cfg.aug, resolve=True),
            OmegaConf.to_container(cfg.normalize, resolve=True),
        ),
        "train": (train_stage, root, count, cfg.seed, folder / "run", train),
    }  # fmt: skip
    row: dict[str, Any] = {"count": count}
    for name, (stage, *args) in runs.items():
        console.print(f"{count} photos: {name} ...")
        result = in_fresh_process(stage, *args)
        items = result.get("images", count)
        row |= {
            f"{name}_s": result["seconds"],
            _RATES[name]: items / result["seconds"] if items else float("nan"),
            f"{name}_peak_mib": result["peak_mib"],
            f"{name}_workers_peak_mib": result["workers_peak_mib"],
        }
        if name == "prepare":
            row["bytes_per_photo"] = _bytes_on_disk(folder) / count
        if name in ("loader", "train"):
            row[f"{name}_images"] = items
        if name == "train":
            row["train_data_wait_frac"] = result["data_wait_frac"]
        console.print(
            f"{count} photos: {name} {result['seconds']:.1f} s, {row[_RATES[name]]:.0f}/s, "
            f"peak {result['peak_mib']:.0f} MiB (largest worker {result['workers_peak_mib']:.0f})"
        )
    return row


def _frame(rows: list[dict[str, Any]], cfg: DictConfig, workers: int) -> pd.DataFrame:
    frame = pd.DataFrame(rows)
    frame["workers"] = workers
    frame["cpus"] = os.cpu_count()
    frame["loader"] = cfg.loader._target_.rsplit(".", 1)[-1]
    frame["loader_batch_size"] = cfg.loader.batch_size
    frame["image_size"] = "x".join(map(str, cfg.image_size))
    return frame


def ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """Each count against the one before: per-photo seconds (1.0: linear cost) and peak memory
    (1.0: flat)."""
    rows = []
    for before, after in itertools.pairwise(frame.itertuples()):
        rows.append(
            {"counts": f"{after.count} / {before.count}"}
            | {f"{s} s/photo": getattr(before, r) / getattr(after, r) for s, r in _RATES.items()}
            | {
                f"{s} peak": getattr(after, f"{s}_peak_mib") / getattr(before, f"{s}_peak_mib")
                for s in STAGES
            }
        )
    return pd.DataFrame(rows)


def _plot(frame: pd.DataFrame, folder: OwnedFolder) -> None:
    """Two panels over the count (log x): rates, and each stage's peak memory (its largest worker
    dashed)."""
    # imported here: the stage processes, which import this module, never load matplotlib
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, memory) = plt.subplots(1, 2, figsize=(11, 4))
    for stage, column in _RATES.items():
        rates.plot(frame["count"], frame[column], marker="o", label=f"{stage} ({column})")
        line = memory.plot(frame["count"], frame[f"{stage}_peak_mib"], marker="o", label=stage)
        memory.plot(
            frame["count"], frame[f"{stage}_workers_peak_mib"], marker="x", linestyle="--",
            color=line[0].get_color(), label=f"{stage}: largest worker",
        )  # fmt: skip
    # log y: the stages' rates differ by orders of magnitude; flat still reads as linear cost
    rates.set(xscale="log", yscale="log", xlabel="photos", ylabel="per second",
              title="rate (flat: linear cost)")  # fmt: skip
    memory.set(xscale="log", xlabel="photos", ylabel="peak RSS (MiB)", title="peak memory")
    memory.set_ylim(bottom=0)
    for ax in (rates, memory):
        ax.legend(fontsize="small")
    first = frame.iloc[0]
    fig.suptitle(
        f"{first['loader']} batch {first['loader_batch_size']}, {first['image_size']}, "
        f"{first['workers']} workers, {first['cpus']} CPUs"
    )
    fig.tight_layout()
    folder.write("bench_scale.png", lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


def _print(frame: pd.DataFrame, console: Console) -> None:
    table = Table(title="bench-scale: rates (per second) and peak memory (MiB) per count")
    shown = {
        "count": "{:d}", "generate_photos_s": "{:.1f}", "prepare_photos_s": "{:.1f}",
        "loader_img_s": "{:.1f}", "train_img_s": "{:.1f}", "generate_peak_mib": "{:.0f}",
        "prepare_peak_mib": "{:.0f}", "prepare_workers_peak_mib": "{:.0f}",
        "loader_peak_mib": "{:.0f}", "train_peak_mib": "{:.0f}", "bytes_per_photo": "{:.0f}",
        "generate_s": "{:.1f}", "prepare_s": "{:.1f}", "loader_s": "{:.1f}", "train_s": "{:.1f}",
    }  # fmt: skip
    for column in shown:
        table.add_column(column, justify="right")
    for row in frame.itertuples():
        table.add_row(*(form.format(getattr(row, column)) for column, form in shown.items()))
    print_table(table, console)
    per_count = ratios(frame)
    if per_count.empty:
        return
    table = Table(title="each count ÷ the one before (1.0: linear cost, flat memory)")
    for column in per_count.columns:
        table.add_column(column, justify="right")
    for row in per_count.itertuples(index=False):
        table.add_row(row[0], *(f"{v:.2f}" for v in row[1:]))
    print_table(table, console)


def run(cfg: DictConfig) -> pd.DataFrame:
    """Measure every count of `cfg.counts`, write the outputs, print the tables.

    Args:
        cfg: a composed conf/bench_scale.yaml.

    Returns:
        One row per count measured.

    Raises:
        SystemExit: in one line, `output_dir` or a file where an output goes is the user's, or
            a count is refused (kept data in its folder, or a disk too small).
    """
    out = Path(cfg.output_dir)
    if not cfg.counts or min(cfg.counts) < 1:
        sys.exit(f"{COMMAND}: counts={list(cfg.counts)}: need one count or more, each >= 1")
    kept = [out / f"data-{n}" for n in cfg.counts if (out / f"data-{n}").exists()]
    if cfg.keep_data and kept:
        sys.exit(f"{COMMAND}: {kept[0]} holds data kept by an earlier run, which would be "
                 "reused, not measured: remove it or choose another output_dir")  # fmt: skip
    folder = claim_output(cfg, OUTPUTS, COMMAND)
    workers = (os.cpu_count() or 1) if cfg.num_workers is None else cfg.num_workers
    settings = replace(PrepareSettings.from_config(compose_prepare()), num_workers=workers)
    console = Console()
    rows: list[dict[str, Any]] = []
    refusal = None
    for count in cfg.counts:
        refusal = disk_refusal(count, rows[-1] if rows else None, shutil.disk_usage(out).free, out)
        if refusal is not None:
            break
        with _data_folder(folder, count, cfg.keep_data) as data:
            rows.append(_measure_count(count, data, cfg, settings, console))
    frame = _frame(rows, cfg, workers)  # the first count is never refused: rows are not empty
    folder.write("bench_scale.csv", frame.to_csv(index=False, float_format="%.4f").encode())
    _plot(frame, folder)
    config = OmegaConf.to_container(cfg, resolve=True)
    folder.write("bench_scale.json", json.dumps({"config": config}, indent=2).encode())
    _print(frame, console)
    console.print(f"written: {out / 'bench_scale.csv'}, bench_scale.png, bench_scale.json")
    if refusal is not None:
        sys.exit(refusal)
    return frame


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_scale")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
