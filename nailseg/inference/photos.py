"""The photos to predict, read (in predict's worker processes), and their true masks.

A photo is known by its key: its path below the folder it was found in, without the extension
(`g1/x.JPG` → `g1/x`). Outputs are named by the key (`masks/g1/x.png`), and a true mask pairs with
a photo of the same key, whatever either's extension or its case, as prepare pairs them. Two files
with one key are both left out, with that reason, rather than one overwriting the other.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
from PIL import Image

from nailseg.errors import MissingFile
from nailseg.inference.spec import PredictError
from nailseg.io.folder import below
from nailseg.prep.imageio import (
    DECODE_ERRORS,
    UnreadableImage,
    binarise,
    exif_orientation,
    read_mask_values,
    read_rgb,
)
from nailseg.prep.layout import (
    DUPLICATE_STEM,
    FLAT_GROUP,
    IMAGE_EXTENSIONS,
    NOT_REGULAR,
    UNSUPPORTED,
    files_under,
    special_file,
)

JPEG_SUFFIXES = frozenset({".jpg", ".jpeg"})


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


def _key(path: Path, folder: Path) -> str:
    return PurePosixPath(path.relative_to(folder).as_posix()).with_suffix("").as_posix()


def find_images(folder: Path) -> tuple[list[Path], list[Skipped]]:
    """Image files under `folder` found as prepare finds them (recursively, links followed, each
    real folder once, dotfiles ignored, a link to nothing kept: reading it says why), and what is
    left out, with why: folders that could not be listed, files of other types."""
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
    """Each key's files; one file listed twice under its key (an input given twice, or a file
    beside its own folder) counts once."""
    found: dict[str, list[Path]] = defaultdict(list)
    seen: set[tuple[str, Path]] = set()
    for key, path in entries:
        file = (key, path.resolve())
        if file not in seen:
            seen.add(file)
            found[key].append(path)
    return found


def list_inputs(
    inputs: str | Path | Iterable[str | Path],
) -> tuple[list[Photo], list[Skipped]]:
    """Photos from a folder (keys relative to it), a file (key: its stem) or a list of either;
    a special file (a FIFO, say) is skipped unopened. MissingFile names a missing input."""
    if isinstance(inputs, str | Path):
        inputs = [inputs]
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


class MaskIndex:
    """True masks under a folder, looked up by photo key."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise MissingFile(f"masks={self.folder} is not a folder")
        masks, _ = find_images(self.folder)  # a mask in a folder it cannot list: "no mask"
        self._masks = _by_key((_key(p, self.folder), p) for p in masks)

    def find(self, key: str) -> tuple[Path | None, str | None]:
        """(mask, None) for the one mask with this key, else (None, why there is none)."""
        paths = self._masks.get(key, [])
        if len(paths) == 1:
            return paths[0], None
        if not paths:
            return None, f"no mask {key}.* under {self.folder}"
        return None, f"{DUPLICATE_STEM}: {', '.join(map(str, paths))}"


@dataclass(frozen=True)
class TrueMask:
    """A true mask, binarised and bit-packed (one bit a pixel, so a folder of them fits in
    memory: they are all read before predict writes anything)."""

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


def read_true_masks(
    photos: list[Photo], masks: str, threshold: int, workers: int
) -> dict[str, TrueMask | str]:
    """Each photo's true mask under `masks`, read now, or why it has none; PredictError when none
    pairs (the run would score nothing), MissingFile when `masks` is not a folder."""
    index = MaskIndex(masks)

    def one(photo: Photo) -> TrueMask | str:
        path, why = index.find(photo.key)
        if path is None:
            return why or "no mask"
        try:
            return TrueMask.read(path, threshold)
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


@dataclass(frozen=True)
class EncodedJpeg:
    """A JPEG file's bytes (uint8, 1-D) and its EXIF orientation (1: as stored)."""

    data: np.ndarray
    orientation: int


Loaded = np.ndarray | EncodedJpeg  # a photo as read: decoded (RGB uint8 HxWx3), or a JPEG's bytes


def load(photo: Photo, gpu_jpeg: bool) -> Loaded:
    """A JPEG's bytes when the GPU decodes them (`gpu_jpeg`), else the decoded photo (RGB uint8
    HxWx3). Raises UnreadableImage naming the file and the fault."""
    if not (gpu_jpeg and photo.path.suffix.lower() in JPEG_SUFFIXES):
        return read_rgb(photo.path)
    try:
        with Image.open(photo.path) as im:  # the header only: format check and EXIF
            if im.format != "JPEG":
                return read_rgb(photo.path)
            orientation = exif_orientation(im)
        data = np.fromfile(photo.path, dtype=np.uint8)  # read once, writable (torch takes it)
    except DECODE_ERRORS as err:
        raise UnreadableImage(photo.path, f"cannot decode image: {err}") from err
    return EncodedJpeg(data, orientation)


def read_photos(photos: Sequence[Photo], gpu_jpeg: bool) -> list[Loaded | UnreadableImage]:
    """Each photo loaded (`load`), or why it could not be."""
    loaded: list[Loaded | UnreadableImage] = []
    for photo in photos:
        try:
            loaded.append(load(photo, gpu_jpeg))
        except UnreadableImage as err:
            loaded.append(err)
    return loaded
