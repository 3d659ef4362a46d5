"""What predict is asked, checked before any work: its settings, the engine's device, the output
folder, the photos and every true mask; and the threshold it asks for."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from nailseg.device import resolve_device
from nailseg.errors import UserError
from nailseg.inference.output import OutputError, check_output
from nailseg.inference.photos import (
    MaskIndex,
    Photo,
    Skipped,
    TrueMask,
    list_inputs,
    read_true_masks,
)
from nailseg.inference.spec import InferenceSpec, Net, resolve_spec
from nailseg.inference.threshold import auto_threshold
from nailseg.inference.views import Views, views_of
from nailseg.io.permissions import unwritable_folder
from nailseg.prep.imageio import check_mask_threshold


class PredictError(UserError, RuntimeError):
    """A request predict refuses, or a run it cannot finish: the message says why."""


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


def check_request(cfg: DictConfig) -> Request:
    """`cfg` checked, in this order, before anything is written; raises PredictError (or the
    checkpoint's CheckpointError) naming the first fault. Every true mask is read here."""
    _check_numbers(cfg)
    device = _engine_device(cfg.engine, str(cfg.device))
    spec = resolve_spec(cfg)  # the checkpoint and the overrides of its card
    try:
        views = views_of(cfg, spec)
    except ValueError as err:
        raise PredictError(str(err)) from err
    inputs = OmegaConf.to_object(cfg.input) if OmegaConf.is_list(cfg.input) else [cfg.input]
    output = Path(cfg.output)
    _check_output(output, [Path(p) for p in inputs], Path(cfg.masks) if cfg.masks else None)
    num_workers = worker_count(cfg.num_workers, cfg.overlays, device)
    try:
        photos, skipped = list_inputs(inputs)
        mask_index = MaskIndex(cfg.masks) if cfg.masks else None
    except FileNotFoundError as err:
        raise PredictError(str(err)) from err
    if not photos and not skipped:
        raise PredictError(f"no image files in input={cfg.input}")
    truths = None
    if mask_index is not None:
        truths = _true_masks(photos, cfg.masks, mask_index, cfg.mask_threshold, num_workers)
    return Request(output, device, spec, views, photos, skipped, truths, num_workers)


def _check_numbers(cfg: DictConfig) -> None:
    if cfg.batch_size < 1:
        raise PredictError(f"batch_size={cfg.batch_size}: must be at least 1")
    if cfg.num_workers is not None and cfg.num_workers < 1:
        raise PredictError(
            f"num_workers={cfg.num_workers}: must be at least 1 (null: see the help)"
        )
    try:
        check_mask_threshold(cfg.mask_threshold)
    except ValueError as err:
        raise PredictError(str(err)) from err


def _engine_device(engine: str, device: str) -> torch.device:
    """`device`, resolved; ONNX Runtime runs on the CPU, so with `engine=onnx` auto means the CPU
    and a GPU is refused."""
    if engine not in ("torch", "onnx"):
        raise PredictError(f"engine={engine}: use torch or onnx")
    if engine == "onnx" and device not in ("auto", "cpu"):
        raise PredictError(
            f"engine=onnx runs on the CPU (ONNX Runtime's CPU provider), not device={device}: "
            "pass device=cpu, or engine=torch"
        )
    try:
        return resolve_device("cpu" if engine == "onnx" else device)
    except ValueError as err:
        raise PredictError(str(err)) from err


def _check_output(output: Path, inputs: list[Path], masks: Path | None) -> None:
    try:
        check_output(output, inputs, masks)
    except OutputError as err:
        raise PredictError(str(err)) from err
    if (folder := unwritable_folder(output)) is not None:
        raise PredictError(
            f"output={output}: {folder} is not writable by this user: change its permissions, "
            "or choose another output"
        )


def worker_count(num_workers: int | None, overlays: bool, device: torch.device) -> int:
    """Processes reading and writing files: `num_workers`, or when None one per core, except on a
    GPU writing masks only: half the cores, at most 8, leaving cores to the main thread that drives
    the GPU. With overlays, encoding them bounds the run, so every core writes."""
    if num_workers is not None:
        return num_workers
    cores = os.cpu_count() or 1
    return cores if device.type == "cpu" or overlays else max(1, min(8, cores // 2))


def _true_masks(
    photos: list[Photo], masks: str, index: MaskIndex, mask_threshold: int, num_workers: int
) -> dict[str, TrueMask | str]:
    """Every photo's true mask, read now; refused when none pairs: asked to score, the run would
    score nothing."""
    with ThreadPoolExecutor(num_workers) as pool:
        truths = read_true_masks(photos, index, mask_threshold, pool)
    if photos and not any(isinstance(t, TrueMask) for t in truths.values()):
        raise PredictError(
            f"masks={masks}: no true mask for any of the {len(photos)} photos (first: "
            f"{next(iter(truths.values()))}); a photo's mask has its path below the photo's "
            "input folder and any extension: input=Images masks=Masks pairs "
            "Images/<group>/x.jpg with Masks/<group>/x.png, and a photo given as a file "
            "pairs with <masks>/x.*"
        )
    return truths


def choose_threshold(
    cfg: DictConfig,
    spec: InferenceSpec,
    views: Views,
    net: Net,
    device: torch.device,
    console: Console,
) -> tuple[float, str]:
    """(threshold, where it came from): the checkpoint's, the one given, or the Dice-best on
    validation, its photos run with predict's `views`."""
    if cfg.threshold is None:
        return spec.threshold, "checkpoint"
    if str(cfg.threshold) == "auto":
        choice = auto_threshold(
            net,
            spec,
            views=views,
            device=device,
            batch_size=cfg.batch_size,
            data_root=Path(cfg.data_root) if cfg.data_root else None,
            console=console,
        )
        at_run = (
            f"; {choice.dice_at_run_threshold:.4f} at the run's {spec.threshold:g})"
            if choice.dice_at_run_threshold is not None
            else ")"
        )
        console.print(
            f"threshold=auto: {choice.threshold:.2f} (validation Dice {choice.dice:.4f} over "
            f"{choice.samples} samples{at_run}",
            highlight=False,
            soft_wrap=True,
        )
        return choice.threshold, "auto"
    try:
        value = float(cfg.threshold)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise PredictError(f"threshold={cfg.threshold}: use a number in [0, 1), auto or null")
    return value, "override"
