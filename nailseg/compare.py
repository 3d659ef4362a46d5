"""Summarise a training sweep: one row per job, throughput and quality per loader × aug.

    python -m nailseg.compare multirun/<timestamp>

Reads each job folder's `metrics.json` (a job without one, or with `failed.json`, is reported as
failed) and writes `compare.md` (a markdown table) and `compare.png` (throughput and val Dice per
job) into the sweep folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
from omegaconf import OmegaConf

from nailseg.atomic import save_figure, write_text

KEYS = ("loader", "aug", "model", "dataset")
COLUMNS = [
    "job",
    *KEYS,
    "status",
    "train_img_s",
    "data_wait_frac",
    "best_val_dice",
    "test_dice",
    "epochs",
]


def _choices(job: Path) -> dict[str, str | None]:
    """The config group options the job ran with, from Hydra's record of it."""
    choices = OmegaConf.load(job / ".hydra" / "hydra.yaml").hydra.runtime.choices
    return {key: choices.get(key) for key in KEYS}


def _job_row(job: Path) -> dict:
    row = {"job": job.name, **_choices(job)}
    failed = job / "failed.json"
    metrics_file = job / "metrics.json"
    if failed.is_file() or not metrics_file.is_file():
        reason = json.loads(failed.read_text())["error"] if failed.is_file() else "no metrics.json"
        return {**row, "status": "failed: " + " ".join(reason.split())[:300]}
    metrics = json.loads(metrics_file.read_text())
    fit, test = metrics.get("fit", {}), metrics.get("test", {})
    return {
        **row,
        "status": "ok",
        "train_img_s": fit.get("train/images_per_s"),
        "data_wait_frac": fit.get("train/data_wait_frac"),
        "best_val_dice": metrics.get("best_val_dice"),
        "test_dice": test.get("test/dice"),
        "epochs": metrics.get("epochs"),
    }


def summarise(sweep_dir: Path) -> pd.DataFrame:
    jobs = [p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir()]
    jobs.sort(key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))
    if not jobs:
        raise FileNotFoundError(f"{sweep_dir}: no job folders (with .hydra/) found")
    rows = pd.DataFrame([_job_row(job) for job in jobs], columns=COLUMNS).astype(
        {"epochs": "Int64"}
    )
    write_text(sweep_dir / "compare.md", _markdown(rows))
    ok = rows[rows["status"] == "ok"]
    if not ok.empty:
        _plot(ok, sweep_dir / "compare.png")
    return rows


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


def _plot(rows: pd.DataFrame, path: Path) -> None:
    labels = [f"{r.loader}\n{r.aug}" for r in rows.itertuples()]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(6, 1.2 * len(rows)) * 2, 4))
    left.bar(labels, rows["train_img_s"])
    left.set_ylabel("training images/s (last epoch)")
    right.bar(labels, rows["best_val_dice"])
    right.set_ylabel("best val Dice")
    right.set_ylim(0, 1)
    fig.tight_layout()
    save_figure(path, fig)
    plt.close(fig)


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m nailseg.compare MULTIRUN_DIR")
    rows = summarise(Path(argv[0]))
    print(_markdown(rows))
    print(f"written: {Path(argv[0]) / 'compare.md'}, {Path(argv[0]) / 'compare.png'}")


if __name__ == "__main__":
    main(sys.argv[1:])
