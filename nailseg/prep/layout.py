"""Find image/mask files in the users' layout and pair them; every file left out gets a reason.

`<root>/Images/<group>/<name>.<ext>` pairs with `<root>/Masks/<group>/<name>.<ext>` of the same
group and stem, whatever either's extension or its case; files directly in `Images/` form the
group `FLAT_GROUP`. A COCO JSON at `Masks/<sub>/<any>.json` holds masks too: each image entry
pairs with the photo of its file name's stem under `Images/<sub>/`. Symlinked folders are
followed, each real folder once; a FIFO or device is never opened (opening a FIFO waits forever).
"""

from __future__ import annotations

import functools
import os
import stat
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nailseg.errors import PrepareError
from nailseg.prep.coco import CocoMask, read_coco
from nailseg.prep.format import output_paths

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff"})
FLAT_GROUP = "all"
_SPECIAL = {  # files that are neither regular nor folders, by their type
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
}

# Exclusion kinds, in the order the summary lists them
EXCLUSION_KINDS = (
    NO_MASK := "image without mask",
    NO_IMAGE := "mask without image",
    UNREADABLE := "unreadable or corrupt file",
    SIZE_MISMATCH := "image/mask size mismatch",
    ORIENTATION_MISMATCH := "image/mask EXIF orientations disagree",
    EMPTY_MASK := "empty mask",
    DUPLICATE_STEM := "two files with one stem",
    CASE_CLASH := "names that differ only in case or Unicode form (NFC/NFD)",
    NAME_TOO_LONG := "name too long to write",
    NOT_UTF8 := "name not valid UTF-8",
    NOT_REGULAR := "not a regular file",
    FOLDER_TWICE := "folder reached twice (symlink loop or second link)",
    UNLISTABLE := "folder cannot be listed",
    OUTPUT_TAKEN := "output path holds a file nailseg did not write",
    OUTPUT_CLASH := "output paths clash (a file and a folder of one name)",
    UNSUPPORTED := "not an image file",
    COCO_UNUSABLE := "COCO file, image entry or annotation that cannot be used",
)


def display_path(path: os.PathLike[str] | str) -> str:
    """A path as printable text: bytes that are not UTF-8 become `\\xNN` escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class Pair:
    """An image and its mask; `key` (group/stem, POSIX) names the pair and its outputs. A COCO
    mask's `mask` is its entry's label (`CocoMask.label`)."""

    group: str
    stem: str
    image: Path
    mask: Path
    coco: CocoMask | None = None

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
        return f"{display_path(self.path)}: {self.kind} ({self.detail})"


def _is_utf8(name: str) -> bool:
    """False for surrogates: os.fsdecode's stand-ins for bytes that are not UTF-8."""
    return not any("\ud800" <= c <= "\udfff" for c in name)


def special_file(path: Path) -> str | None:
    """What `path` is when it is neither a regular file nor a folder (FIFO, socket, device),
    found without opening it; None otherwise, also for a link to nothing (reading it says why)."""
    try:
        return _SPECIAL.get(stat.S_IFMT(os.stat(path).st_mode))
    except OSError:
        return None


def files_under(folder: Path) -> tuple[list[str], list[Exclusion]]:
    """POSIX paths of the regular files under `folder`, relative to it, sorted (dot files and
    folders skipped), and the folders and special files (stat'ed, never opened) left out."""
    found, excluded = [], []
    seen = {((root := os.stat(folder)).st_dev, root.st_ino)}  # each real folder once

    def unlistable(err: OSError) -> None:
        excluded.append(Exclusion(Path(err.filename), UNLISTABLE, err.strerror or str(err)))

    for top, dirs, files in os.walk(folder, onerror=unlistable, followlinks=True):
        kept = []
        for name in sorted(d for d in dirs if not d.startswith(".")):
            path = Path(top, name)
            try:
                identity = ((st := path.stat()).st_dev, st.st_ino)
            except OSError as err:
                excluded.append(Exclusion(path, UNLISTABLE, err.strerror or str(err)))
                continue
            if identity in seen:
                detail = f"resolves to {display_path(path.resolve())}, scanned already"
                excluded.append(Exclusion(path, FOLDER_TWICE, detail))
                continue
            seen.add(identity)
            kept.append(name)
        dirs[:] = kept
        rel_top = PurePosixPath(Path(top).relative_to(folder).as_posix())
        for name in (name for name in files if not name.startswith(".")):
            if (special := special_file(Path(top, name))) is None:
                found.append(str(rel_top / name))
            else:
                excluded.append(Exclusion(Path(top, name), NOT_REGULAR, special))
    return sorted(found), excluded


