"""Benchmark of `predict` (photos/s, files read and masks written) and of ONNX Runtime against
PyTorch on the CPU; not a timed test.

    python -m nailseg bench-predict ckpt=RUN/checkpoints/last.ckpt input_dir=PHOTOS output_dir=DIR

The photo set, `DIR/photos`, is made once from the images under `input_dir` (searched recursively):
each photo as it is, plus a JPEG copy at every scale in `jpeg_scales` (so the set mixes formats and
sizes); `DIR/photos/photos.json`, its manifest, marks it as this benchmark's, lists its files and
the modification time they were all stamped with: it only ever replaces a listed file that still
bears that stamp; a `DIR/photos` without it is refused. Each run of `runs` predicts
the whole set (or its first `limit` photos) into a folder made for it and removed after it; the
first run is preceded by a short warm-up; runs on `cuda` are skipped, and said so, where there is
no GPU. The ONNX comparison times the net alone on one batch of the photos at the input size:
PyTorch, and ONNX Runtime on the model predict's `engine=onnx` runs (built and checked in memory,
nothing written), each with torch's CPU threads, median of `repeats`. Writes
`DIR/bench_predict.csv`, `.json` (with the config) and `.png` and prints a table. DIR may not
overlap `input_dir`, and is a folder of its own (`nailseg.tools.output`); nothing is written
before that is checked.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

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

from nailseg.config import CONF_DIR, require_values
from nailseg.inference.engine import build_engine
from nailseg.inference.photos import find_images
from nailseg.inference.predict import run as predict
from nailseg.inference.progress import STAGES
from nailseg.inference.spec import image_tensors, resolve_spec, to_batch
from nailseg.io.atomic import save_figure, write_atomic, write_text
from nailseg.io.overlap import overlap
from nailseg.io.ownership import hard_link, make_folder, remove_file, scratch_folder, stamped
from nailseg.model.checkpoint import load_net
from nailseg.prep.format import new_stamp, stamp_of
from nailseg.prep.imageio import read_rgb
from nailseg.tables import print_table
from nailseg.tools.output import claim_output, record_outputs, refused_in_one_line

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MARKER = "photos.json"  # the photo set's manifest
CREATOR = "nailseg.bench_predict"
OUTPUTS = ["bench_predict.csv", "bench_predict.json", "bench_predict.png"]
COLUMNS = [
    "run", "device", "engine", "gpu_decode", "cuda_graphs", "overlays", "photos", "seconds",
    "photos_per_s", *STAGES, "capture_s",
]  # fmt: skip


def make_photos(input_dir: Path, folder: Path, scales: list[float], quality: int) -> list[Path]:
    """The photo set (see the module docstring): the files its manifest (`MARKER`) lists, made
    now or reused when the manifest records the same settings, a finished set and every file
    still as it wrote it. A folder without this benchmark's manifest is refused; in one with it,
    only the listed files that still bear the set's stamp are ever replaced: a file of anyone
    else's there stays (and is not part of the set), and one saved under a listed name is refused."""
    settings = {"input_dir": str(input_dir.resolve()), "jpeg_scales": scales, "quality": quality}
    earlier = _earlier_set(folder, settings)
    if earlier.reusable:
        return [folder / name for name in earlier.ours]
    sources, _ = find_images(input_dir)
    if not sources:
        raise FileNotFoundError(f"input_dir={input_dir}: no images found")
    names = [
        [f"{i:05d}{source.suffix.lower()}", *(f"{i:05d}_x{scale:g}.jpg" for scale in scales)]
        for i, source in enumerate(sources)
    ]
    files = [name for group in names for name in group]
    in_the_way = [name for name in files if name not in earlier.ours and (folder / name).exists()]
    if in_the_way:  # checked before anything is removed or written
        raise FileExistsError(
            f"{folder / in_the_way[0]} is in the way of the photo set and is not one it made (not "
            f"listed in {MARKER}): move it, or choose another output_dir"
        )
    for name in earlier.ours:  # each still bearing the set's stamp, checked above
        remove_file(folder / name, stamped(earlier.stamp))
    stamp = new_stamp()
    manifest = {
        "created_by": CREATOR,
        "settings": settings,
        "files": files,
        "stamp_ns": stamp,
        "finished": False,
    }
    marker = folder / MARKER
    write_text(marker, json.dumps(manifest, indent=2))  # first: an interrupted set is ours too
    for source, (original, *copies) in zip(sources, names, strict=True):
        _write_photo(
            source, folder, original, dict(zip(copies, scales, strict=True)), quality, stamp
        )
    write_text(marker, json.dumps(manifest | {"finished": True}, indent=2))
    return [folder / name for name in files]


class _EarlierSet(NamedTuple):
    """What an earlier photo set in the folder leaves: whether it can be used as it is, the
    files it stamped (all of it when reusable), and its stamp."""

    reusable: bool
    ours: list[str]
    stamp: int | None


