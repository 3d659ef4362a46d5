"""Benchmark of `predict` (photos/s, files read and masks written) and of ONNX Runtime against
PyTorch on the CPU; not a timed test.

    make bench-predict CKPT=...   (python -m benchmarks.predict ckpt=CKPT input_dir=PHOTOS output_dir=DIR)

The photo set, `DIR/photos`, is made once from the images under `input_dir` (searched recursively):
each photo as it is, plus a JPEG copy at every scale in `jpeg_scales` (so the set mixes formats and
sizes), in a folder of its own whose marker records the settings and lists its files; a file it
did not write is never replaced, and a `DIR/photos` it did not make is refused. Each run of `runs`
predicts the whole set (or its first `limit` photos) into a scratch folder removed after it; the
first run is preceded by a short warm-up; runs on `cuda` are skipped, and said so, where there is
no GPU. The ONNX comparison times the net alone on one batch of the photos at the input size:
PyTorch, and ONNX Runtime on the model predict's `engine=onnx` runs (built and checked in memory,
nothing written), each with torch's CPU threads, median of `repeats`. Writes
`DIR/bench_predict.csv`, `.json` (with the config) and `.png` and prints a table. DIR may not
overlap `input_dir`, and is a folder of its own (`benchmarks.output`); nothing is written
before that is checked.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import hydra
import matplotlib
import numpy as np
import pandas as pd
import torch
from hydra import compose
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from rich.console import Console
from rich.table import Table

from benchmarks.output import claim_output, scratch
from nailseg.config import CONF_DIR
from nailseg.errors import require_values
from nailseg.inference.engine import OnnxNet, build_engine
from nailseg.inference.pipeline import STAGES
from nailseg.inference.predict import run as predict
from nailseg.inference.request import find_images
from nailseg.inference.segmenter import resolve_spec
from nailseg.inference.views import image_tensors, to_batch
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OwnedFolder, below, read_regular
from nailseg.model.checkpoint import load_net
from nailseg.prep.imageio import read_rgb
from nailseg.tables import print_table

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COMMAND = "benchmarks.predict"
PHOTOS = "bench-photos"  # the photo set's folder kind
OUTPUTS = ["bench_predict.csv", "bench_predict.json", "bench_predict.png"]
COLUMNS = [
    "run", "device", "engine", "gpu_decode", "cuda_graphs", "overlays", "photos", "seconds",
    "photos_per_s", *STAGES, "capture_s",
]  # fmt: skip


def make_photos(input_dir: Path, path: Path, scales: list[float], quality: int) -> list[Path]:
    """The photo set (see the module docstring) in the folder at `path` (its own `OwnedFolder`
    of kind `bench-photos`): reused when its marker records the same settings and every file is
    still as it wrote it, else made again. A folder it did not make is refused; in its own, a
    file of anyone else's where the set goes is refused before anything is removed or written."""
    settings = {"input_dir": str(input_dir.resolve()), "jpeg_scales": scales, "quality": quality}
    folder = OwnedFolder.claim(path, PHOTOS, key="output_dir")
    files = folder.marker.get("files")
    whole = isinstance(files, list) and all(isinstance(n, str) and below(n) for n in files)
    if whole and folder.marker.get("settings") == settings and all(map(folder.owns, files)):
        return [folder.path / name for name in files]
    sources, _ = find_images(input_dir)
    if not sources:
        raise FileNotFoundError(f"input_dir={input_dir}: no images found")
    names = [
        [f"{i:05d}{source.suffix.lower()}", *(f"{i:05d}_x{scale:g}.jpg" for scale in scales)]
        for i, source in enumerate(sources)
    ]
    files = [name for group in names for name in group]
    folder.check_free(files)
    folder.update_marker(settings=None, files=files)  # until the set is whole, it is not reused
    folder.prune(keep=[])
    for source, (original, *copies) in zip(sources, names, strict=True):
        _write_photo(source, folder, original, dict(zip(copies, scales, strict=True)), quality)
    folder.update_marker(settings=settings)
    return [folder.path / name for name in files]


def _write_photo(
    source: Path, folder: OwnedFolder, original: str, copies: dict[str, float], quality: int
) -> None:
    """One photo as found, and a JPEG of it at each scale (`copies`: name to scale)."""
    image = Image.fromarray(read_rgb(source))
    folder.write(original, read_regular(source))
    for name, scale in copies.items():
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        scaled = image.resize(size, Image.Resampling.BILINEAR)
        folder.write(name, lambda f, im=scaled: im.save(f, format="JPEG", quality=quality))


