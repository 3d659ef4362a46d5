"""`threshold=auto`: the Dice-best threshold on the run's validation split, computed once.

The sweep scores what predict writes (full-size probabilities, `p > t`, with predict's flips,
scales and tiles) by Dice from pixel counts summed over the split. All `THRESHOLDS` are scored in one pass: per-bin foreground/background
counts of the probabilities give TP/FP/FN at every threshold by a cumulative sum. Ties go to the
threshold nearest the run's own. The choice is cached in `threshold.json` beside the checkpoint,
per checkpoint file (name, size, modification time) and per setting that changes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress

from nailseg.errors import UserError
from nailseg.inference.scoring import dice_iou
from nailseg.inference.spec import InferenceSpec, Net, image_tensors
from nailseg.inference.views import Views, photo_probabilities
from nailseg.io.atomic import write_text

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


def auto_threshold(
    net: Net,
    spec: InferenceSpec,
    *,
    views: Views,
    device: torch.device,
    batch_size: int,
    data_root: Path | None = None,
    console: Console | None = None,
) -> ThresholdChoice:
    """The cached choice for this checkpoint and setting, else a fresh sweep (then cached)."""
    root = data_root or spec.data_root
    if root is None:
        raise ThresholdError("threshold=auto needs the prepared data: pass data_root=PREPARED")
    key = _cache_key(spec, root, views)
    cache = spec.ckpt.parent / CACHE_FILE
    entries = _cached(cache)
    for entry in entries or []:
        if entry["key"] == key:
            return ThresholdChoice(**entry["choice"])
    choice = sweep(
        net, spec, root, views=views, device=device, batch_size=batch_size, console=console
    )
    if entries is None:
        (console or Console()).print(
            f"{cache} is not a threshold cache nailseg wrote: left as it is, the choice is not "
            "cached",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return choice
    entries = [e for e in entries if e["key"] != key] + [{"key": key, "choice": asdict(choice)}]
    write_text(cache, json.dumps({"entries": entries}, indent=2))
    return choice


def _cached(cache: Path) -> list[dict[str, Any]] | None:
    """The cache's entries ([] without one), or None for a file of that name that is not one
    this module wrote (a user's own `threshold.json` beside the checkpoint: never read or
    replaced)."""
    if not cache.is_file():
        return []
    try:
        content = json.loads(cache.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    entries = content.get("entries") if isinstance(content, dict) and len(content) == 1 else None
    if not isinstance(entries, list):
        return None
    fields = {f.name for f in dataclasses.fields(ThresholdChoice)}
    ours = all(
        isinstance(e, dict)
        and set(e) == {"key", "choice"}
        and isinstance(e["choice"], dict)
        and set(e["choice"]) == fields
        for e in entries
    )
    return entries if ours else None


def _cache_key(spec: InferenceSpec, root: Path, views: Views) -> dict[str, Any]:
    """What the choice depends on: the checkpoint file, the settings, and the validation split's
    rows by content (data prepared again, with other masks or pairs, gives another key). Scales
    and tiles are keyed only when set: a key without them is a whole photo at the input size."""
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


def sweep(
    net: Net,
    spec: InferenceSpec,
    root: Path,
    *,
    views: Views,
    device: torch.device,
    batch_size: int,
    console: Console | None = None,
) -> ThresholdChoice:
    """Score every threshold in `THRESHOLDS` on the validation split of the prepared `root`."""
    from nailseg.data.datamodule import read_split  # imports Lightning: only this path needs it

    try:
        rows = read_split(Path(root), SPLIT)
    except FileNotFoundError as err:
        raise ThresholdError(f"threshold=auto: {err}; or pass data_root=PREPARED") from err
    if rows.empty:
        raise ThresholdError(f"{root}/{SPLIT}.csv has no rows to choose a threshold on")
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
            probs = photo_probabilities(net, images, spec, views, batch_size)
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
    return ThresholdChoice(
        threshold=float(THRESHOLDS[j]),
        dice=float(dice[j]),
        iou=float(iou[j]),
        dice_at_run_threshold=float(dice[on_grid[0]]) if len(on_grid) else None,
        samples=len(rows),
    )
