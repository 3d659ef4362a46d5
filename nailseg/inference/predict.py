"""`python -m nailseg predict ckpt=CKPT input=PHOTOS output=OUT [masks=TRUE_MASKS] [...]`: a mask
for every photo, at its own size, into OUT/masks/, overlays/, summary.json [scores.csv].

A photo's trip: the request checked and every true mask read before torch is imported
(request.py); the checkpoint loaded as `nailseg.load` loads it (segmenter.py); the photo read by
a worker (workers.py), run in a batch (pipeline.py), its mask written and scored by a worker. OUT
is claimed as nailseg's `predict` folder: each path this run writes must be free or nailseg's,
then the earlier run's outputs go, so a rerun leaves only its own beside the user's files.
`summary.json` says unfinished until the end.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
import pandas as pd
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from nailseg.config import CONF_DIR
from nailseg.errors import UserError, require_model_group, require_values
from nailseg.inference.request import PredictError, Request, Skipped, check_request
from nailseg.inference.workers import (
    OUTPUT_FOLDERS,
    ImageScore,
    PhotoWriter,
    dice_iou,
    worker_processes,
)
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OwnedFolder
from nailseg.tables import print_table

if TYPE_CHECKING:
    from nailseg.inference.segmenter import Segmenter

SUMMARY = "summary.json"
SCORES = "scores.csv"


def run(cfg: DictConfig, console: Console | None = None) -> PredictSummary:
    """Predict every photo of `cfg.input` into `cfg.output`; a UserError names a fault."""
    console = console or Console()
    request = check_request(cfg)
    say = lambda text: console.print(text, highlight=False, soft_wrap=True)  # noqa: E731
    say(f"predict: {len(request.photos)} photos; loading torch and {cfg.ckpt} …")
    from nailseg.inference.pipeline import predict_photos  # torch: after every check above
    from nailseg.inference.segmenter import Segmenter

    model = Segmenter(cfg, console)
    spec, (height, width) = model.spec, model.spec.image_size
    say(
        f"loaded {spec.model['arch']}/{spec.model['encoder_name']} at {height}x{width} on "
        f"{model.device}; threshold {model.threshold:g} ({model.threshold_source}); starting "
        f"{request.num_workers} worker processes …"
    )
    config = OmegaConf.to_container(cfg, resolve=True)
    with claim_output(request) as folder:
        report = {"images": 0, "checkpoint": str(spec.ckpt), "threshold": model.threshold}
        write_summary(folder, report | {"config": config}, finished=False)
        with worker_processes(request.num_workers) as (pool, workers_seconds):
            start = time.perf_counter()
            outcome = predict_photos(model, request, PhotoWriter(folder.path), pool, console)
            seconds = time.perf_counter() - start
        summary = PredictSummary(
            images=outcome.written,
            seconds=seconds,
            threshold=model.threshold,
            threshold_source=model.threshold_source,
            skipped=request.skipped + outcome.skipped,
            unscored=outcome.unscored,
            stages={name: round(spent, 3) for name, spent in outcome.stages.items()},
            capture_seconds=round(model.capture_seconds, 3),
            workers_seconds=round(workers_seconds, 3),
            device=str(model.device),
            gpu_decode=request.gpu_jpeg,
            cuda_graphs=model.graphed,
            auto_scale=outcome.rerun if model.views.auto else None,
        )
        if outcome.scores:
            summary.scores = write_scores(folder, outcome.scores)
        write_summary(folder, summary.report(model) | {"config": config}, finished=True)
    print_summary(summary, request.output, console)
    if not outcome.written:
        raise PredictError(f"none of the {len(summary.skipped)} input files could be read")
    return summary


def claim_output(request: Request) -> OwnedFolder:
    """The output folder claimed, the earlier run's outputs removed; else PredictError."""
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
    auto_scale: dict[str, int] | None = None  # key -> the long side it ran at again; None: off

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def report(self, model: Segmenter) -> dict[str, Any]:
        """`summary.json`'s report of a run of `model` (the config is added beside it)."""
        spec, views = model.spec, model.views
        return {
            "images": self.images,
            "seconds": round(self.seconds, 3),
            "images_per_s": round(self.images_per_s, 3),
            "stages_s": self.stages,
            "capture_s": self.capture_seconds,
            "workers_start_s": self.workers_seconds,
            "checkpoint": str(spec.ckpt),
            "image_size": list(spec.image_size),
            "tta": views.tta,
            **views.record(),  # scales, tile: null when unset
            "auto_scale": self.auto_scale,  # the photos run again, each's long side; null: off
            "threshold": self.threshold,
            "threshold_source": self.threshold_source,
            "device": self.device,
            "skipped": [{"path": str(s.path), "reason": s.reason} for s in self.skipped],
            "unscored": [{"path": str(s.path), "reason": s.reason} for s in self.unscored],
            "scores": self.scores,
        }


def write_summary(folder: OwnedFolder, report: dict[str, Any], *, finished: bool) -> None:
    folder.write(SUMMARY, json.dumps({"finished": finished, **report}, indent=2).encode())


def write_scores(folder: OwnedFolder, scores: list[ImageScore]) -> dict[str, Any]:
    """Write `scores.csv` (a row per photo); returns the totals, `overall` and per group."""
    table = pd.DataFrame([asdict(s) for s in scores], columns=[f.name for f in fields(ImageScore)])
    table = table.sort_values("key", ignore_index=True)
    # a file name that is not UTF-8 (its bytes kept by Python as surrogates) is written escaped,
    # as summary.json's JSON writes it: the table stays UTF-8, nothing is lost
    folder.write(SCORES, table.to_csv(index=False).encode("utf-8", "backslashreplace"))
    groups = {str(group): _total(rows) for group, rows in table.groupby("group", sort=True)}
    return {"overall": _total(table), "groups": groups}


def _total(rows: pd.DataFrame) -> dict[str, float]:
    """Pixel-sum Dice and IoU, the means of the per-photo ones, the photo and pixel counts."""
    tp, fp, fn = (int(rows[c].sum()) for c in ("tp", "fp", "fn"))
    dice, iou = dice_iou(tp, fp, fn)
    means = [float(rows[c].mean()) if len(rows) else float("nan") for c in ("dice", "iou")]
    keys = ("images", "dice", "iou", "mean_image_dice", "mean_image_iou", "tp", "fp", "fn")
    return dict(zip(keys, (len(rows), dice, iou, *means, tp, fp, fn), strict=True))


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


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="predict")
def _main(cfg: DictConfig) -> None:
    require_values(cfg, "nailseg predict")
    try:
        run(cfg)
    except UserError as err:
        sys.exit(f"predict failed: {err}")


def main() -> None:
    """The command: its model-key check runs before Hydra composes the config."""
    require_model_group("nailseg predict", sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()
