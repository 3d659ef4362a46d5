"""Benchmark of `prepare` (cold and rerun) and of the synthetic generator; not a timed test.

    python -m nailseg bench-prepare input_dir=../shared/data/nails output_dir=outputs/bench/prepare

Each figure is the median of `repeats` runs; a cold run writes into a new folder (made for it
and removed after it, so the benchmark never deletes anything it did not make; the input files sit
in the page cache after the first read, as they would on a second epoch), a rerun into
`<output_dir>/prepared`. Writes `<output_dir>/bench_prepare.csv` and `bench_prepare.json` (the
config) and prints a table; `output_dir` is a folder of its own (`nailseg.tools.output`).
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

from nailseg.config import CONF_DIR
from nailseg.io.atomic import write_text
from nailseg.io.ownership import scratch_folder
from nailseg.prep.prepare import prepare
from nailseg.prep.settings import PrepareSettings, compose_prepare
from nailseg.prep.synthetic import generate
from nailseg.tables import print_table
from nailseg.tools.output import claim_output, record_outputs, refused_in_one_line

OUTPUTS = ["bench_prepare.csv", "bench_prepare.json"]


def seconds(fn: Callable[[], object]) -> float:
    """How long `fn()` takes, wall clock."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cold_seconds(fn: Callable[[Path], object], scratch: Path, repeats: int) -> float:
    """Median time of `fn(folder)` with a folder that does not exist yet."""
    times = []
    for _ in range(repeats):
        with scratch_folder(scratch) as fresh:
            times.append(seconds(lambda: fn(fresh / "out")))
    return statistics.median(times)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_prepare")
def main(cfg: DictConfig) -> None:
    input_dir, out = Path(cfg.input_dir), Path(cfg.output_dir)
    with refused_in_one_line("nailseg bench-prepare"):
        claim_output(out, OUTPUTS)
    workers = cfg.num_workers or os.cpu_count() or 1

    defaults = PrepareSettings.from_config(compose_prepare())  # conf/prepare.yaml's
    split = replace(defaults.split, group_regex=cfg.group_regex)
    settings = replace(defaults, num_workers=workers, split=split)

    def run_prepare(root: Path):
        return prepare(input_dir, root, settings)

    first = run_prepare(out / "prepared")
    n_pairs = first.written + first.up_to_date
    cold = _cold_seconds(run_prepare, out, cfg.repeats)
    rerun = statistics.median(
        seconds(lambda: run_prepare(out / "prepared")) for _ in range(cfg.repeats)
    )
    n_synth = cfg.synthetic_n
    synthetic = _cold_seconds(
        lambda folder: generate(folder, n=n_synth, seed=0, num_workers=workers), out, cfg.repeats
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
    write_text(out / "bench_prepare.csv", rows.to_csv(index=False, float_format="%.4f"))
    config = OmegaConf.to_container(cfg, resolve=True)
    write_text(out / "bench_prepare.json", json.dumps({"config": config}, indent=2))
    record_outputs(out, OUTPUTS)

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
