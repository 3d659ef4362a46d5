"""Summarise a training sweep: one row per job, what the sweep varied, throughput and quality.

    python -m nailseg compare sweep_dir=multirun/<timestamp>      (or just the folder)

The columns come from the jobs' own overrides (`<job>/.hydra/overrides.yaml`): every key whose
value differs between jobs, so a loader comparison shows `loader` and `aug`, an Optuna study
`optimizer.lr`, `model.encoder_name`, `module.loss`. Each job's `metrics.json` gives the rest (a
job without one, or whose marker keeps an error, is reported as failed, with it). Writes
`compare.md` (a markdown table), `compare.csv` and `compare.png` (throughput; the best score and
the final evaluation's Dice per job) into the sweep folder. `train_img_s` / `data_wait_frac`: the
medians over the epochs after the first two (`metrics.json` `throughput`; the last epoch's value
for runs written before it). `world_size`: the job's processes; `scaling`: a multi-GPU job's
images/s ÷ (its GPUs × the one-GPU job's of the same setting); `ledger`: with `callbacks=audit`,
whether every training row was seen once per epoch across ranks. `target_s` / `target_epoch` /
`startup_s`: when validation first reached `callbacks.time_to_target.target`, in seconds since the
job started (its process's start for a process's first job; empty where it never did).

An Optuna study kept in a storage (`hydra.sweeper.storage`) is shown whole: the jobs of every
sweep folder beside this one that ran trials of the same study (its reruns), with `sweep` and
`trial` columns, and a row for each trial of the study whose job folder is not there. The printed
table and compare.md leave out the columns that are empty or the same in every job (one line
names the values they had) and show numbers to 4 significant digits; compare.csv keeps every
column and value. A job folder that cannot be read (a broken metrics.json) is named in one line
and listed as unreadable; a folder that is not a sweep is refused in one line.
"""

from __future__ import annotations

import json
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
from omegaconf import MISSING, DictConfig, OmegaConf

from nailseg.config import CONF_DIR, require_values
from nailseg.errors import UserError
from nailseg.io.atomic import NotOursError, save_figure, write_text
from nailseg.io.ownership import claim_files, record_files
from nailseg.training.run_folder import job_folders, read_failure

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = [
    "status",
    "train_img_s",
    "data_wait_frac",
    "world_size",
    "scaling",
    "ledger",
    "best",
    "final_dice",
    "evaluated_on",
    "epochs",
    "target_s",
    "target_epoch",
    "startup_s",
]


# the overrides that set a job's number of processes (the rest must match for a scaling ratio)
OUTPUTS = ["compare.md", "compare.csv", "compare.png"]  # written into the sweep folder
LEDGER = ".compare.json"  # compare's record of them there
SCALING_KEYS = frozenset({"trainer", "trainer.devices", "trainer.num_nodes", "trainer.strategy"})


@dataclass
class CompareConfig:
    sweep_dir: str = MISSING


ConfigStore.instance().store(name="compare_schema", node=CompareConfig)


class CompareError(UserError, ValueError):
    """A folder compare cannot tabulate; the message names it and what compare expected."""


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


def _overrides(job: Path) -> dict[str, str]:
    """The job's own command-line overrides, as key → value."""
    entries = OmegaConf.load(job / ".hydra" / "overrides.yaml")
    return dict(str(entry).split("=", 1) for entry in entries if "=" in str(entry))


@dataclass(frozen=True)
class Study:
    """An Optuna study kept in a storage, as a job's `.hydra/hydra.yaml` names it."""

    storage: str  # its URL; a relative SQLite path made absolute from the job's working folder
    name: str
    params: tuple[str, ...]  # the keys the sweeper sets


def _study(job: Path) -> Study | None:
    """The stored Optuna study `job` was a trial of; None for other sweeps and unstored studies."""
    try:
        hydra_cfg = OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra
        sweeper = OmegaConf.to_container(hydra_cfg.sweeper, resolve=False)
        cwd = Path(str(hydra_cfg.runtime.cwd))
    except (OSError, ValueError, yaml.YAMLError, AttributeError):  # none, or not Hydra's
        return None
    storage = sweeper.get("storage")
    if "optuna" not in str(sweeper.get("_target_", "")) or not isinstance(storage, str):
        return None
    path = storage.removeprefix("sqlite:///")
    if storage.startswith("sqlite:///") and not path.startswith("/"):
        storage = f"sqlite:///{cwd / path}"
    return Study(storage, str(sweeper.get("study_name")), tuple(sweeper.get("params") or ()))


