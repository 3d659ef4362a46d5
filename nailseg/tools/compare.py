"""Summarise a training sweep: one row per job, what the sweep varied, throughput and quality.

    python -m nailseg.compare sweep_dir=multirun/<timestamp>      (or just the folder)

The columns come from the jobs' own overrides (`<job>/.hydra/overrides.yaml`): every key whose
value differs between jobs, so a loader comparison shows `loader` and `aug`, an Optuna study
`optimizer.lr`, `model.encoder_name`, `module.loss`. Each job's `metrics.json` gives the rest (a
job without one, or with `failed.json`, is reported as failed, with its error). Writes
`compare.md` (a markdown table), `compare.csv` and `compare.png` (throughput; the best score and
the final evaluation's Dice per job) into the sweep folder. `train_img_s` / `data_wait_frac`: the
medians over the epochs after the first two (`metrics.json` `throughput`; the last epoch's value
for runs written before it). `world_size`: the job's processes; `scaling`: a multi-GPU job's
images/s ÷ (its GPUs × the one-GPU job's of the same setting); `ledger`: with `callbacks=audit`,
whether every training row was seen once per epoch across ranks. `target_s` / `target_epoch` /
`startup_s`: when validation first reached `callbacks.time_to_target.target`, in seconds since the
job started (its process's start for a process's first job; empty where it never did).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
import matplotlib
import numpy as np
import pandas as pd
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from nailseg.config import CONF_DIR, require_values
from nailseg.io.atomic import save_figure, write_text
from nailseg.training.failure import job_folders, read_failure
from nailseg.training.ledger import train_rows_once

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
SCALING_KEYS = frozenset({"trainer", "trainer.devices", "trainer.num_nodes", "trainer.strategy"})


@dataclass
class CompareConfig:
    sweep_dir: str = MISSING


ConfigStore.instance().store(name="compare_schema", node=CompareConfig)


def _overrides(job: Path) -> dict[str, str]:
    """The job's own command-line overrides, as key → value."""
    entries = OmegaConf.load(job / ".hydra" / "overrides.yaml")
    return dict(str(entry).split("=", 1) for entry in entries if "=" in str(entry))


def _results(job: Path) -> dict:
    failure, metrics_file = read_failure(job), job / "metrics.json"
    if failure is not None or not metrics_file.is_file():
        reason = failure if failure is not None else "no metrics.json"
        return {"status": "failed: " + " ".join(reason.split())[:300]}
    metrics = json.loads(metrics_file.read_text())
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


def summarise(sweep_dir: Path) -> pd.DataFrame:
    """The table of a sweep's jobs; also written as compare.md, compare.csv and compare.png."""
    jobs = job_folders(Path(sweep_dir))
    if not jobs:
        raise FileNotFoundError(f"{sweep_dir}: no job folders (with .hydra/) found")
    overrides = [_overrides(job) for job in jobs]
    keys = list(dict.fromkeys(k for o in overrides for k in o))
    varied = [k for k in keys if len({o.get(k) for o in overrides}) > 1] or keys
    rows = pd.DataFrame(
        [
            {"job": job.name, **{k: o.get(k) for k in varied}, **_results(job)}
            for job, o in zip(jobs, overrides, strict=True)
        ],
        columns=["job", *varied, *RESULTS],
    ).astype({"epochs": "Int64", "target_epoch": "Int64", "world_size": "Int64"})
    rows["scaling"] = _scaling(rows, overrides)
    write_text(sweep_dir / "compare.md", _markdown(rows))
    write_text(sweep_dir / "compare.csv", rows.to_csv(index=False, lineterminator="\n"))
    ok = rows[rows["status"] == "ok"]
    if not ok.empty:
        _plot(ok, varied, sweep_dir / "compare.png")
    return rows


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


def _cell(value) -> str:
    if value is None or pd.isna(value):
        return ""
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|")


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
    require_values(cfg, "nailseg.compare")
    sweep_dir = Path(cfg.sweep_dir)
    rows = summarise(sweep_dir)
    print(_markdown(rows))
    print(f"written: {sweep_dir / 'compare.md'}, compare.csv, compare.png")


def main() -> None:
    """The Hydra app; a bare folder argument is taken as `sweep_dir=<folder>`."""
    sys.argv[1:] = [
        f"sweep_dir={arg}" if "=" not in arg and not arg.startswith("-") else arg
        for arg in sys.argv[1:]
    ]
    _app()
