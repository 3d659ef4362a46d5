"""Find image/mask files in the users' layout and pair them; every file left out gets a reason.

Layout: `<root>/Images/<group>/<name>.<ext>` and `<root>/Masks/<group>/<name>.<ext>`. Groups are the
sub-folders of `Images/` (any names, any number); files directly in `Images/` form the group
`FLAT_GROUP`. An image pairs with the mask of the same group and file stem, whatever either's
extension or its case (`x.JPG` pairs with `x.png`). A COCO instance JSON at `Masks/<sub>/<any>.json`
holds masks too (`nailseg.prep.coco`): each image entry pairs with the photo under `Images/<sub>/`
of its file name's stem, in any group when the JSON lies directly in `Masks/`.

Nothing is skipped silently: symlinked folders are followed, and a folder reached a second time (a
symlink loop, or two links to one folder, which would put the same photos in two places) is listed
as excluded; so is a folder that cannot be listed, a name that is not valid UTF-8 (it could not be
written to the CSVs), names that differ only in case or Unicode normalisation (NFC/NFD: one file
on macOS and Windows), a name too long to write, and a special file (a FIFO, socket or device),
which is never opened: opening a FIFO waits for a writer, forever.
"""

from __future__ import annotations

import os
import stat
import unicodedata
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from nailseg.errors import MissingFile
from nailseg.prep.coco import CocoMask, read_coco

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff"})
FLAT_GROUP = "all"

# Exclusion kinds, in the order the summary lists them.
NO_MASK = "image without mask"
NO_IMAGE = "mask without image"
UNREADABLE = "unreadable or corrupt file"
SIZE_MISMATCH = "image/mask size mismatch"
ORIENTATION_MISMATCH = "image/mask EXIF orientations disagree"
EMPTY_MASK = "empty mask"
DUPLICATE_STEM = "two files with one stem"
CASE_CLASH = "names that differ only in case or Unicode form (NFC/NFD)"
NAME_TOO_LONG = "name too long to write"
NOT_REGULAR = "not a regular file"
NOT_UTF8 = "name not valid UTF-8"
FOLDER_TWICE = "folder reached twice (symlink loop or second link)"
UNLISTABLE = "folder cannot be listed"
OUTPUT_TAKEN = "output path holds a file nailseg did not write"
OUTPUT_CLASH = "output paths clash (a file and a folder of one name)"
UNSUPPORTED = "not an image file"
COCO_UNUSABLE = "COCO file, image entry or annotation that cannot be used"
EXCLUSION_KINDS = (
    NO_MASK,
    NO_IMAGE,
    UNREADABLE,
    SIZE_MISMATCH,
    ORIENTATION_MISMATCH,
    EMPTY_MASK,
    DUPLICATE_STEM,
    CASE_CLASH,
    NAME_TOO_LONG,
    NOT_UTF8,
    NOT_REGULAR,
    FOLDER_TWICE,
    UNLISTABLE,
    OUTPUT_TAKEN,
    OUTPUT_CLASH,
    UNSUPPORTED,
    COCO_UNUSABLE,
)


def display_path(path: os.PathLike[str] | str) -> str:
    """A path as printable text: bytes that are not UTF-8 become `\\xNN` escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class Pair:
    """An image and its mask; `key` (group/stem, POSIX) names the pair and its outputs. A COCO
    mask's `mask` is its entry's label; `mask_file`, the JSON, is the file read."""

    group: str
    stem: str
    image: Path
    mask: Path
    coco: CocoMask | None = None

    @property
    def key(self) -> str:
        return f"{self.group}/{self.stem}"

    @property
    def mask_file(self) -> Path:
        return self.mask if self.coco is None else self.coco.json


@dataclass(frozen=True)
class Exclusion:
    """A file left out, why (`kind`, one of EXCLUSION_KINDS) and the detail a user needs."""

    path: Path
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{display_path(self.path)}: {self.kind} ({self.detail})"


def _is_utf8(name: str) -> bool:
    try:
        name.encode()
    except UnicodeEncodeError:  # os.fsdecode turned undecodable bytes into lone surrogates
        return False
    return True


def special_file(path: Path) -> str | None:
    """What `path` is when it is neither a regular file nor a folder (\"FIFO\", \"socket\",
    \"character device\", \"block device\"), found without opening it; None otherwise, also for
    a link to nothing (reading it says why)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    kinds = (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    )
    return next((name for test, name in kinds if test(mode)), None)


def files_under(folder: Path) -> tuple[list[str], list[Exclusion]]:
    """POSIX paths of the regular files under `folder`, relative to it, sorted (dot files and
    folders skipped), and the folders and special files left out. Symlinked folders are followed,
    each real folder once; each file is stat'ed, never opened, to tell a special file."""
    found, excluded = [], []
    seen = {_identity(folder)}

    def unlistable(err: OSError) -> None:
        excluded.append(Exclusion(Path(err.filename), UNLISTABLE, err.strerror or str(err)))

    for top, dirs, files in os.walk(folder, onerror=unlistable, followlinks=True):
        kept = []
        for name in sorted(d for d in dirs if not d.startswith(".")):
            path = Path(top, name)
            try:
                identity = _identity(path)
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
        for name in files:
            if name.startswith("."):
                continue
            special = special_file(Path(top, name))
            if special is None:
                found.append(str(rel_top / name))
            else:
                excluded.append(Exclusion(Path(top, name), NOT_REGULAR, special))
    return sorted(found), excluded


def _identity(folder: Path) -> tuple[int, int]:
    stat = folder.stat()
    return stat.st_dev, stat.st_ino


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
    """Keys that equal another key but for case or Unicode normalisation (`é` as one code point,
    NFC, or as `e` and an accent, NFD): their outputs would be one file on a case-insensitive or
    normalising filesystem (macOS, Windows), so neither can be told apart safely."""
    by_folded: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for key in keys:
        folded = unicodedata.normalize(
            "NFC", unicodedata.normalize("NFC", "/".join(key)).casefold()
        )
        by_folded[folded].append(key)
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
    """Pair every image under `root/Images` with its mask under `root/Masks`.

    Returns pairs sorted by (group, stem) and the files left out, each with its reason. Raises
    FileNotFoundError naming the folder when `Images/` or `Masks/` is missing.
    """
    images_dir, masks_dir = root / "Images", root / "Masks"
    for folder in (images_dir, masks_dir):
        if not folder.is_dir():
            raise MissingFile(
                f"{folder} does not exist: the input folder must hold Images/<group>/<name>.png "
                "and Masks/<group>/<name>.png"
            )
    images, excluded = _scan(images_dir)
    jsons: list[Path] = []
    masks, excluded_masks = _scan(masks_dir, jsons)
    excluded += excluded_masks
    coco, excluded_coco = _coco_masks(root, jsons, masks, set(images))
    excluded += excluded_coco
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
    return pairs, excluded
