"""A checkpoint loaded once and run as predict runs it: the Python API (`nailseg.load`), and what
predict and export build on. Input size, normalisation and threshold come from the checkpoint's
card, each overridable; a folder `export format=smp` wrote runs as its checkpoint.

`threshold=auto`: the Dice-best threshold on the run's validation split, of what predict writes,
every threshold in one pass (per-bin foreground/background counts, cumulated); ties go to the
run's own; cached in `threshold.json` beside the checkpoint, per checkpoint file and setting.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from PIL import Image
from rich.console import Console
from rich.progress import Progress

from nailseg.config import CONF_DIR, PredictConfig
from nailseg.device import resolve_device
from nailseg.errors import UserError
from nailseg.inference.engine import GraphedNet, build_engine, capture
from nailseg.inference.request import PredictError, check_settings
from nailseg.inference.views import (
    InferenceSpec,
    Views,
    auto_probabilities,
    image_tensors,
    input_sizes,
    photo_probabilities,
    views_of,
)
from nailseg.inference.workers import dice_iou
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import read_regular
from nailseg.io.loose import check_loose, write_loose
from nailseg.model import checkpoint
from nailseg.prep.imageio import read_rgb

DEFAULT_THRESHOLD = 0.5
# a file (read as predict reads it: EXIF orientation applied), or a uint8 array or PIL image,
# taken as it is; a list or tuple of them gives a list back
Photo = str | os.PathLike | np.ndarray | Image.Image


def resolve_spec(cfg: DictConfig) -> InferenceSpec:
    """The spec for `cfg.ckpt`: its card (or, for a checkpoint older than cards, its run folder's
    plain config values) with `cfg`'s non-null overrides (checked: `check_overrides`) applied."""
    ckpt = checkpoint.checkpoint_file(cfg.ckpt)
    if ckpt.is_dir():
        where = ckpt / checkpoint.CARD_FILE
        try:
            raw = json.loads(read_regular(where))
        except (OSError, ValueError) as err:
            raise checkpoint.CheckpointError(f"{where} cannot be read as a card: {err}") from err
        card = checkpoint.validate_card(raw, str(where))
    else:
        card = checkpoint.card_of(checkpoint.read_checkpoint(ckpt), ckpt)
    if card is None:
        run_dir = checkpoint.run_dir_of(ckpt)
        card = checkpoint.legacy_card(run_dir) if run_dir is not None else {}
    model = cfg.model if cfg.model is not None else card.get("model")
    where = "model" if cfg.model is not None else f"the model recorded in {ckpt}"
    size, mean, std = (
        card.get(k) if cfg[k] is None else cfg[k] for k in ("image_size", "mean", "std")
    )
    if model is None or size is None or mean is None or std is None:
        raise checkpoint.CheckpointError(
            f"{ckpt} carries no description of its model and inputs (a checkpoint written "
            "before nailseg recorded them, away from its run folder): pass model=<unet|"
            "segformer|...>, image_size=[h,w], mean=[...] and std=[...] it was trained with"
        )
    return InferenceSpec(
        ckpt=ckpt,
        model=checkpoint.plain_model(model, where),
        image_size=(int(size[0]), int(size[1])),
        mean=tuple(float(v) for v in mean),
        std=tuple(float(v) for v in std),
        threshold=float(card.get("threshold", DEFAULT_THRESHOLD)),
        data_root=Path(card["data_root"]) if card.get("data_root") else None,
        nail_size=tuple(card["nail_size"]) if card.get("nail_size") else None,
    )


class Segmenter:
    """The checkpoint of `cfg` (predict's config) on its device, run by `cfg.engine` (a CUDA graph
    captured now: a net that cannot be fails first), its threshold as `cfg.threshold` asks."""

    def __init__(self, cfg: DictConfig, console: Console | None = None) -> None:
        check_settings(cfg)
        self.spec = spec = resolve_spec(cfg)
        self.views, self.batch_size = views_of(cfg, spec), cfg.batch_size
        try:
            self.device = resolve_device("cpu" if cfg.engine == "onnx" else str(cfg.device))
        except ValueError as err:
            raise PredictError(str(err)) from err
        sizes = input_sizes(self.views, spec)
        loaded = checkpoint.load_net(spec.ckpt, spec.model)
        self.net = build_engine(cfg.engine, loaded, spec, self.device, cfg.cuda_graphs, sizes)
        self.graphed = isinstance(self.net, GraphedNet)
        self.capture_seconds = (
            capture(self.net, spec, self.batch_size, self.views.tta, sizes) if self.graphed else 0.0
        )
        self.threshold, self.threshold_source = choose_threshold(
            cfg, self, console or Console(stderr=True)
        )

    def maps(self, images: Sequence[torch.Tensor], tta: bool | None = None) -> list[torch.Tensor]:
        """A map per RGB uint8 C×H×W photo on the device, at its size; `tta` None: as loaded."""
        return self.scaled_maps(images, tta)[0]

    def scaled_maps(
        self, images: Sequence[torch.Tensor], tta: bool | None = None
    ) -> tuple[list[torch.Tensor], list[int | None]]:
        """`maps`, and the long side each photo ran at again (`auto_scale`; None: as asked)."""
        views = self.views if tta is None else replace(self.views, tta=tta)
        if views.auto is not None:
            return auto_probabilities(self.net, images, self.spec, views, self.batch_size)
        maps = photo_probabilities(self.net, images, self.spec, views, self.batch_size)
        return maps, [None] * len(maps)

    def probabilities(
        self, photos: Photo | Sequence[Photo], tta: bool | None = None
    ) -> np.ndarray | list[np.ndarray]:
        """Each pixel's nail probability, float32 H×W in [0, 1], at the photo's size."""
        return self._run(photos, tta, None)

    def predict(
        self,
        photos: Photo | Sequence[Photo],
        tta: bool | None = None,
        threshold: float | None = None,
    ) -> np.ndarray | list[np.ndarray]:
        """The mask, uint8 H×W at the photo's size: 1 (nail) where the probability is above
        `threshold` (None: the loaded one), as predict writes it (there 255)."""
        return self._run(photos, tta, self.threshold if threshold is None else threshold)

    def device_maps(
        self, arrays: Iterable[np.ndarray], tta: bool | None = None
    ) -> Iterator[torch.Tensor]:
        """Each RGB uint8 H×W×3 photo's map on the device, `batch_size` at a time, in order."""
        arrays = iter(arrays)
        while batch := list(itertools.islice(arrays, self.batch_size)):
            yield from self.maps(image_tensors(batch, self.device), tta)

    @torch.inference_mode()
    def _run(self, photos, tta: bool | None, threshold: float | None):
        """Photos batched as predict batches them: a list gives what predict writes for them."""
        many = isinstance(photos, list | tuple)
        maps = self.device_maps((_rgb(photo) for photo in (photos if many else [photos])), tta)
        out = [(m if threshold is None else (m > threshold).byte()).cpu().numpy() for m in maps]
        return out if many else out[0]