def _study_jobs(sweep_dir: Path, jobs: list[Path], study: Study) -> list[Path]:
    """The jobs of every sweep folder beside `sweep_dir` (itself included) that ran trials of
    `study`: its reruns, each in a folder of its own."""
    found = []
    for folder in sorted(d for d in sweep_dir.parent.iterdir() if d.is_dir()):
        theirs = jobs if folder == sweep_dir else job_folders(folder)
        if theirs and (folder == sweep_dir or _study(theirs[0]) == study):
            found += theirs
    return found


def _trials(study: Study) -> list | None:
    """The study's trials from its storage; None where it cannot be read (a SQLite file is
    never created by reading it)."""
    import optuna  # only for a stored study
    from sqlalchemy.exc import SQLAlchemyError

    path = Path(study.storage.removeprefix("sqlite:///"))
    if study.storage.startswith("sqlite:///") and not path.is_file():
        return None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        return optuna.load_study(study_name=study.name, storage=study.storage).trials
    except (KeyError, SQLAlchemyError):  # no such study, or a database it cannot read
        return None


def _results(job: Path) -> dict:
    failure, metrics_file = read_failure(job), job / "metrics.json"
    if failure is not None or not metrics_file.is_file():
        reason = failure if failure is not None else "no metrics.json"
        return {"status": "failed: " + " ".join(reason.split())[:300]}
    try:
        return _metrics(job, json.loads(metrics_file.read_text()))
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as err:
        return _unreadable("metrics.json", err)


def _unreadable(name: str, err: Exception) -> dict:
    """The row of a job whose file `name` could not be read, its error on one line."""
    return {
        "status": f"unreadable: {name}: {type(err).__name__}: {' '.join(str(err).split())}"[:300]
    }


def _metrics(job: Path, metrics: dict) -> dict:
    """A job's columns from its `metrics.json`."""
    # here: the ledger's module loads Lightning, which --help and a refusal need not wait for
    from nailseg.training.ledger import train_rows_once

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
        "best": (metrics.get("best") or {}).get("value"),
        "final_dice": next((v for k, v in final.items() if k.endswith("/dice")), None),
        "evaluated_on": metrics.get("evaluated_on"),
        "epochs": metrics.get("epochs"),
        # when validation first reached callbacks.time_to_target.target (empty: never)
        "target_s": reached.get("seconds"),
        "target_epoch": reached.get("epoch"),
        "startup_s": reached.get("startup_s"),
    }


def _job(job: Path) -> tuple[dict[str, str], dict]:
    """A job's overrides and results."""
    try:
        return _overrides(job), _results(job)
    except (OSError, ValueError, yaml.YAMLError) as err:  # its .hydra/overrides.yaml
        return {}, _unreadable(".hydra/overrides.yaml", err)


def summarise(sweep_dir: Path) -> pd.DataFrame:
    """The table of a sweep's jobs (of a stored Optuna study: of all its trials); also written
    as compare.md, compare.csv and compare.png."""
    sweep_dir = Path(sweep_dir)
    jobs = _sweep_jobs(sweep_dir)
    study = _study(jobs[0])
    if study is not None:
        jobs = _study_jobs(sweep_dir, jobs, study)
    read = [_job(job) for job in jobs]
    overrides = [o for o, _ in read]
    labels: list[dict[str, Any]] = [{"job": job.name} for job in jobs]
    results = [r for _, r in read]
    if len({job.parent for job in jobs}) > 1:
        labels = [
            {"sweep": job.parent.name} | label for job, label in zip(jobs, labels, strict=True)
        ]
    keys = list(dict.fromkeys(k for o in overrides for k in o))
    varied = [k for k in keys if len({o.get(k) for o in overrides}) > 1] or keys
    trials = _trials(study) if study is not None else None
    if trials is not None:
        _number_trials(trials, study, overrides, labels, results)
    order = sorted(range(len(labels)), key=lambda i: labels[i].get("trial", len(labels)))
    named = list(dict.fromkeys(k for label in labels for k in label))
    rows = pd.DataFrame(
        [{**labels[i], **{k: overrides[i].get(k) for k in varied}, **results[i]} for i in order],
        columns=[*named, *varied, *RESULTS],
    ).astype({"epochs": "Int64", "target_epoch": "Int64", "world_size": "Int64"})
    if "trial" in rows:
        rows = rows.astype({"trial": "Int64"})
    rows["scaling"] = _scaling(rows, [overrides[i] for i in order])
    shown, note = _shown(rows)
    try:  # a compare.* its ledger does not record as compare's is the user's
        claim_files(sweep_dir, LEDGER, "compare", OUTPUTS)
    except NotOursError as err:
        raise CompareError(str(err)) from None
    write_text(sweep_dir / "compare.md", _markdown(shown) + (f"\n{note}\n" if note else ""))
    write_text(sweep_dir / "compare.csv", rows.to_csv(index=False, lineterminator="\n"))
    ok = rows[rows["status"] == "ok"]
    if not ok.empty:
        _plot(ok, varied, sweep_dir / "compare.png")
    record_files(sweep_dir, LEDGER, "compare", OUTPUTS)
    return rows


