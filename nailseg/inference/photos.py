"""Finding photos to predict and the true masks to score them against.

A photo is known by its key: its path relative to the folder it was found in, without the
extension (`g1/x.JPG` → `g1/x`). Outputs are named by the key (`masks/g1/x.png`), and a true mask
pairs with a photo when it has the same key, whatever either's extension or its case — the rule
`prepare` pairs images and masks by. Two files with one key cannot both be written or matched, so
both are left out with that reason rather than one silently overwriting the other.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from nailseg.errors import MissingFile
from nailseg.prep.imageio import UnreadableImage, binarise, read_mask_values
from nailseg.prep.layout import (
    DUPLICATE_STEM,
    FLAT_GROUP,
    IMAGE_EXTENSIONS,
    NOT_REGULAR,
    UNSUPPORTED,
    files_under,
    special_file,
)


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
    """Image files under `folder` (any case of a known extension) found as prepare finds them:
    recursively, links to folders followed (each real folder once), dotfiles ignored, a link to
    nothing kept (reading it says why); and what is left out, with why, as prepare reports it:
    the folders that could not be listed and the files of other types (a `.webp`, a `.txt`)."""
    names, excluded = files_under(folder)
    images, skipped = [], [Skipped(e.path, f"{e.kind} ({e.detail})") for e in excluded]
    for name in names:
        suffix = Path(name).suffix.lower()
        if suffix in IMAGE_EXTENSIONS:
            images.append(folder / name)
        else:
            extension = Path(name).suffix or "(none)"
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
    a special file (a FIFO, say) is skipped unopened, as a folder's are.

    Raises FileNotFoundError naming an input that does not exist.
    """
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
    """Photos whose output file `<key>.png` would be a folder that other photos' outputs need
    (`x.jpg` beside a folder `x.png/`) left out with that reason, before anything is written."""
    folders: dict[str, Photo] = {}
    for photo in photos:
        for parent in PurePosixPath(photo.key).parents[:-1]:
            folders.setdefault(parent.as_posix(), photo)
    kept = []
    for photo in photos:
        other = folders.get(f"{photo.key}.png")
        if other is None:
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
    photos: Iterable[Photo], index: MaskIndex, threshold: int, pool: Executor
) -> dict[str, TrueMask | str]:
    """Each photo's true mask, or why it has none (not found, two candidates, unreadable)."""

    def one(photo: Photo) -> TrueMask | str:
        path, why = index.find(photo.key)
        if path is None:
            return why or "no mask"
        try:
            return TrueMask.read(path, threshold)
        except UnreadableImage as err:
            return f"mask {err}"

    photos = list(photos)
    return dict(zip((p.key for p in photos), pool.map(one, photos), strict=True))
