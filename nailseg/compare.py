"""`python -m nailseg compare sweep_dir=multirun/<time>`: a sweep's jobs as one table and a plot.

Each row is read from its job's folder alone: `.hydra/overrides.yaml`, and `metrics.json` shown
only under the overrides it records. The columns: every override that differs between jobs, then
`RESULTS` (docs/SWEEPS.md). compare.md, .csv and .png are written into the sweep folder, held as
nailseg's meanwhile: a sweep still running or a user's folder or file is refused in one line."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import matplotlib
import numpy as np
import pandas as pd
import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from nailseg.config import CONF_DIR
from nailseg.errors import UserError, require_values
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OwnedFolder, read_marker, read_regular
from nailseg.training.run_folder import job_folders, read_failure

matplotlib.use("Agg")
import matplotlib.pyplot as plt

log = logging.getLogger(__name__)
RESULTS = [
    "status", "train_img_s", "data_wait_frac", "world_size", "scaling", "ledger", "metric", "best",
    "final_dice", "evaluated_on", "epochs", "target_s", "target_epoch", "startup_s",
]  # fmt: skip
OUTPUTS = ["compare.md", "compare.csv", "compare.png"]  # written into the sweep folder
# the overrides that set a job's number of processes (the rest must match for a scaling ratio)
SCALING_KEYS = frozenset({"trainer", "trainer.devices", "trainer.num_nodes", "trainer.strategy"})
MAX_BYTES = 1 << 24  # a job's metrics.json or overrides.yaml is a few KB


@dataclass
class CompareConfig:
    sweep_dir: str = MISSING


ConfigStore.instance().store(name="compare_schema", node=CompareConfig)


class CompareError(UserError, ValueError):
    """A folder compare cannot tabulate, named, with what compare expected."""


def _sweep_jobs(folder: Path) -> list[Path]:
    """`folder`'s job folders; a CompareError saying what the folder is where it has none."""
    expected = "expected a sweep's folder (multirun/<time>) whose jobs are its subfolders"
    if not folder.is_dir():
        raise CompareError(f"{folder}: no such folder; {expected}")
    jobs = job_folders(folder)
    if jobs:
        return jobs
    if (folder / ".hydra").is_dir():
        raise CompareError(f"{folder} is a single run's folder, not a sweep; {expected}")
    sweeps = sorted(d.name for d in folder.iterdir() if d.is_dir() and job_folders(d))
    if sweeps:
        shown = ", ".join(sweeps[-5:]) + (f" and {len(sweeps) - 5} more" if len(sweeps) > 5 else "")
        raise CompareError(f"{folder} holds sweeps, not jobs: pass one of them ({shown})")
    raise CompareError(f"{folder}: no job folders (subfolders with .hydra/) in it; {expected}")


def _read(path: Path) -> Any:
    """The YAML (`.yaml`) or JSON at `path`: a plain file only, never a link or FIFO."""
    data = read_regular(path, MAX_BYTES)
    return yaml.safe_load(data) if path.suffix == ".yaml" else json.loads(data)


def _results(job: Path, overrides: list[str]) -> dict:
    """A job's columns from its own metrics.json (one written for other overrides is not)."""
    failure = read_failure(job)
    if failure is not None:
        return {"status": "failed: " + " ".join(failure.split())[:300]}
    try:
        metrics = _read(job / "metrics.json")
    except FileNotFoundError:
        return {"status": "failed: no metrics.json"}
    except (OSError, NotOursError, ValueError, yaml.YAMLError) as err:
        return _unreadable("metrics.json", err)
    if not isinstance(metrics, dict) or metrics.get("overrides") != overrides:
        ran = metrics.get("overrides") if isinstance(metrics, dict) else None
        return {"status": f"failed: no metrics.json of this job (the one there ran {ran})"[:300]}
    try:
        return _metrics(job, metrics)
    except (OSError, NotOursError, ValueError, TypeError, AttributeError, KeyError) as err:
        return _unreadable("metrics.json", err)


def _unreadable(name: str, err: Exception) -> dict:
    text = " ".join(str(err).split())
    return {"status": f"unreadable: {name}: {type(err).__name__}: {text}"[:300]}


