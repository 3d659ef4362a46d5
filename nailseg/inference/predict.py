"""`python -m nailseg predict ckpt=RUN/checkpoints/last.ckpt input=PHOTOS output=OUT
[masks=TRUE_MASKS] [tta=true] [threshold=auto]`: a mask for every photo, at its own size.

Writes `OUT/masks/<key>.png`, `OUT/overlays/<key>.png`, `OUT/summary.json` [`OUT/scores.csv`]
(docs/INFERENCE.md). A photo's trip: the request checked, every true mask read (request.py),
before the first write; the photo read by a worker (photos.py), run in a batch (pipeline.py:
decoded on the device, run by the checkpoint's Segmenter), its mask written by a worker
(workers.py) into the folder output.py claimed. A photo that cannot be read or written is
reported and skipped. `load` is the Python API (`nailseg.load`): that Segmenter, without files.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console

from nailseg.config import CONF_DIR, PredictConfig
from nailseg.errors import UserError, require_model_group, require_values
from nailseg.inference.output import (
    PredictSummary,
    claim_output,
    print_summary,
    summary_report,
    write_scores,
    write_summary,
)
from nailseg.inference.pipeline import predict_photos
from nailseg.inference.request import check_request
from nailseg.inference.segmenter import Segmenter, how_to_run
from nailseg.inference.spec import PredictError
from nailseg.inference.workers import PhotoWriter, worker_processes


def run(cfg: DictConfig, console: Console | None = None) -> PredictSummary:
    """Predict every photo of `cfg.input` into `cfg.output` (the module docstring); `console`
    shows the progress, the skipped files and the summary. Returns the summary `summary.json`
    reports. Raises a UserError (PredictError, CheckpointError, ThresholdError) naming the fault."""
    console = console or Console()
    request = check_request(cfg)
    spec, device, views = request.spec, request.device, request.views
    model = Segmenter(cfg, spec, device, views, console)
    threshold = model.threshold
    config = OmegaConf.to_container(cfg, resolve=True)
    with claim_output(request) as folder:
        report = {"images": 0, "checkpoint": str(spec.ckpt), "threshold": threshold}
        write_summary(folder, report | {"config": config}, finished=False)
        with worker_processes(request.num_workers, __name__) as (pool, workers_seconds):
            start = time.perf_counter()
            writer = PhotoWriter(folder.path)
            outcome = predict_photos(model, request, writer, pool, console)
            seconds = time.perf_counter() - start
        summary = PredictSummary(
            images=outcome.written,
            seconds=seconds,
            threshold=threshold,
            threshold_source=model.threshold_source,
            skipped=request.skipped + outcome.skipped,
            unscored=outcome.unscored,
            stages={name: round(spent, 3) for name, spent in outcome.stages.items()},
            capture_seconds=round(model.capture_seconds, 3),
            workers_seconds=round(workers_seconds, 3),
            device=str(device),
            gpu_decode=request.gpu_jpeg,
            cuda_graphs=model.graphed,
        )
        if outcome.scores:
            summary.scores = write_scores(folder, outcome.scores)
        report = summary_report(summary, spec, views) | {"config": config}
        write_summary(folder, report, finished=True)
    print_summary(summary, request.output, console)
    if not outcome.written:
        raise PredictError(f"none of the {len(summary.skipped)} input files could be read")
    return summary


def load(ckpt: str | os.PathLike, device: str = "auto", **options: Any) -> Segmenter:
    """`nailseg.load`: the checkpoint `ckpt` loaded once on `device`, run as predict runs it;
    `options` are predict's keys (tta, scales, tile, threshold, batch_size, engine, image_size,
    ...), conf/predict.yaml's values where not given. Raises a UserError naming a bad key."""
    values = OmegaConf.load(Path(CONF_DIR) / "predict.yaml")
    del values["defaults"], values["hydra"]  # Hydra's, not predict's
    try:
        cfg = OmegaConf.merge(PredictConfig, values, options, {"ckpt": str(ckpt), "device": device})
    except OmegaConfBaseException as err:  # its message runs on with the key's full path
        raise PredictError(f"nailseg.load: {str(err).splitlines()[0]}") from err
    return Segmenter(cfg, *how_to_run(cfg))


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
