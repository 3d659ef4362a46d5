"""What predict is asked, checked before any work: its settings, the engine's device, the output
folder (apart from the photos and true masks), the photos and every true mask; and the threshold
it asks for."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from nailseg.inference.photos import (
    Photo,
    Skipped,
    TrueMask,
    list_inputs,
    read_true_masks,
)
from nailseg.inference.segmenter import how_to_run
from nailseg.inference.spec import InferenceSpec, PredictError
from nailseg.inference.views import Views
from nailseg.io.overlap import overlap
from nailseg.io.permissions import unwritable_folder
from nailseg.prep.imageio import check_mask_threshold


@dataclass(frozen=True)
class Request:
    """A checked request: what to predict, where, and on what."""

    output: Path
    device: torch.device
    spec: InferenceSpec
    views: Views  # flips, scales, tiles
    photos: list[Photo]
    skipped: list[Skipped]  # input files left out, with why
    truths: dict[str, TrueMask | str] | None  # each photo's true mask or why none; None: no scores
    num_workers: int
    batch_size: int
    gpu_jpeg: bool  # JPEGs decoded on the GPU (nvJPEG), not by the workers
    overlays: bool


def check_request(cfg: DictConfig) -> Request:
    """`cfg` checked, in this order, before anything is written; raises PredictError (or the
    checkpoint's CheckpointError) naming the first fault. Every true mask is read here."""
    _check_numbers(cfg)
    spec, device, views = how_to_run(cfg)  # the checkpoint, its card's overrides, the device
    inputs = OmegaConf.to_object(cfg.input) if OmegaConf.is_list(cfg.input) else [cfg.input]
    output = Path(cfg.output)
    _check_paths(output, [Path(p) for p in inputs], Path(cfg.masks) if cfg.masks else None)
    num_workers = worker_count(cfg.num_workers, cfg.overlays, device)
    photos, skipped = list_inputs(inputs)  # MissingFile names an input that does not exist
    if not photos and not skipped:
        raise PredictError(f"no image files in input={cfg.input}")
    truths = None
    if cfg.masks:
        truths = read_true_masks(photos, cfg.masks, cfg.mask_threshold, num_workers)
    settings = (num_workers, cfg.batch_size, cfg.gpu_decode and device.type == "cuda", cfg.overlays)
    return Request(output, device, spec, views, photos, skipped, truths, *settings)


def _check_numbers(cfg: DictConfig) -> None:
    if cfg.num_workers is not None and cfg.num_workers < 1:
        raise PredictError(
            f"num_workers={cfg.num_workers}: must be at least 1 (null: see the help)"
        )
    try:
        check_mask_threshold(cfg.mask_threshold)
    except ValueError as err:
        raise PredictError(str(err)) from err


def _check_paths(output: Path, inputs: list[Path], masks: Path | None) -> None:
    """The output apart from the photos and true masks, the masks apart from the photos (each
    photo would score against itself), and the output folder writable."""
    pairs = [("output", output, "input", path) for path in inputs]
    if masks is not None:
        pairs += [("output", output, "masks", masks)]
        pairs += [("masks", masks, "input", path) for path in inputs]
    for key, path, other, other_path in pairs:
        if overlap(path, other_path):
            raise PredictError(
                f"{key}={path} and {other}={other_path} overlap (one is, or is inside, the "
                f"other): nothing was written; choose {key} apart from {other}"
            )
    if (folder := unwritable_folder(output)) is not None:
        raise PredictError(
            f"output={output}: {folder} is not writable by this user: change its permissions, "
            "or choose another output"
        )


def worker_count(num_workers: int | None, overlays: bool, device: torch.device) -> int:
    """`num_workers`, or one per core; on a GPU writing masks only, half the cores, at most 8,
    leaving cores to the thread that drives the GPU (encoding overlays needs every core)."""
    if num_workers is not None:
        return num_workers
    cores = os.cpu_count() or 1
    return cores if device.type == "cpu" or overlays else max(1, min(8, cores // 2))