def _earlier_set(folder: Path, settings: dict[str, Any]) -> _EarlierSet:
    """The set already in `folder`; FileExistsError when the folder is not this benchmark's or
    a listed file was changed since it wrote it."""
    if not folder.exists():
        return _EarlierSet(False, [], None)
    manifest = _manifest(folder / MARKER)
    if manifest is None:
        raise FileExistsError(
            f"{folder} exists and is not this benchmark's photo set (no {MARKER} written by "
            f"{CREATOR} of this version): choose another output_dir"
        )
    stamp = manifest["stamp_ns"]
    listed = {name: stamp_of(folder / name) for name in manifest["files"]}
    intact = all(t == stamp for t in listed.values())
    if manifest["finished"] and manifest["settings"] == settings and intact:
        return _EarlierSet(True, list(manifest["files"]), stamp)
    changed = [n for n, t in listed.items() if t is not None and t != stamp]
    if changed:
        raise FileExistsError(
            f"{folder / changed[0]} is listed in {MARKER} but is no longer the file this "
            "benchmark wrote there (its modification time changed): move it, or choose "
            "another output_dir"
        )
    return _EarlierSet(False, [name for name, t in listed.items() if t is not None], stamp)


def _write_photo(
    source: Path, folder: Path, original: str, copies: dict[str, float], quality: int, stamp: int
) -> None:
    """One photo as found, and a JPEG of it at each scale (`copies`: name to scale)."""
    image = Image.fromarray(read_rgb(source))
    data = source.read_bytes()
    write_atomic(folder / original, lambda f: f.write(data), stamp)
    for name, scale in copies.items():
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        scaled = image.resize(size, Image.Resampling.BILINEAR)
        write_atomic(
            folder / name, lambda f, im=scaled: im.save(f, format="JPEG", quality=quality), stamp
        )


def _manifest(marker: Path) -> dict | None:
    """The photo set's manifest, or None when `marker` is not one this benchmark wrote: also when
    its file list names anything but plain names in the set's folder (never followed out of it)."""
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("created_by") != CREATOR:
        return None
    files = manifest.get("files")
    plain = isinstance(files, list) and all(
        isinstance(name, str) and name not in ("", ".", "..", MARKER) and Path(name).name == name
        for name in files
    )
    stamped = type(manifest.get("stamp_ns")) is int
    return manifest if plain and stamped else None


def _predict_once(cfg: DictConfig, folder: Path, photos: list[Path], overrides: dict) -> dict:
    """One predict run of `photos` (all of `folder`'s, or hard-linked into a folder of their own)
    into a folder made for it (`mkdtemp`) and removed after it: links and predictions only."""
    with scratch_folder(Path(cfg.output_dir), ".run-") as scratch:
        source = folder
        if len(photos) < len(find_images(folder)[0]):
            source = make_folder(scratch / "in")
            for photo in photos:
                hard_link(photo, source / photo.name)
        args = [
            f"ckpt={cfg.ckpt}",
            f"input={source}",
            f"output={scratch / 'out'}",
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


def predict_rows(cfg: DictConfig, folder: Path, photos: list[Path]) -> list[dict]:
    rows = []
    for name, run in cfg.runs.items():
        overrides = OmegaConf.to_container(run, resolve=True)
        if str(overrides.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            Console().print(f"run {name}: skipped, no CUDA device here")
            continue
        if not rows:  # warm-up: CUDA context, kernels, the workers' forkserver
            _predict_once(cfg, folder, photos[: 4 * cfg.batch_size], overrides)
        chosen = photos[: cfg.limit[name]] if name in cfg.limit else photos
        measured = _predict_once(cfg, folder, chosen, overrides)
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
    try:
        from nailseg.inference.export import OnnxNet
    except ImportError as err:  # the GPU machine's image has neither onnx nor onnxruntime
        return {"onnx": f"not measured: {err}"}
    spec = resolve_spec(compose("predict", overrides=[f"ckpt={cfg.ckpt}", "input=x", "output=y"]))
    net = load_net(spec.ckpt, spec.model).eval()
    onnx = OnnxNet(net, spec)
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


def _plot(rows: pd.DataFrame, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(rows)), 4))
    ax.bar(rows["run"], rows["photos_per_s"])
    ax.set_ylabel("photos/s (read, predicted, mask written)")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    save_figure(path, fig)
    plt.close(fig)


def _size(path: Path) -> tuple[int, int]:
    """A photo's (width, height) from its header, the file closed after."""
    with Image.open(path) as image:
        return image.size


def run(cfg: DictConfig) -> tuple[pd.DataFrame, dict]:
    out = Path(cfg.output_dir)
    if overlap(out, Path(cfg.input_dir)):  # the set and the runs' folders would land among the
        raise ValueError(  # photos, and the next run would take them for photos
            f"output_dir={out} and input_dir={cfg.input_dir} overlap (one is, or is inside, the "
            "other): nothing was written; choose an output folder apart from the photos"
        )
    claim_output(out, OUTPUTS)
    folder = out / "photos"
    photos = make_photos(Path(cfg.input_dir), folder, list(cfg.jpeg_scales), cfg.jpeg_quality)
    sizes = np.array([_size(p) for p in photos])
    rows = pd.DataFrame(predict_rows(cfg, folder, photos), columns=COLUMNS)
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
    write_text(out / "bench_predict.csv", rows.to_csv(index=False, float_format="%.4f"))
    write_text(out / "bench_predict.json", json.dumps(extra, indent=2))
    _plot(rows, out / "bench_predict.png")
    record_outputs(out, OUTPUTS)
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
    require_values(cfg, "nailseg bench-predict")
    with refused_in_one_line("nailseg bench-predict"):
        run(cfg)