def _scan(
    folder: Path, jsons: list[Path] | None = None
) -> tuple[dict[tuple[str, str], list[Path]], list[Exclusion]]:
    """Map (group, stem) → files under `folder`; files and folders that cannot be used are
    reported, dotfiles ignored; `.json` files go to `jsons` when given."""
    found: dict[tuple[str, str], list[Path]] = defaultdict(list)
    names, excluded = files_under(folder)
    for name in names:
        rel, path = PurePosixPath(name), folder / name
        if not _is_utf8(name):
            excluded.append(Exclusion(path, NOT_UTF8, "rename it: the CSVs are UTF-8"))
        elif jsons is not None and rel.suffix.lower() == ".json":
            jsons.append(path)
        elif rel.suffix.lower() not in IMAGE_EXTENSIONS:
            excluded.append(Exclusion(path, UNSUPPORTED, f"extension {rel.suffix or '(none)'!r}"))
        elif len(rel.parts) == 1:
            found[(FLAT_GROUP, rel.stem)].append(path)
        else:
            found[(rel.parts[0], str(PurePosixPath(*rel.parts[1:]).with_suffix("")))].append(path)
    return found, excluded


def _case_clashes(keys: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """Keys that equal another key but for case or Unicode form (NFC/NFD): their outputs would be
    one file on a case-insensitive or normalising filesystem (macOS, Windows)."""
    by_folded: dict[str, list[tuple[str, str]]] = defaultdict(list)
    nfc = functools.partial(unicodedata.normalize, "NFC")
    for key in keys:
        by_folded[nfc(nfc("/".join(key)).casefold())].append(key)
    return {key for same in by_folded.values() if len(same) > 1 for key in same}


def _under(key: tuple[str, str]) -> str:
    """The key's place under `Images/` or `Masks/` (a flat layout's group is no folder)."""
    return key[1] if key[0] == FLAT_GROUP else "/".join(key)


def _coco_masks(
    root: Path, jsons: list[Path], masks: dict[tuple[str, str], list[Path]], image_keys: set
) -> tuple[dict[Path, CocoMask], list[Exclusion]]:
    """The COCO files' entries by label, each label added to `masks` at the key of the one photo
    of its name under `Images/<sub>/` for a file in `Masks/<sub>/`; what cannot be used excluded."""
    by_name = defaultdict(list)
    for key in image_keys:
        by_name[PurePosixPath(key[1]).name].append(key)
    entries, excluded = {}, []
    for path in jsons:
        try:
            found, left_out = read_coco(path)
        except ValueError as err:
            excluded.append(Exclusion(path, COCO_UNUSABLE, str(err)))
            continue
        excluded += [Exclusion(where, COCO_UNUSABLE, why) for where, why in left_out]
        sub = path.parent.relative_to(root / "Masks").as_posix()
        inside = "/" if sub == "." else f"/{sub}/"
        for entry in found:
            stem = PurePosixPath(entry.file_name).stem
            keys = [k for k in by_name[stem] if f"/{_under(k)}".startswith(inside)]
            if len(keys) == 1:
                masks.setdefault(keys[0], []).append(entry.label)
                entries[entry.label] = entry
            else:
                detail = f"{len(keys)} photos named {stem}.* under Images{inside}"
                excluded.append(
                    Exclusion(entry.label, DUPLICATE_STEM if keys else NO_IMAGE, detail)
                )
    return entries, excluded


def find_pairs(root: Path) -> tuple[list[Pair], list[Exclusion]]:
    """Every image under `root/Images` paired with its mask under `root/Masks`, sorted by (group,
    stem), and the files left out, each with its reason; PrepareError when a folder is missing."""
    for folder in (root, root / "Images", root / "Masks"):
        if not folder.is_dir():
            raise PrepareError(
                f"{folder} does not exist: the input folder must hold Images/<group>/<name>.png "
                "and Masks/<group>/<name>.png"
            )
    images, excluded = _scan(root / "Images")
    jsons: list[Path] = []
    masks, excluded_masks = _scan(root / "Masks", jsons)
    coco, excluded_coco = _coco_masks(root, jsons, masks, set(images))
    excluded += excluded_masks + excluded_coco
    clashes = _case_clashes(set(images) | set(masks))
    pairs = []
    for key in sorted(set(images) | set(masks)):
        image_files, mask_files = images.get(key, []), masks.get(key, [])
        files = image_files + mask_files
        names = ", ".join(p.relative_to(root).as_posix() for p in files)
        if key in clashes:
            detail = f"{names} would be one output on a case-insensitive or normalising filesystem"
            excluded += [Exclusion(p, CASE_CLASH, detail) for p in files]
        elif len(image_files) > 1 or len(mask_files) > 1:
            detail = f"cannot tell which files pair: {names}"
            excluded += [Exclusion(p, DUPLICATE_STEM, detail) for p in files]
        elif not mask_files:
            detail = f"no Masks/{_under(key)}.* found"
            excluded.append(Exclusion(image_files[0], NO_MASK, detail))
        elif not image_files:
            detail = f"no Images/{_under(key)}.* found"
            excluded.append(Exclusion(mask_files[0], NO_IMAGE, detail))
        else:
            mask = mask_files[0]
            pairs.append(Pair(key[0], key[1], image_files[0], mask, coco.get(mask)))
    return _output_clashes(pairs, root, excluded)


def _output_clashes(
    pairs: list[Pair], root: Path, excluded: list[Exclusion]
) -> tuple[list[Pair], list[Exclusion]]:
    """Pairs whose output would be a folder of another pair's output (`g/x.png` and
    `g/x.npy/y.png`, names compared without case) are both excluded, each naming the other."""
    outputs = {output_paths(pair.key)[0].casefold(): pair for pair in pairs}
    clashes: dict[str, str] = {}  # pair key -> detail
    for pair in pairs:
        for parent in PurePosixPath(output_paths(pair.key)[0]).parents:
            if (other := outputs.get(parent.as_posix().casefold())) is not None:
                names = " and ".join(p.image.relative_to(root).as_posix() for p in (other, pair))
                detail = f"{names} would write {parent}, as a file and as a folder"
                clashes[pair.key] = clashes[other.key] = detail
    excluded += [
        Exclusion(path, OUTPUT_CLASH, clashes[pair.key])
        for pair in pairs
        if pair.key in clashes
        for path in (pair.image, pair.mask)
    ]
    return [pair for pair in pairs if pair.key not in clashes], excluded


def nothing_usable(
    root: Path, pairs: list[Pair], excluded: list[Exclusion], made: str | None = None
) -> str:
    """The error of a run without a usable pair; `made`: what it created, if anything."""
    if not pairs and not excluded:
        return f"no image files found under {root}/Images and {root}/Masks"
    reasons = Counter(e.kind for e in excluded)
    listed = ", ".join(f"{n} {kind}" for kind, n in reasons.most_common())
    outcome = f"Nothing was converted: {made}" if made else "Nothing was changed"
    return f"no usable image/mask pair in {root}: {listed}; first: {excluded[0]}. {outcome}"