def load(ckpt: str | os.PathLike, device: str = "auto", **options: Any) -> Segmenter:
    """`nailseg.load`: `ckpt` loaded once on `device`, run as predict runs it; `options`: predict's
    keys (tta, scales, tile, threshold, batch_size, ...; else conf/predict.yaml's)."""
    values = OmegaConf.load(Path(CONF_DIR) / "predict.yaml")
    del values["defaults"], values["hydra"]  # Hydra's, not predict's
    try:
        cfg = OmegaConf.merge(PredictConfig, values, options, {"ckpt": str(ckpt), "device": device})
    except OmegaConfBaseException as err:  # its message runs on with the key's full path
        raise PredictError(f"nailseg.load: {str(err).splitlines()[0]}") from err
    return Segmenter(cfg)


def _rgb(photo: Photo) -> np.ndarray:
    """RGB uint8 H×W×3: a file decoded by predict's decoder, an array or PIL image converted as
    PIL converts (grey repeated, alpha dropped; a shape PIL cannot take is a TypeError)."""
    if isinstance(photo, str | os.PathLike):
        return read_rgb(Path(photo))
    if isinstance(photo, np.ndarray):
        if photo.dtype != np.uint8:  # PIL would clip a float photo in [0, 1] to black
            raise TypeError(f"a photo array must be uint8 (RGB, grey or RGBA), not {photo.dtype}")
        photo = Image.fromarray(photo)
    if isinstance(photo, Image.Image):
        return np.asarray(photo.convert("RGB"))
    raise TypeError(f"a photo is a path, a uint8 array or a PIL image, not {type(photo).__name__}")


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
    """(threshold, its source): the checkpoint's, the one given, or the Dice-best on validation."""
    spec = model.spec
    if cfg.threshold is None:
        return spec.threshold, "checkpoint"
    if str(cfg.threshold) != "auto":  # a number in [0, 1): `check_settings`
        return float(cfg.threshold), "override"
    root = Path(cfg.data_root) if cfg.data_root else spec.data_root
    if root is None:
        raise ThresholdError("threshold=auto needs the prepared data: pass data_root=PREPARED")
    choice = _auto(model, root, console)
    at_run = choice.dice_at_run_threshold
    at_run = "" if at_run is None else f"; {at_run:.4f} at the run's {spec.threshold:g}"
    console.print(
        f"threshold=auto: {choice.threshold:.2f} (validation Dice {choice.dice:.4f} over "
        f"{choice.samples} samples{at_run})",
        highlight=False,
        soft_wrap=True,
    )
    return choice.threshold, "auto"


def _auto(model: Segmenter, root: Path, console: Console) -> ThresholdChoice:
    """The cached choice for this checkpoint and setting, else a fresh sweep (then cached)."""
    key = _cache_key(model.spec, root, model.views)
    cache, entries = model.spec.ckpt.parent / CACHE_FILE, []
    try:  # a file there nailseg did not write (a user's own) is never read nor replaced
        if os.path.lexists(cache):
            check_loose(cache)
            entries = json.loads(read_regular(cache))["entries"]
    except (NotOursError, OSError, ValueError, KeyError):
        entries = None
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
    spec, device = model.spec, model.device
    bounds = torch.tensor(THRESHOLDS, dtype=torch.float32, device=device)
    fg = torch.zeros(len(THRESHOLDS) + 1, dtype=torch.long, device=device)
    bg = torch.zeros_like(fg)
    images = (np.load(Path(root) / path, allow_pickle=False) for path in rows["images"])
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"threshold=auto: sweeping {SPLIT}", total=len(rows))
        for prob, mask in zip(model.device_maps(images), rows["masks"], strict=True):
            # bin i holds probabilities in (t[i-1], t[i]]: foreground at t[j] for every j < i
            bins = torch.bucketize(prob.flatten(), bounds)
            truth = np.load(Path(root) / mask, allow_pickle=False)[..., 0] > 0
            truth = torch.from_numpy(truth).to(device).flatten()
            fg += torch.bincount(bins[truth], minlength=len(fg))
            bg += torch.bincount(bins[~truth], minlength=len(bg))
            progress.advance(task)
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
