"""`python -m nailseg predict ckpt=RUN/checkpoints/last.ckpt input=PHOTOS output=OUT
[masks=TRUE_MASKS] [tta=true] [threshold=auto]`: a mask for every photo, at its own size.

Writes, for each photo with key `k` (its path below the input folder, without extension):
`OUT/masks/k.png` (0/255) and, unless `overlays=false`, `OUT/overlays/k.png` (the prediction in
red over the photo); with `masks=`, `OUT/scores.csv` (per image Dice/IoU); and
`OUT/summary.json` (counts, timing, threshold, every skipped file, score totals, the config).
The whole request, every true mask included, is checked before the first write (request.py),
into a folder predict may write (output.py). An unreadable photo, or one whose output name the
filesystem refuses, is reported and skipped; the run fails only when no photo could be read.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from rich.console import Console

from nailseg.config import CONF_DIR, require_model_group, require_values
from nailseg.errors import UserError
from nailseg.inference.engine import build_engine, capture
from nailseg.inference.graphed import GraphedNet
from nailseg.inference.output import (
    OUTPUT_FOLDERS,
    PREDICT_LOCK,
    SCORES,
    OutputError,
    claim,
    list_outputs,
    write_summary,
)
from nailseg.inference.pipeline import BatchSettings, predict_photos
from nailseg.inference.request import PredictError, Request, check_request, choose_threshold
from nailseg.inference.spec import InferenceConfig
from nailseg.inference.summary import PredictSummary, print_summary, summary_report, write_scores
from nailseg.inference.views import input_sizes
from nailseg.inference.worker_pool import worker_processes
from nailseg.inference.workers import PhotoWriter
from nailseg.io.lock import locked
from nailseg.model.checkpoint import load_net


@dataclass
class TileConfig:
    """Types only: the values are in conf/predict.yaml."""

    long_side: int | None = None  # the photo's long side, in pixels, before tiling (None: no tiles)
    overlap: float = MISSING  # neighbouring tiles' least overlap, a fraction of a tile


@dataclass
class PredictConfig(InferenceConfig):
    """Types only: the values are in conf/predict.yaml."""

    input: Any = MISSING  # a folder (searched recursively), a file, or a list of either
    output: str = MISSING
    masks: str | None = None  # true masks, matched by key: writes scores.csv
    tta: bool = MISSING  # mean of identity, horizontal and vertical flip probabilities
    scales: list[float] | None = None  # factors of the input size, maps averaged (None: 1 size)
    tile: TileConfig = MISSING  # photos in tiles of the input size (long_side None: whole)
    threshold: str | None = None  # None: the checkpoint's; a number; "auto": Dice-best on valid
    data_root: str | None = None  # prepared data for threshold=auto (None: the checkpoint's)
    batch_size: int = MISSING
    device: str = MISSING  # auto | cpu | cuda | cuda:N
    gpu_decode: bool = MISSING  # on a GPU: JPEGs decoded by nvJPEG (else by the worker processes)
    engine: str = MISSING  # torch | onnx (ONNX Runtime, CPU only)
    cuda_graphs: bool = MISSING  # on a GPU: the net's forward replayed as a CUDA graph
    overlays: bool = MISSING  # also write OUT/overlays/<key>.png
    num_workers: int | None = None  # processes reading and writing files (None: worker_count)
    mask_threshold: int = MISSING  # a true mask's value > this is nail (0/1 masks taken as is)


ConfigStore.instance().store(name="predict_schema", node=PredictConfig)


def run(cfg: DictConfig, console: Console | None = None) -> PredictSummary:
    """Predict every photo of `cfg.input` into `cfg.output` (see the module docstring).

    Args:
        cfg: predict's config (`PredictConfig`, composed from conf/predict.yaml).
        console: where the progress bar, the skipped files and the summary go (None: stdout).

    Returns:
        The run's summary, as `summary.json` reports it.

    Raises:
        PredictError: the request is refused (nothing written), a worker process died, or no
            photo could be read.
        CheckpointError: the checkpoint cannot be read, or its net built.
        ThresholdError: `threshold=auto` cannot choose a threshold.
    """
    console = console or Console()
    request = check_request(cfg)
    spec, device, views = request.spec, request.device, request.views
    sizes = input_sizes(views, spec)
    loaded = load_net(spec.ckpt, spec.model)
    net = build_engine(cfg.engine, loaded, spec, device, cfg.cuda_graphs, sizes)
    graphed = isinstance(net, GraphedNet)
    capture_seconds = capture(net, spec, cfg.batch_size, cfg.tta, sizes) if graphed else 0.0
    threshold, source = choose_threshold(cfg, spec, views, net, device, console)
    config = OmegaConf.to_container(cfg, resolve=True)
    settings = BatchSettings(
        threshold=threshold,
        views=views,
        device=device,
        batch_size=cfg.batch_size,
        num_workers=request.num_workers,
        gpu_jpeg=cfg.gpu_decode and device.type == "cuda",
        overlays=cfg.overlays,
    )
    with locked(request.output, PREDICT_LOCK, "predict", "output", PredictError):  # to the end
        stamp, outputs = _claim(request, cfg.overlays, threshold, config)
        with worker_processes(request.num_workers, __name__) as (pool, workers_seconds):
            start = time.perf_counter()
            writer = PhotoWriter(request.output, stamp)
            outcome = predict_photos(
                net, spec, request.photos, settings, writer, request.truths, pool, console
            )
            seconds = time.perf_counter() - start
        summary = PredictSummary(
            images=outcome.written,
            seconds=seconds,
            threshold=threshold,
            threshold_source=source,
            skipped=request.skipped + outcome.skipped,
            unscored=outcome.unscored,
            stages={name: round(spent, 3) for name, spent in outcome.stages.items()},
            capture_seconds=round(capture_seconds, 3),
            workers_seconds=round(workers_seconds, 3),
            device=str(device),
            gpu_decode=settings.gpu_jpeg,
            cuda_graphs=graphed,
        )
        if outcome.scores:
            summary.scores = write_scores(request.output, outcome.scores, stamp)
        list_outputs(request.output, dict.fromkeys(outputs, stamp))  # the earlier run's are gone
        report = summary_report(summary, spec, views) | {"config": config}
        write_summary(request.output, report, finished=True)
        print_summary(summary, request.output, console)
        if not outcome.written:
            raise PredictError(f"none of the {len(summary.skipped)} input files could be read")
        return summary


def _claim(
    request: Request, overlays: bool, threshold: float, config: Any
) -> tuple[int, list[str]]:
    """The output folder claimed (`output.claim`) for what this run is to write: returns the
    run's stamp and those outputs."""
    folders = OUTPUT_FOLDERS if overlays else OUTPUT_FOLDERS[:1]
    outputs = [f"{folder}/{photo.key}.png" for photo in request.photos for folder in folders]
    outputs += [SCORES] if request.truths is not None else []
    report = {"images": 0, "checkpoint": str(request.spec.ckpt), "threshold": threshold}
    try:
        return claim(request.output, report | {"config": config}, outputs), outputs
    except OutputError as err:
        raise PredictError(str(err)) from err


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