def _metrics(job: Path, metrics: dict) -> dict:
    from nailseg.training.ledger import train_rows_once  # Lightning: not for --help

    fit, final = metrics.get("fit", {}), metrics.get("final", {}).get("metrics", {})
    reached = metrics.get("time_to_target") or {}
    speed = metrics.get("throughput") or {  # runs before the per-epoch summary: the last epoch
        "images_per_s": fit.get("train/images_per_s"),
        "data_wait_frac": fit.get("train/data_wait_frac"),
    }
    return {
        "status": "ok",
        "train_img_s": speed["images_per_s"],
        "data_wait_frac": speed["data_wait_frac"],
        "world_size": metrics.get("world_size"),
        "ledger": train_rows_once(job / "ledger"),
        "metric": (metrics.get("best") or {}).get("metric"),
        "best": (metrics.get("best") or {}).get("value"),
        "final_dice": next((v for k, v in final.items() if k.endswith("/dice")), None),
        "evaluated_on": metrics.get("evaluated_on"),
        "epochs": metrics.get("epochs"),
        "target_s": reached.get("seconds"),
        "target_epoch": reached.get("epoch"),
        "startup_s": reached.get("startup_s"),
    }


def _job(job: Path) -> tuple[dict[str, str], dict]:
    """A job's overrides (key → value) and results, both read from its own folder."""
    try:
        entries = _read(job / ".hydra" / "overrides.yaml")
        if not isinstance(entries, list):
            raise ValueError(f"a list of overrides expected, not {type(entries).__name__}")
    except (OSError, NotOursError, ValueError, yaml.YAMLError) as err:
        return {}, {"job": job.name, **_unreadable(".hydra/overrides.yaml", err)}
    overrides = [str(entry) for entry in entries]
    pairs = dict(entry.split("=", 1) for entry in overrides if "=" in entry)
    return pairs, {"job": job.name, **_results(job, overrides)}


def _optuna_best(sweep_dir: Path) -> str:
    """The line naming an Optuna sweep's best trial, from its `optimization_results.yaml`."""
    try:
        found = _read(sweep_dir / "optimization_results.yaml")
        params = ", ".join(f"{k}={_cell(v)}" for k, v in found["best_params"].items())
        return f"Optuna's best: {params} ({_cell(found['best_value'])})"
    except (OSError, NotOursError, ValueError, yaml.YAMLError, TypeError, KeyError, AttributeError):
        return ""


def summarise(sweep_dir: Path) -> pd.DataFrame:
    """The table of a sweep's jobs, also written as compare.md, compare.csv and compare.png;
    CompareError (not a sweep) or NotOursError (a sweep still running, a user's folder or
    file) before anything is written."""
    sweep_dir = Path(sweep_dir)
    jobs = _sweep_jobs(sweep_dir)
    with OwnedFolder.claim(sweep_dir, "sweep", key="sweep_dir") as folder:
        folder.check_free(OUTPUTS)
        read = [_job(job) for job in jobs]
        overrides = [o for o, _ in read]
        keys = list(dict.fromkeys(k for o in overrides for k in o))
        varied = [k for k in keys if len({o.get(k) for o in overrides}) > 1] or keys
        found = [{**r, **{k: o.get(k) for k in varied}} for o, r in read]
        rows = pd.DataFrame(found, columns=["job", *varied, *RESULTS])
        rows = rows.astype({"epochs": "Int64", "target_epoch": "Int64", "world_size": "Int64"})
        rows["scaling"] = _scaling(rows, overrides)
        folder.write("compare.md", table(rows, sweep_dir).encode())
        folder.write("compare.csv", rows.to_csv(index=False, lineterminator="\n").encode())
        if (rows["status"] == "ok").any():
            _plot(rows[rows["status"] == "ok"], varied, folder)
    return rows


def _scaling(rows: pd.DataFrame, overrides: list[dict[str, str]]) -> list[float | None]:
    """Each multi-process job's images/s ÷ (its processes × the images/s of the one-process job
    of the same overrides but the `trainer` keys that set the processes): 1.0 is perfect."""
    same = [{k: v for k, v in o.items() if k not in SCALING_KEYS} for o in overrides]
    speeds = [float(v) if pd.notna(v) else None for v in rows["train_img_s"]]
    worlds = [int(v) if pd.notna(v) else None for v in rows["world_size"]]
    single = [i for i, world in enumerate(worlds) if world == 1 and speeds[i] is not None]
    scaling: list[float | None] = []
    for i, (speed, world) in enumerate(zip(speeds, worlds, strict=True)):
        base = [speeds[j] for j in single if same[j] == same[i]]
        many = speed is not None and world is not None and world > 1
        scaling.append(speed / (world * base[0]) if many and base else None)
    return scaling


NUMBER = re.compile(r"-?(\d+\.\d*|\.\d+)(e[-+]?\d+)?|-?\d+e[-+]?\d+", re.IGNORECASE)


def _cell(value) -> str:
    """Floats, also in an override (`optimizer.lr=0.00467...`), to 4 significant digits."""
    if value is None or pd.isna(value):
        return ""
    if isinstance(value, str) and NUMBER.fullmatch(value):
        value = float(value)
    if isinstance(value, float):
        text = f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    else:
        text = str(value)
    return text.replace("|", "\\|")


