"""What a predict run reports: its summary, `scores.csv`, `summary.json`'s report and the lines
printed at the end."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nailseg.inference.output import SCORES
from nailseg.inference.photos import Skipped
from nailseg.inference.scoring import ImageScore, score_table, totals
from nailseg.inference.spec import InferenceSpec
from nailseg.inference.views import Views
from nailseg.io.atomic import write_atomic
from nailseg.tables import print_table


@dataclass
class PredictSummary:
    images: int  # photos predicted and written
    seconds: float  # reading, predicting and writing them
    threshold: float
    threshold_source: str  # checkpoint | override | auto
    skipped: list[Skipped]
    unscored: list[Skipped]  # predicted, but with no usable mask
    stages: dict[str, float]  # where the main thread's time went (progress.STAGES)
    capture_seconds: float  # capturing the net's CUDA graph, before `seconds` start
    workers_seconds: float  # starting the worker processes, before `seconds` start
    # what ran, whatever was asked: nvJPEG and CUDA graphs exist on a GPU only, graphs for torch
    device: str
    gpu_decode: bool
    cuda_graphs: bool
    scores: dict[str, Any] | None = None  # totals: `overall` and per `groups`

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


def write_scores(output: Path, scores: list[ImageScore], stamp: int) -> dict[str, Any]:
    """Write `scores.csv` with the run's `stamp`; returns the totals."""
    table = score_table(scores)
    # a file name that is not UTF-8 (its bytes kept by Python as surrogates) is written escaped,
    # as summary.json's JSON writes it: the table stays UTF-8, nothing is lost
    data = table.to_csv(index=False, lineterminator="\n").encode("utf-8", "backslashreplace")
    write_atomic(output / SCORES, lambda f: f.write(data), stamp)
    return totals(table)


def summary_report(summary: PredictSummary, spec: InferenceSpec, views: Views) -> dict[str, Any]:
    """`summary.json`'s report (the config is added beside it)."""
    return {
        "images": summary.images,
        "seconds": round(summary.seconds, 3),
        "images_per_s": round(summary.images_per_s, 3),
        "stages_s": summary.stages,
        "capture_s": summary.capture_seconds,
        "workers_start_s": summary.workers_seconds,
        "checkpoint": str(spec.ckpt),
        "image_size": list(spec.image_size),
        "tta": views.tta,
        **views.record(),  # scales, tile: null when unset
        "threshold": summary.threshold,
        "threshold_source": summary.threshold_source,
        "device": summary.device,
        "skipped": [{"path": str(s.path), "reason": s.reason} for s in summary.skipped],
        "unscored": [{"path": str(s.path), "reason": s.reason} for s in summary.unscored],
        "scores": summary.scores,
    }


def print_summary(summary: PredictSummary, output: Path, console: Console) -> None:
    """Skipped files, the score table (with masks) and the one-line summary."""
    for skipped in summary.skipped:
        console.print(f"  skipped {skipped}", markup=False, highlight=False, soft_wrap=True)
    for unscored in summary.unscored:
        console.print(f"  not scored {unscored}", markup=False, highlight=False, soft_wrap=True)
    if summary.scores:
        print_table(_score_table(summary.scores, summary.threshold), console)
    console.print(
        f"predicted {summary.images} images in {summary.seconds:.2f} s "
        f"({summary.images_per_s:.1f} images/s), {len(summary.skipped)} skipped, "
        f"threshold {summary.threshold:g} ({summary.threshold_source}) → {output}",
        highlight=False,
        soft_wrap=True,
    )


def _score_table(scores: dict[str, Any], threshold: float) -> Table:
    """Each group's totals (with more than one), then all images'."""
    table = Table(title=f"scores (threshold {threshold:g})")
    for name in ("group", "images", "dice", "iou", "mean image dice", "mean image iou"):
        table.add_column(name, justify="left" if name == "group" else "right")
    groups = scores["groups"]
    rows = [*(groups.items() if len(groups) > 1 else ()), ("all images", scores["overall"])]
    for name, s in rows:
        table.add_row(
            name,
            str(s["images"]),
            *(f"{s[k]:.4f}" for k in ("dice", "iou", "mean_image_dice", "mean_image_iou")),
        )
    return table
