"""The folder predict writes into, and what a run reports there and on the console.

The folder is claimed as nailseg's `predict` folder (`nailseg.io.folder`), every file written
through it. Before the first write, each path this run writes must be free or nailseg's (a user's
file there, or a link on the way, is refused); then the earlier run's outputs still as written go,
so a rerun, even one stopped part-way, leaves only its own results beside the user's files.
`summary.json` is the run's report: written unfinished first, finished at the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nailseg.inference.photos import Skipped
from nailseg.inference.request import Request
from nailseg.inference.scoring import ImageScore, score_table, totals
from nailseg.inference.spec import InferenceSpec, PredictError
from nailseg.inference.views import Views
from nailseg.inference.workers import OUTPUT_FOLDERS
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OwnedFolder
from nailseg.tables import print_table

SUMMARY = "summary.json"
SCORES = "scores.csv"


def claim_output(request: Request) -> OwnedFolder:
    """The output folder claimed for the request's outputs, the earlier run's removed (the module
    docstring); PredictError, before any write, when it cannot be."""
    folders = OUTPUT_FOLDERS if request.overlays else OUTPUT_FOLDERS[:1]
    outputs = [f"{folder}/{photo.key}.png" for photo in request.photos for folder in folders]
    outputs += [SUMMARY] + ([SCORES] if request.truths is not None else [])
    folder = None
    try:
        folder = OwnedFolder.claim(request.output, "predict", key="output")
        folder.check_free(outputs)
        for rel in list(folder.journal.files):  # a link on the way to an earlier output
            folder.file(rel)
        folder.prune(keep=[SUMMARY])
    except (NotOursError, OSError) as err:  # OSError: a file where the folder would be
        if folder is not None:
            folder.release()
        why = f"output={request.output}: {err.strerror}" if isinstance(err, OSError) else err
        raise PredictError(str(why)) from err
    return folder


@dataclass
class PredictSummary:
    images: int  # photos predicted and written
    seconds: float  # reading, predicting and writing them
    threshold: float
    threshold_source: str  # checkpoint | override | auto
    skipped: list[Skipped]
    unscored: list[Skipped]  # predicted, but with no usable mask
    stages: dict[str, float]  # where the main thread's time went (pipeline.STAGES)
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


def write_summary(folder: OwnedFolder, report: dict[str, Any], *, finished: bool) -> None:
    folder.write(SUMMARY, json.dumps({"finished": finished, **report}, indent=2).encode())


def write_scores(folder: OwnedFolder, scores: list[ImageScore]) -> dict[str, Any]:
    """Write `scores.csv`; returns the totals."""
    table = score_table(scores)
    # a file name that is not UTF-8 (its bytes kept by Python as surrogates) is written escaped,
    # as summary.json's JSON writes it: the table stays UTF-8, nothing is lost
    data = table.to_csv(index=False, lineterminator="\n").encode("utf-8", "backslashreplace")
    folder.write(SCORES, data)
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
    lines = [f"  skipped {s}" for s in summary.skipped]
    for line in lines + [f"  not scored {s}" for s in summary.unscored]:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
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