def _shown(rows: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """`rows` without the columns that are empty or (over two rows) the same in every row, and a
    line naming the values of the latter."""
    empty = [c for c in rows.columns if c != "job" and rows[c].map(_cell).eq("").all()]
    same = [
        c
        for c in rows.columns
        if c not in ("job", *empty) and len(rows) > 1 and rows[c].map(_cell).nunique() == 1
    ]
    note = ", ".join(f"{c}={_cell(rows[c].iloc[0])}" for c in same)
    return rows.drop(columns=empty + same), f"same in every row: {note}" if same else ""


def table(rows: pd.DataFrame, sweep_dir: Path) -> str:
    """compare.md, as printed: what differs, a line naming what does not, Optuna's best trial."""
    shown, note = _shown(rows)
    notes = [line for line in (note, _optuna_best(sweep_dir)) if line]
    return _markdown(shown) + "".join(f"\n{line}\n" for line in notes)


def _markdown(rows: pd.DataFrame) -> str:
    lines = [f"| {' | '.join(rows.columns)} |", "|" + "---|" * len(rows.columns)]
    lines += [f"| {' | '.join(_cell(v) for v in row)} |" for row in rows.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def _plot(rows: pd.DataFrame, varied: list[str], folder: OwnedFolder) -> None:
    """Throughput, and each job's best optimized metric beside its final Dice, titled with both
    names; the legend above the bars (the axis leaves it room)."""
    labels = ["\n".join(f"{k}={row[k]}" for k in varied) for _, row in rows.iterrows()]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(6, 1.2 * len(rows)) * 2, 4.5))
    left.bar(labels, rows["train_img_s"].astype(float))
    left.set_title("training images/s (median epoch)")
    at, width = np.arange(len(rows)), 0.4
    metric = "/".join(sorted({str(m) for m in rows["metric"].dropna()})) or "optimized metric"
    splits = "/".join(sorted({str(s) for s in rows["evaluated_on"].dropna()})) or "final"
    best, final = rows["best"].astype(float), rows["final_dice"].astype(float)
    right.bar(at - width / 2, best, width, label=f"best {metric}")
    right.bar(at + width / 2, final, width, label=f"final evaluation Dice ({splits})")
    right.set_xticks(at, labels)
    right.set_title(f"best {metric} and final Dice ({splits}) per job")
    right.set_ylim(0, 1.35 * max(np.nanmax([*best, *final, 0.0]), 1e-9))
    right.legend(loc="upper center", ncol=2, fontsize=8)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    folder.write("compare.png", lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="compare")
def _app(cfg: DictConfig) -> None:
    require_values(cfg, "nailseg compare")
    try:
        report(Path(cfg.sweep_dir))
    except UserError as err:  # not a sweep, a sweep still running, a user's folder or file
        sys.exit(f"nailseg compare: {err}")


def report(sweep_dir: Path) -> None:
    """`summarise`, printed: the table, a line per unreadable job (stderr), where it was written."""
    rows = summarise(sweep_dir)
    for _, row in rows[rows["status"].str.startswith("unreadable")].iterrows():
        print(f"nailseg compare: {sweep_dir / row['job']}: {row['status']}", file=sys.stderr)
    print(table(rows, sweep_dir))
    print(f"written: {sweep_dir / 'compare.md'}, compare.csv, compare.png")


def sweep_end(sweep_dir: Path) -> None:
    """A finished sweep's folder and its jobs compared; exits 1 naming the failed jobs this
    `-m` command ran (their markers' `session` is the sweep folder's)."""
    log.info("sweep folder: %s; its jobs compared (python -m nailseg compare):", sweep_dir)
    try:
        report(sweep_dir)
    except UserError as err:
        log.warning("no comparison: %s", err)
    session = (read_marker(sweep_dir) or {}).get("session")
    jobs = [j for j in job_folders(sweep_dir) if (read_marker(j) or {}).get("session") == session]
    failed = [(job, error) for job in jobs if (error := read_failure(job)) is not None]
    if failed:
        listed = "; ".join(f"{job} ({error})" for job, error in failed)
        sys.exit(
            f"{os.path.basename(sys.argv[0])}: {len(failed)} of {len(jobs)} jobs failed: "
            f"{listed}. python -m nailseg compare sweep_dir={sweep_dir} tabulates the sweep"
        )


def main() -> None:
    """The Hydra app; a bare folder argument is taken as `sweep_dir=<folder>`."""
    bare = [arg for arg in sys.argv[1:] if "=" not in arg and not arg.startswith("-")]
    sys.argv[1:] = [f"sweep_dir={arg}" if arg in bare else arg for arg in sys.argv[1:]]
    _app()
