"""`threshold=auto`: the Dice-best threshold on the run's validation split, computed once.

The sweep scores what predict writes (full-size probabilities, `p > t`, with predict's flips,
scales and tiles) by Dice from pixel counts summed over the split, every threshold in one pass:
per-bin foreground/background counts give TP/FP/FN at each by a cumulative sum. Ties go to the
threshold nearest the run's own. The choice is cached in `threshold.json` beside the checkpoint
(journaled there: `nailseg.io.loose.write_loose`), per checkpoint file (name, size, modification
time) and per setting that changes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from omegaconf import DictConfig
from rich.console import Console
from rich.progress import Progress

from nailseg.errors import UserError
from nailseg.inference.scoring import dice_iou
from nailseg.inference.spec import InferenceSpec, PredictError
from nailseg.inference.views import Views, image_tensors
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import read_regular
from nailseg.io.loose import check_loose, write_loose

if TYPE_CHECKING:
    from nailseg.inference.segmenter import Segmenter

THRESHOLDS = np.round(np.arange(1, 100) / 100, 2)
CACHE_FILE = "threshold.json"
SPLIT = "valid"


class ThresholdError(UserError, ValueError):
    """No threshold can be chosen as asked: the message says what to pass instead."""


@dataclass(frozen=True)
class ThresholdChoice:
    threshold: float
    dice: float  # on the validation split at `threshold`
    iou: float
    dice_at_run_threshold: float | None  # the run's own threshold (None: not on the grid)
    samples: int


def choose_threshold(cfg: DictConfig, model: Segmenter, console: Console) -> tuple[float, str]:
    """(threshold, where it came from): the checkpoint's, the one given, or the Dice-best on
    validation, its photos run as `model` runs photos."""
    spec = model.spec
    if cfg.threshold is None:
        return spec.threshold, "checkpoint"
    if str(cfg.threshold) != "auto":
        try:
            value = float(cfg.threshold)
        except ValueError:
            value = -1.0
        if not 0.0 <= value < 1.0:
            raise PredictError(f"threshold={cfg.threshold}: use a number in [0, 1), auto or null")
        return value, "override"
    root = Path(cfg.data_root) if cfg.data_root else spec.data_root
    if root is None:
        raise ThresholdError("threshold=auto needs the prepared data: pass data_root=PREPARED")
    choice = _auto(model, root, console)
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


def _auto(model: Segmenter, root: Path, console: Console) -> ThresholdChoice:
    """The cached choice for this checkpoint and setting, else a fresh sweep (then cached)."""
    key = _cache_key(model.spec, root, model.views)
    cache = model.spec.ckpt.parent / CACHE_FILE
    entries = _cached(cache)
    for entry in entries or []:
        if entry["key"] == key:
            return ThresholdChoice(**entry["choice"])
    choice = sweep(model, root, console)
    if entries is not None:
        entries = [e for e in entries if e["key"] != key] + [{"key": key, "choice": asdict(choice)}]
        with contextlib.suppress(NotOursError):  # a folder nailseg writes only as another's
            write_loose(cache, json.dumps({"entries": entries}, indent=2).encode())
            return choice
    console.print(
        f"{cache} is not a threshold cache nailseg wrote, or not where it may write: left as it "
        "is, the choice is not cached",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return choice


def _cached(cache: Path) -> list[dict[str, Any]] | None:
    """The cache's entries ([] without one), or None for a file there that nailseg did not write
    (a user's own `threshold.json` beside the checkpoint: never read or replaced)."""
    if not os.path.lexists(cache):
        return []
    try:
        check_loose(cache)
        return json.loads(read_regular(cache))["entries"]
    except (NotOursError, OSError, ValueError, KeyError):
        return None


def _cache_key(spec: InferenceSpec, root: Path, views: Views) -> dict[str, Any]:
    """What the choice depends on: the checkpoint file, the settings, and the validation split's
    rows by content; scales and tiles only when set (a key without them: the whole photo)."""
    stat = spec.ckpt.stat()
    split = Path(root) / f"{SPLIT}.csv"
    rows = hashlib.sha256(split.read_bytes()).hexdigest() if split.is_file() else None
    key = {
        "checkpoint": spec.ckpt.name,
        "checkpoint_bytes": stat.st_size,
        "checkpoint_mtime_ns": stat.st_mtime_ns,
        "tta": views.tta,
        "image_size": list(spec.image_size),
        "mean": list(spec.mean),
        "std": list(spec.std),
        "data_root": str(Path(root).resolve()),
        "split": SPLIT,
        "split_sha256": rows,
    }
    return key | {name: value for name, value in views.record().items() if value is not None}


def sweep(model: Segmenter, root: Path, console: Console) -> ThresholdChoice:
    """Score every threshold in `THRESHOLDS` on the validation split of the prepared `root`."""
    from nailseg.data.datamodule import read_split  # imports Lightning: only this path needs it

    try:
        rows = read_split(Path(root), SPLIT)
    except FileNotFoundError as err:
        raise ThresholdError(f"threshold=auto: {err}; or pass data_root=PREPARED") from err
    if rows.empty:
        raise ThresholdError(f"{root}/{SPLIT}.csv has no rows to choose a threshold on")
    spec, device, batch_size = model.spec, model.device, model.batch_size
    bounds = torch.tensor(THRESHOLDS, dtype=torch.float32, device=device)
    fg = torch.zeros(len(THRESHOLDS) + 1, dtype=torch.long, device=device)
    bg = torch.zeros_like(fg)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"threshold=auto: sweeping {SPLIT}", total=len(rows))
        for start in range(0, len(rows), batch_size):
            chunk = rows.iloc[start : start + batch_size]
            images = image_tensors(
                [np.load(Path(root) / p, allow_pickle=False) for p in chunk["images"]], device
            )
            masks = [np.load(Path(root) / p, allow_pickle=False) for p in chunk["masks"]]
            probs = model.maps(images)
            for prob, mask in zip(probs, masks, strict=True):
                # bin i holds probabilities in (t[i-1], t[i]]: foreground at t[j] for every j < i
                bins = torch.bucketize(prob.flatten(), bounds)
                truth = torch.from_numpy(mask[..., 0] > 0).to(device).flatten()
                fg += torch.bincount(bins[truth], minlength=len(fg))
                bg += torch.bincount(bins[~truth], minlength=len(bg))
            progress.advance(task, len(chunk))
    # predicted foreground at t[j] = the bins above j: reverse cumulative sums from bin j + 1
    tp = fg.flip(0).cumsum(0).flip(0)[1:].cpu().numpy()
    fp = bg.flip(0).cumsum(0).flip(0)[1:].cpu().numpy()
    fn = int(fg.sum()) - tp
    dice, iou = dice_iou(tp, fp, fn)
    best = np.flatnonzero(dice >= dice.max() - 1e-12)
    j = int(best[np.argmin(np.abs(THRESHOLDS[best] - spec.threshold))])
    on_grid = np.flatnonzero(np.isclose(THRESHOLDS, spec.threshold))
    at_run = float(dice[on_grid[0]]) if len(on_grid) else None
    return ThresholdChoice(float(THRESHOLDS[j]), float(dice[j]), float(iou[j]), at_run, len(rows))
