"""What predict and `nailseg.load` are asked, checked before torch is imported: the settings, the
checkpoint file, the device; for predict also the output folder, the photos and every true mask.
A photo's key is its path below its input folder without the extension (`g1/x.JPG` → `g1/x`):
outputs are named by it, a true mask of the same key pairs with it; two files of one key are
both left out, named.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
from omegaconf import DictConfig, OmegaConf

from nailseg.data.augment import rgb_triple
from nailseg.device import available
from nailseg.errors import MissingFile, UserError
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import below, refuse_foreign
from nailseg.io.overlap import overlap
from nailseg.io.permissions import unwritable_folder
from nailseg.model.checkpoint import checkpoint_file
from nailseg.model.scales import scales_problem
from nailseg.prep.imageio import UnreadableImage, binarise, check_mask_threshold, read_mask_values
from nailseg.prep.layout import (
    DUPLICATE_STEM,
    FLAT_GROUP,
    IMAGE_EXTENSIONS,
    NOT_REGULAR,
    UNSUPPORTED,
    files_under,
    special_file,
)


class PredictError(UserError, RuntimeError):
    """A request predict refuses, or a run it cannot finish: the message says why."""


class ExportError(UserError, RuntimeError):
    """An unknown format, or an ONNX model whose outputs disagree with PyTorch's."""


@dataclass(frozen=True)
class Photo:
    """A file to predict and its key (relative path without extension, POSIX)."""

    path: Path
    key: str

    @property
    def group(self) -> str:
        """The first folder of the key (`FLAT_GROUP` for a file at the top): scores per group."""
        parts = PurePosixPath(self.key).parts
        return parts[0] if len(parts) > 1 else FLAT_GROUP


@dataclass(frozen=True)
class Skipped:
    """A file left out and why."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True)
class TrueMask:
    """A true mask, binarised and bit-packed: all are read before predict writes, and fit."""

    path: Path
    shape: tuple[int, int]
    bits: np.ndarray

    @classmethod
    def read(cls, path: Path, threshold: int) -> TrueMask:
        mask, _ = binarise(read_mask_values(path), threshold)
        return cls(path, (mask.shape[0], mask.shape[1]), np.packbits(mask.astype(bool)))

    def array(self) -> np.ndarray:
        """HxW bool."""
        count = self.shape[0] * self.shape[1]
        return np.unpackbits(self.bits, count=count).reshape(self.shape).astype(bool)


@dataclass(frozen=True)
class Request:
    """A checked request: what to predict, where, and on what."""

    output: Path
    device: str  # cuda | cpu
    photos: list[Photo]
    skipped: list[Skipped]  # input files left out, with why
    truths: dict[str, TrueMask | str] | None  # each photo's true mask or why none; None: no scores
    num_workers: int
    gpu_jpeg: bool  # JPEGs decoded on the GPU (nvJPEG), not by the workers
    overlays: bool


def check_settings(cfg: DictConfig) -> str:
    """Predict's values that need no checkpoint, checked; returns where the net runs (cuda, cpu)."""
    if cfg.batch_size < 1:
        raise PredictError(f"batch_size={cfg.batch_size}: must be at least 1")
    if cfg.num_workers is not None and cfg.num_workers < 1:
        raise PredictError(
            f"num_workers={cfg.num_workers}: must be at least 1 (null: see the help)"
        )
    if cfg.threshold is not None and str(cfg.threshold) != "auto":
        try:
            value = float(cfg.threshold)
        except ValueError:
            value = -1.0
        if not 0.0 <= value < 1.0:
            raise PredictError(f"threshold={cfg.threshold}: use a number in [0, 1), auto or null")
    scales = None if cfg.scales is None else list(OmegaConf.to_object(cfg.scales))
    if scales is not None and (problem := scales_problem("scales", scales)):
        raise PredictError(problem)
    if not 0.0 <= cfg.tile.overlap < 1.0:
        raise PredictError(
            f"tile.overlap={cfg.tile.overlap}: must be in [0, 1), a fraction of a tile"
        )
    try:
        check_mask_threshold(cfg.mask_threshold)
    except ValueError as err:
        raise PredictError(str(err)) from err
    check_overrides(cfg, PredictError)
    return _device(cfg.engine, str(cfg.device))