def _predict_once(
    cfg: DictConfig, out: OwnedFolder, folder: Path, photos: list[Path], overrides: dict
) -> dict:
    """One predict run of `photos` (all of `folder`'s, or hard-linked into a folder of their own)
    into a scratch folder of `out`, removed after it: links and predictions only."""
    with scratch(out) as scratch_dir:
        source = folder
        if len(photos) < len(find_images(folder)[0]):
            source = scratch_dir / "in"
            source.mkdir()
            for photo in photos:
                os.link(photo, source / photo.name)
        args = [
            f"ckpt={cfg.ckpt}",
            f"input={source}",
            f"output={scratch_dir / 'out'}",
            f"batch_size={cfg.batch_size}",
            *(f"{k}={v}" for k, v in overrides.items()),
        ]
        asked = compose("predict", overrides=args)
        summary = predict(asked, console=Console(quiet=True))
    return {
        "device": summary.device,  # what ran: a run's settings that do not apply there are off
        "engine": asked.engine,  # predict's own values (its defaults included), as it ran them
        "gpu_decode": summary.gpu_decode,
        "cuda_graphs": summary.cuda_graphs,
        "overlays": asked.overlays,
        "photos": summary.images,
        "seconds": summary.seconds,
        **summary.stages,
        "capture_s": summary.capture_seconds,
    }


def predict_rows(cfg: DictConfig, out: OwnedFolder, folder: Path, photos: list[Path]) -> list[dict]:
    rows = []
    for name, run in cfg.runs.items():
        overrides = OmegaConf.to_container(run, resolve=True)
        if str(overrides.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            Console().print(f"run {name}: skipped, no CUDA device here")
            continue
        if not rows:  # warm-up: CUDA context, kernels, the workers' forkserver
            _predict_once(cfg, out, folder, photos[: 4 * cfg.batch_size], overrides)
        chosen = photos[: cfg.limit[name]] if name in cfg.limit else photos
        measured = _predict_once(cfg, out, folder, chosen, overrides)
        rows.append(
            {
                "run": name,
                **measured,
                "photos_per_s": measured["photos"] / measured["seconds"],
            }
        )
    return rows


def onnx_vs_torch(cfg: DictConfig, photos: list[Path]) -> dict:
    """The net alone on the CPU, one batch of the photos: PyTorch and ONNX Runtime images/s (the
    ONNX model as predict's engine=onnx runs it: built and checked in memory)."""
    spec = resolve_spec(compose("predict", overrides=[f"ckpt={cfg.ckpt}", "input=x", "output=y"]))
    net = load_net(spec.ckpt, spec.model).eval()
    try:
        onnx = OnnxNet(net, spec, [spec.image_size])
    except ImportError as err:  # the GPU machine's image has neither onnx nor onnxruntime
        return {"onnx": f"not measured: {err}"}
    cpu = torch.device("cpu")
    net = build_engine("torch", net, spec, cpu, cuda_graphs=False)  # as predict runs it
    batch = to_batch(image_tensors([read_rgb(p) for p in photos[: cfg.onnx_batch]], cpu), spec)
    result = {
        "onnx_logits_difference": onnx.difference,
        "batch": len(batch),
        "threads": torch.get_num_threads(),  # each engine's
    }
    for name, engine in (("torch", net), ("onnxruntime", onnx)):
        with torch.inference_mode():
            engine(batch)  # warm-up
            times = []
            for _ in range(cfg.repeats):
                start = time.perf_counter()
                engine(batch)
                times.append(time.perf_counter() - start)
        result[f"{name}_img_s"] = len(batch) / statistics.median(times)
    result["onnxruntime_vs_torch"] = result["onnxruntime_img_s"] / result["torch_img_s"]
    return result


def _plot(rows: pd.DataFrame, folder: OwnedFolder) -> None:
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(rows)), 4))
    ax.bar(rows["run"], rows["photos_per_s"])
    ax.set_ylabel("photos/s (read, predicted, mask written)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    folder.write("bench_predict.png", lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


def _size(path: Path) -> tuple[int, int]:
    """A photo's (width, height) from its header, the file closed after."""
    with Image.open(path) as image:
        return image.size


def run(cfg: DictConfig) -> tuple[pd.DataFrame, dict]:
    # an overlap is refused: the set and the runs' folders would land among the photos
    out = claim_output(cfg, OUTPUTS, COMMAND)
    folder = out.path / "photos"
    try:
        photos = make_photos(Path(cfg.input_dir), folder, list(cfg.jpeg_scales), cfg.jpeg_quality)
    except NotOursError as err:
        sys.exit(f"{COMMAND}: {err}")
    sizes = np.array([_size(p) for p in photos])
    rows = pd.DataFrame(predict_rows(cfg, out, folder, photos), columns=COLUMNS)
    onnx = onnx_vs_torch(cfg, photos) if cfg.onnx else {}
    extra = {
        "photo_set": {
            "photos": len(photos),
            "jpeg": sum(p.suffix == ".jpg" for p in photos),
            "pixels_median": float(np.median(sizes.prod(axis=1))),
            "longest_side_max": int(sizes.max()),
        },
        "onnx_cpu": onnx,
        "cpus": os.cpu_count(),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    out.write("bench_predict.csv", rows.to_csv(index=False, float_format="%.4f").encode())
    out.write("bench_predict.json", json.dumps(extra, indent=2).encode())
    _plot(rows, out)
    table = Table(title="predict (photos/s: read, predicted, mask written)")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for row in rows.itertuples(index=False):
        table.add_row(*(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row))
    console = Console()
    print_table(table, console)
    console.print(json.dumps(extra, indent=2), highlight=False)
    return rows, extra


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_predict")
def main(cfg: DictConfig) -> None:
    require_values(cfg, COMMAND)
    run(cfg)


if __name__ == "__main__":
    main()
