"""Find image/mask files in the users' layout and pair them; every file left out gets a reason.

Layout: `<root>/Images/<group>/<name>.<ext>` and `<root>/Masks/<group>/<name>.<ext>`. Groups are the
sub-folders of `Images/` (any names, any number); files directly in `Images/` form the group
`FLAT_GROUP`. An image pairs with the mask of the same group and file stem, whatever either's
extension or its case (`x.JPG` pairs with `x.png`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff"})
FLAT_GROUP = "all"

# Exclusion kinds, in the order the summary lists them.
NO_MASK = "image without mask"
NO_IMAGE = "mask without image"
UNREADABLE = "unreadable or corrupt file"
SIZE_MISMATCH = "image/mask size mismatch"
EMPTY_MASK = "empty mask"
DUPLICATE_STEM = "two files with one stem"
UNSUPPORTED = "not an image file"
EXCLUSION_KINDS = (
    NO_MASK,
    NO_IMAGE,
    UNREADABLE,
    SIZE_MISMATCH,
    EMPTY_MASK,
    DUPLICATE_STEM,
    UNSUPPORTED,
)


@dataclass(frozen=True)
class Pair:
    """An image and its mask; `key` (group/stem, POSIX) names the pair and its outputs."""

    group: str
    stem: str
    image: Path
    mask: Path

    @property
    def key(self) -> str:
        return f"{self.group}/{self.stem}"


@dataclass(frozen=True)
class Exclusion:
    """A file left out, why (`kind`, one of EXCLUSION_KINDS) and the detail a user needs."""

    path: Path
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.kind} ({self.detail})"


def _files(folder: Path) -> list[str]:
    """POSIX paths of the files under `folder`, relative to it, sorted; dot files and folders
    skipped. os.walk reads file types from the directory listing: no stat per file."""
    found = []
    for top, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel_top = PurePosixPath(Path(top).relative_to(folder).as_posix())
        found += [str(rel_top / name) for name in files if not name.startswith(".")]
    return sorted(found)


def _scan(folder: Path) -> tuple[dict[tuple[str, str], list[Path]], list[Exclusion]]:
    """Map (group, stem) → files under `folder`; non-image files are reported, dotfiles ignored."""
    found: dict[tuple[str, str], list[Path]] = defaultdict(list)
    unsupported = []
    for name in _files(folder):
        rel, path = PurePosixPath(name), folder / name
        if rel.suffix.lower() not in IMAGE_EXTENSIONS:
            unsupported.append(
                Exclusion(path, UNSUPPORTED, f"extension {rel.suffix or '(none)'!r}")
            )
            continue
        if len(rel.parts) == 1:
            group, stem = FLAT_GROUP, rel.stem
        else:
            group, stem = rel.parts[0], str(PurePosixPath(*rel.parts[1:]).with_suffix(""))
        found[(group, stem)].append(path)
    return found, unsupported


def find_pairs(root: Path) -> tuple[list[Pair], list[Exclusion]]:
    """Pair every image under `root/Images` with its mask under `root/Masks`.

    Returns pairs sorted by (group, stem) and the files left out, each with its reason. Raises
    FileNotFoundError naming the folder when `Images/` or `Masks/` is missing.
    """
    images_dir, masks_dir = root / "Images", root / "Masks"
    for folder in (images_dir, masks_dir):
        if not folder.is_dir():
            raise FileNotFoundError(
                f"{folder} does not exist: the input folder must hold Images/<group>/<name>.png "
                "and Masks/<group>/<name>.png"
            )
    images, excluded = _scan(images_dir)
    masks, excluded_masks = _scan(masks_dir)
    excluded += excluded_masks

    pairs = []
    for key in sorted(set(images) | set(masks)):
        image_files, mask_files = images.get(key, []), masks.get(key, [])
        if len(image_files) > 1 or len(mask_files) > 1:
            names = ", ".join(p.relative_to(root).as_posix() for p in image_files + mask_files)
            detail = f"cannot tell which files pair: {names}"
            excluded += [Exclusion(p, DUPLICATE_STEM, detail) for p in image_files + mask_files]
            continue
        if not mask_files:
            excluded.append(Exclusion(image_files[0], NO_MASK, f"no Masks/{key}.* found"))
        elif not image_files:
            excluded.append(Exclusion(mask_files[0], NO_IMAGE, f"no Images/{key}.* found"))
        else:
            pairs.append(Pair(group=key[0], stem=key[1], image=image_files[0], mask=mask_files[0]))
    return pairs, excluded