def check_overrides(cfg: DictConfig, error: type[UserError]) -> None:
    """The card's values `cfg` overrides (image_size, mean, std); `error` names a bad one."""
    size = cfg.image_size
    if size is not None and (len(size) != 2 or min(int(side) for side in size) < 1):
        raise error(f"image_size must be [height, width], both >= 1, got {list(size)}")
    try:
        for key in ("mean", "std"):
            if cfg[key] is not None:
                rgb_triple(cfg[key], key, positive=key == "std")
    except ValueError as err:
        raise error(str(err)) from err


def _device(engine: str, device: str) -> str:
    """Where `engine` runs on `device`: ONNX Runtime on the CPU (with `engine=onnx` auto means the
    CPU and a GPU is refused); a GPU this machine lacks is refused, asked of the driver."""
    if engine not in ("torch", "onnx"):
        raise PredictError(f"engine={engine}: use torch or onnx")
    if engine == "onnx" and device not in ("auto", "cpu"):
        raise PredictError(
            f"engine=onnx runs on the CPU (ONNX Runtime's CPU provider), not device={device}: "
            "pass device=cpu, or engine=torch"
        )
    try:
        return "cpu" if engine == "onnx" else available(device)
    except ValueError as err:
        raise PredictError(str(err)) from err


def check_request(cfg: DictConfig) -> Request:
    """`cfg` checked, in this order, before any write and before torch is imported; PredictError
    (or MissingFile, CheckpointError) names the first fault. Every true mask is read here."""
    device = check_settings(cfg)
    checkpoint_file(cfg.ckpt)
    inputs = OmegaConf.to_object(cfg.input) if OmegaConf.is_list(cfg.input) else [cfg.input]
    output, masks = Path(cfg.output), Path(cfg.masks) if cfg.masks else None
    _check_paths(output, [Path(p) for p in inputs], masks)
    num_workers = worker_count(cfg.num_workers, cfg.overlays, device)
    photos, skipped = list_inputs(inputs)
    if not photos and not skipped:
        raise PredictError(f"no image files in input={cfg.input}")
    truths = (
        None if masks is None else read_true_masks(photos, masks, cfg.mask_threshold, num_workers)
    )
    gpu_jpeg = cfg.gpu_decode and device == "cuda"
    return Request(output, device, photos, skipped, truths, num_workers, gpu_jpeg, cfg.overlays)


def _check_paths(output: Path, inputs: list[Path], masks: Path | None) -> None:
    """The output apart from the photos and true masks, the masks apart from the photos (each
    photo would score against itself); the output folder writable and new, empty or predict's."""
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
    if (file := file_in_the_way(output)) is not None:
        raise PredictError(
            f"output={output}: {file} is a file, not a folder; choose another output"
        )
    if (folder := unwritable_folder(output)) is not None:
        raise PredictError(
            f"output={output}: {folder} is not writable by this user: change its permissions, "
            "or choose another output"
        )
    try:
        refuse_foreign(output.absolute(), "predict", "output")
    except NotOursError as err:
        raise PredictError(str(err)) from err


def file_in_the_way(folder: Path) -> Path | None:
    """The file standing where `folder`, or a folder above it, would be made; None: no file."""
    existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    return None if existing.is_dir() else existing


