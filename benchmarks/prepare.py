"""Benchmark of `prepare` (cold and rerun) and of the synthetic generator; not a timed test.

    make bench-prepare    (python -m benchmarks.prepare input_dir=PHOTOS output_dir=DIR)

Each figure is the median of `repeats` runs; a cold run writes into an empty scratch folder
(`scratch`: removed after it; the input files sit in the page cache after the first read, as they
would on a second epoch), a rerun into `<output_dir>/prepared`. Writes `bench_prepare.csv` and
`bench_prepare.json` (the config) into `output_dir`, a folder of its own (an `OwnedFolder` of kind
`bench`), and prints a table. An `output_dir` overlapping `input_dir`, or not the benchmark's, is
refused in one line before anything is written.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import hydra
import pandas as pd
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from benchmarks.output import claim_output, scratch
from nailseg.config import CONF_DIR
from nailseg.io.folder import OwnedFolder
from nailseg.prep.prepare import PrepareSettings, compose_prepare, prepare
from nailseg.synth.scene import generate
from nailseg.tables import print_table

COMMAND = "benchmarks.prepare"
OUTPUTS = ["bench_prepare.csv", "bench_prepare.json"]


def seconds(fn: Callable[[], object]) -> float:
    """How long `fn()` takes, wall clock."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cold_seconds(fn: Callable[[Path], object], folder: OwnedFolder, repeats: int) -> float:
    """Median time of `fn(path)` with a path that does not exist yet."""
    times = []
    for _ in range(repeats):
        with scratch(folder) as fresh:
            times.append(seconds(lambda: fn(fresh / "out")))
    return statistics.median(times)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_prepare")
def main(cfg: DictConfig) -> None:
    input_dir, out = Path(cfg.input_dir), Path(cfg.output_dir)
    folder = claim_output(cfg, OUTPUTS, COMMAND)
    workers = cfg.num_workers or os.cpu_count() or 1

    defaults = PrepareSettings.from_config(compose_prepare())  # conf/prepare.yaml's
    split = replace(defaults.split, group_regex=cfg.group_regex)
    settings = replace(defaults, num_workers=workers, split=split)

    def run_prepare(root: Path):
        return prepare(input_dir, root, settings)

    first = run_prepare(out / "prepared")
    n_pairs = first.written + first.up_to_date
    cold = _cold_seconds(run_prepare, folder, cfg.repeats)
    rerun = statistics.median(
        seconds(lambda: run_prepare(out / "prepared")) for _ in range(cfg.repeats)
    )
    n_synth = cfg.synthetic_n
    synthetic = _cold_seconds(
        lambda path: generate(path, n=n_synth, seed=0, num_workers=workers), folder, cfg.repeats
    )

    rows = pd.DataFrame(
        [
            ("prepare cold", n_pairs, cold, n_pairs / cold),
            ("prepare rerun", n_pairs, rerun, n_pairs / rerun),
            ("synthetic generate", n_synth, synthetic, n_synth / synthetic),
        ],
        columns=["step", "images", "seconds", "images_per_s"],
    )
    rows["workers"] = workers
    rows["cpus"] = os.cpu_count()
    folder.write("bench_prepare.csv", rows.to_csv(index=False, float_format="%.4f").encode())
    config = OmegaConf.to_container(cfg, resolve=True)
    folder.write("bench_prepare.json", json.dumps({"config": config}, indent=2).encode())

    table = Table(
        title=f"prepare benchmark ({input_dir}, {workers} workers, median of {cfg.repeats})"
    )
    for column in ("step", "images", "seconds", "images/s"):
        table.add_column(column, justify="right")
    for row in rows.itertuples():
        table.add_row(row.step, str(row.images), f"{row.seconds:.3f}", f"{row.images_per_s:.0f}")
    console = Console()
    print_table(table, console)
    console.print(f"rerun / cold time: {rerun / cold:.3f}  (target <= 0.10)")
    console.print(f"written: {out / 'bench_prepare.csv'}, bench_prepare.json")


if __name__ == "__main__":
    main()