def _number_trials(
    trials: list, study: Study, overrides: list[dict[str, str]], labels: list[dict], results: list
) -> None:
    """Give each job the number of the study's trial whose parameters it ran (the sweeper's
    overrides are `key=str(value)`), and add a row for each trial no job folder here ran."""
    unmatched = list(trials)
    for override, label in zip(overrides, labels, strict=True):
        ran = {k: override.get(k) for k in study.params}
        trial = next(
            (t for t in unmatched if {k: str(v) for k, v in t.params.items()} == ran), None
        )
        if trial is not None:
            unmatched.remove(trial)
            label["trial"] = trial.number
    for trial in unmatched:
        overrides.append({k: str(v) for k, v in trial.params.items()})
        labels.append({"trial": trial.number})
        status = f"no job folder here (trial {trial.state.name.lower()})"
        results.append({"status": status, "best": trial.value})


def _scaling(rows: pd.DataFrame, overrides: list[dict[str, str]]) -> list[float | None]:
    """Each multi-process job's images/s ÷ (its processes × the images/s of the one-process job
    whose overrides are the same but for the `trainer` keys that set the processes): 1.0 is
    perfect scaling. Empty for one-process jobs and where no such job ran."""
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
    """A value as the table shows it: floats, also in an override (`optimizer.lr=0.00467395...`),
    to 4 significant digits (whole numbers from 10,000 on)."""
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
    """`rows` without the columns that are empty, or (over two rows or more) the same in every
    row, and a line naming the values of the latter."""
    empty = [c for c in rows.columns if c != "job" and rows[c].map(_cell).eq("").all()]
    same = [
        c
        for c in rows.columns
        if c not in ("job", *empty) and len(rows) > 1 and rows[c].map(_cell).nunique() == 1
    ]
    note = ", ".join(f"{c}={_cell(rows[c].iloc[0])}" for c in same)
    return rows.drop(columns=empty + same), f"same in every row: {note}" if same else ""


def _markdown(rows: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(rows.columns) + " |", "|" + "---|" * len(rows.columns)]
    lines += [
        "| " + " | ".join(_cell(v) for v in row) + " |" for row in rows.itertuples(index=False)
    ]
    return "\n".join(lines) + "\n"


def _plot(rows: pd.DataFrame, varied: list[str], path: Path) -> None:
    labels = ["\n".join(f"{k}={row[k]}" for k in varied) for _, row in rows.iterrows()]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(6, 1.2 * len(rows)) * 2, 4.5))
    left.bar(labels, rows["train_img_s"].astype(float))
    left.set_ylabel("training images/s (median epoch)")
    at, width = np.arange(len(rows)), 0.4
    right.bar(at - width / 2, rows["best"].astype(float), width, label="best (optimized metric)")
    final = rows["final_dice"].astype(float)
    splits = "/".join(sorted({str(s) for s in rows["evaluated_on"].dropna()})) or "final"
    right.bar(at + width / 2, final, width, label=f"final evaluation Dice ({splits})")
    right.set_xticks(at, labels)
    right.set_ylabel("score")
    right.legend(loc="lower right", fontsize=8)
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    save_figure(path, fig)
    plt.close(fig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="compare")
def _app(cfg: DictConfig) -> None:
    require_values(cfg, "nailseg compare")
    sweep_dir = Path(cfg.sweep_dir)
    try:
        rows = summarise(sweep_dir)
    except UserError as err:
        sys.exit(f"nailseg compare: {err}")
    for _, row in rows[rows["status"].str.startswith("unreadable")].iterrows():
        folder = sweep_dir.parent / row["sweep"] if "sweep" in row else sweep_dir
        print(f"nailseg compare: {folder / row['job']}: {row['status']}", file=sys.stderr)
    shown, note = _shown(rows)
    print(_markdown(shown))
    if note:
        print(note)
    print(f"written: {sweep_dir / 'compare.md'}, compare.csv, compare.png")


def main() -> None:
    """The Hydra app; a bare folder argument is taken as `sweep_dir=<folder>`."""
    sys.argv[1:] = [
        f"sweep_dir={arg}" if "=" not in arg and not arg.startswith("-") else arg
        for arg in sys.argv[1:]
    ]
    _app()