def worker_count(num_workers: int | None, overlays: bool, device: str) -> int:
    """`num_workers`, or one per core; on a GPU writing masks only, half the cores, at most 8,
    leaving cores to the thread that drives the GPU (encoding overlays needs every core)."""
    if num_workers is not None:
        return num_workers
    cores = os.cpu_count() or 1
    return cores if device == "cpu" or overlays else max(1, min(8, cores // 2))


def _key(path: Path, folder: Path) -> str:
    return PurePosixPath(path.relative_to(folder).as_posix()).with_suffix("").as_posix()


def find_images(folder: Path) -> tuple[list[Path], list[Skipped]]:
    """Image files under `folder` found as prepare finds them, and what is left out, with why."""
    names, excluded = files_under(folder)
    images, skipped = [], [Skipped(e.path, f"{e.kind} ({e.detail})") for e in excluded]
    for name in names:
        extension = Path(name).suffix or "(none)"
        if extension.lower() in IMAGE_EXTENSIONS:
            images.append(folder / name)
        else:
            skipped.append(Skipped(folder / name, f"{UNSUPPORTED} (extension {extension!r})"))
    return images, skipped


def _by_key(entries: Iterable[tuple[str, Path]]) -> dict[str, list[Path]]:
    """Each key's files; one file listed twice under its key counts once."""
    found: dict[str, list[Path]] = defaultdict(list)
    seen: set[tuple[str, Path]] = set()
    for key, path in entries:
        if (key, path.resolve()) not in seen:
            seen.add((key, path.resolve()))
            found[key].append(path)
    return found


def list_inputs(inputs: Iterable[str | Path]) -> tuple[list[Photo], list[Skipped]]:
    """Photos from a folder (keys relative to it), a file (key: its stem) or a list of either;
    a special file (a FIFO, say) is skipped unopened. MissingFile names a missing input."""
    entries, skipped = [], []
    for item in map(Path, inputs):
        if item.is_dir():
            images, unlisted = find_images(item)
            entries += [(_key(path, item), path) for path in images]
            skipped += unlisted
        elif (special := special_file(item)) is not None:
            skipped.append(Skipped(item, f"{NOT_REGULAR} ({special})"))
        elif item.is_file():
            entries.append((item.stem, item))
        else:
            raise MissingFile(f"input {item} does not exist")
    photos = []
    for key, paths in sorted(_by_key(entries).items()):
        if len(paths) == 1:
            photos.append(Photo(paths[0], key))
        else:
            names = ", ".join(map(str, paths))
            skipped += [Skipped(p, f"{DUPLICATE_STEM}: {names}") for p in paths]
    return _without_name_clashes(photos, skipped)


def _without_name_clashes(
    photos: list[Photo], skipped: list[Skipped]
) -> tuple[list[Photo], list[Skipped]]:
    """Photos left out, with why, before any write: one whose `<key>.png` is a folder others need
    (`x.jpg` beside `x.png/`), one whose name holds a line break (never written: `folder.below`)."""
    folders: dict[str, Photo] = {}
    for photo in photos:
        for parent in PurePosixPath(photo.key).parents[:-1]:
            folders.setdefault(parent.as_posix(), photo)
    kept = []
    for photo in photos:
        other = folders.get(f"{photo.key}.png")
        if not below(photo.key):
            skipped.append(
                Skipped(photo.path, "its name holds a line break: no output is named so")
            )
        elif other is None:
            kept.append(photo)
        else:
            reason = f"its output {photo.key}.png would be the folder that {other.path}'s needs"
            skipped.append(Skipped(photo.path, reason))
    return kept, skipped


def read_true_masks(
    photos: list[Photo], masks: Path, threshold: int, workers: int
) -> dict[str, TrueMask | str]:
    """Each photo's true mask under `masks`, read now, or why it has none; PredictError when none
    pairs (the run would score nothing), MissingFile when `masks` is not a folder."""
    if not masks.is_dir():
        raise MissingFile(f"masks={masks} is not a folder")
    found, _ = find_images(masks)  # a mask in a folder it cannot list: "no mask"
    index = _by_key((_key(p, masks), p) for p in found)

    def one(photo: Photo) -> TrueMask | str:
        paths = index.get(photo.key, [])
        if not paths:
            return f"no mask {photo.key}.* under {masks}"
        if len(paths) > 1:
            return f"{DUPLICATE_STEM}: {', '.join(map(str, paths))}"
        try:
            return TrueMask.read(paths[0], threshold)
        except UnreadableImage as err:
            return f"mask {err}"

    with ThreadPoolExecutor(workers) as pool:
        truths = dict(zip((p.key for p in photos), pool.map(one, photos), strict=True))
    if photos and not any(isinstance(t, TrueMask) for t in truths.values()):
        raise PredictError(
            f"masks={masks}: no true mask for any of the {len(photos)} photos (first: "
            f"{next(iter(truths.values()))}); a photo's mask has its path below the photo's "
            "input folder and any extension: input=Images masks=Masks pairs "
            "Images/<group>/x.jpg with Masks/<group>/x.png, and a photo given as a file "
            "pairs with <masks>/x.*"
        )
    return truths
