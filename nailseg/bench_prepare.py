"""Benchmark of `prepare` (cold and rerun) and of the synthetic generator; not a timed test.

    python -m nailseg.bench_prepare input_dir=../shared/data/nails output_dir=outputs/bench/prepare

Each figure is the median of `repeats` runs; the cold run starts from an empty output folder
(the input files sit in the page cache after the first read, as they would on a second epoch).
Writes `<output_dir>/bench_prepare.csv` and prints a table.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path

import hydra
import pandas as pd
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from nailseg.data.prepare import prepare
from nailseg.data.synthetic import generate


def _median_seconds(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_prepare")
def main(cfg: DictConfig) -> None:
    input_dir, out = Path(cfg.input_dir), Path(cfg.output_dir)
    data = out / "prepared"
    workers = cfg.num_workers or os.cpu_count() or 1

    def cold_start() -> None:
        shutil.rmtree(data, ignore_errors=True)

    def run_prepare() -> None:
        prepare(input_dir, data, num_workers=workers, group_regex=cfg.group_regex)

    n_pairs = prepare(input_dir, data, num_workers=workers, group_regex=cfg.group_regex).written
    cold = _median_seconds(run_prepare, cfg.repeats, before=cold_start)
    rerun = _median_seconds(run_prepare, cfg.repeats)

    synth = out / "synthetic"
    n_synth = cfg.synthetic_n

    def generate_fresh() -> None:
        generate(synth, n=n_synth, seed=0, num_workers=workers)

    synthetic = _median_seconds(
        generate_fresh, cfg.repeats, before=lambda: shutil.rmtree(synth, ignore_errors=True)
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
    out.mkdir(parents=True, exist_ok=True)
    rows.to_csv(out / "bench_prepare.csv", index=False, float_format="%.4f")

    table = Table(
        title=f"prepare benchmark ({input_dir}, {workers} workers, median of {cfg.repeats})"
    )
    for column in ("step", "images", "seconds", "images/s"):
        table.add_column(column, justify="right")
    for row in rows.itertuples():
        table.add_row(row.step, str(row.images), f"{row.seconds:.3f}", f"{row.images_per_s:.0f}")
    console = Console()
    console.print(table)
    console.print(f"rerun / cold time: {rerun / cold:.3f}  (target <= 0.10)")
    console.print(f"written: {out / 'bench_prepare.csv'}")


if __name__ == "__main__":
    main()
