"""The prepared root's on-disk contract: file names, CSV columns, the one CSV reader and writer, and
the ownership marker that lets nailseg tell its own folders from a user's.

Every CSV is read with `keep_default_na=False` and every column but the numeric ones as text, so a
group or file stem named `NA`, `null`, `None` or `nan` stays that string through a rerun and into
training; names with commas, quotes or newlines are quoted by the writer and round-trip.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath

import pandas as pd

from nailseg.io.atomic import write_bytes

CSV_COLUMNS = ["images", "masks", "group", "height", "width", "fg_fraction"]
SPLITS = ("train", "valid", "test")
MARKER_FILE = "prepare.json"  # marks a folder as a prepared root: nailseg writes only into those
MANIFEST_FILE = "manifest.csv"  # every pair whose outputs nailseg wrote and still owns
JOURNAL_FILE = "manifest.journal"  # pairs claimed and converted since the last complete run
EXCLUDED_FILE = "excluded.csv"
LOCK_FILE = ".prepare.lock"
BUILTIN_LOCK_FILE = ".builtin.lock"  # held while a built-in dataset is generated and prepared
SOURCE_FILE = "synthetic_source.json"  # the synthetic set (n, seed, version) the root was made of
ROOT_FILES = frozenset(
    {
        MARKER_FILE,
        MANIFEST_FILE,
        JOURNAL_FILE,
        EXCLUDED_FILE,
        SOURCE_FILE,
        *(f"{s}.csv" for s in SPLITS),
    }
)
NUMERIC_DTYPES = {
    "height": "int64",
    "width": "int64",
    "fg_fraction": "float64",
    "image_mtime_ns": "int64",
    "mask_mtime_ns": "int64",
    "listed": "int64",
}
TEMP_NAME = re.compile(r"\.(?P<target>.+)\.\d+\.tmp")  # nailseg.atomic.temp_path's names


class ForeignFolderError(RuntimeError):
    """A folder nailseg was asked to write into holds files it did not write."""


def split_file(split: str) -> str:
    return f"{split}.csv"


def read_table(path: Path, required: Sequence[str] = ()) -> pd.DataFrame:
    """A CSV written by `write_table`: text columns as `str`, nothing read as missing."""
    dtypes = defaultdict(lambda: str, NUMERIC_DTYPES)
    rows = pd.read_csv(path, dtype=dtypes, keep_default_na=False)
    missing = set(required) - set(rows.columns)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)} (expected {list(required)})")
    return rows


def write_table(path: Path, rows: pd.DataFrame) -> None:
    """Atomically; a name that is not valid Unicode (only ever in a detail) is backslash-escaped."""
    text = rows.to_csv(index=False, float_format="%.6f", lineterminator="\n")
    write_bytes(path, text.encode("utf-8", "backslashreplace"))


def has_marker(folder: Path, marker: str, keys: frozenset[str]) -> bool:
    """Whether `folder/marker` is a JSON object holding `keys`: a marker nailseg wrote."""
    try:
        content = json.loads((folder / marker).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(content, dict) and keys <= content.keys()


def require_owned(folder: Path, marker: str, keys: frozenset[str], ours: re.Pattern[str]) -> None:
    """Raise ForeignFolderError unless `folder` is missing, holds only names that are `ours`, or
    carries its marker: the check that keeps nailseg from writing into a user's folder."""
    if has_marker(folder, marker, keys):
        return
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return
    except NotADirectoryError as err:
        raise ForeignFolderError(f"{folder} is a file, not a folder") from err
    foreign = [name for name in names if not ours.fullmatch(name)]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ForeignFolderError(
            f"{folder} is not empty and has no {marker} written by nailseg, so nailseg did not "
            f"make it: it holds "
            f"{folder / foreign[0]}{more}. Nothing was written; choose a new or empty folder"
        )


def remove_temp_files(root: Path, targets: Iterable[str]) -> None:
    """Temporary files that interrupted runs left (`nailseg.atomic`'s names) for one of `targets`,
    the paths below `root` that nailseg owns there: an atomic write killed before its rename.
    Only plain files: an atomic write makes nothing else, so a folder or link of that name is
    someone else's."""
    targets = set(targets)
    for folder in {PurePosixPath(t).parent for t in targets}:
        try:
            entries = list(os.scandir(root / folder))
        except FileNotFoundError:
            continue
        for entry in entries:
            match = TEMP_NAME.fullmatch(entry.name)
            owned = match and (folder / match["target"]).as_posix() in targets
            if owned and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)


def below(rel: str) -> bool:
    """Whether `rel`, a path read from a listing on disk, names something below its root: not
    empty, not absolute, no `..` (a listing edited by hand or damaged must not reach out)."""
    path = PurePosixPath(rel)
    return bool(rel) and not path.is_absolute() and ".." not in path.parts


def delete_listed(root: Path, rel_paths: Iterable[str]) -> None:
    """Delete the files at `rel_paths` (relative to `root`), taken from a listing of nailseg's
    own outputs (a manifest), and the folders below `root`'s top-level ones that this left empty
    (rmdir: only an empty one goes); nothing the listing does not name. Raises ValueError, before
    deleting any, when a path is not below `root`."""
    rel_paths = list(rel_paths)
    outside = [rel for rel in rel_paths if not below(rel)]
    if outside:
        raise ValueError(f"{root}: {outside[0]!r} is not below it: nothing was deleted")
    for rel in rel_paths:
        path = root / rel
        path.unlink(missing_ok=True)
        folder = path.parent
        while folder.parent != root:
            try:
                folder.rmdir()
            except OSError:
                break
            folder = folder.parent


def new_stamp() -> int:
    """A modification time (ns) to give every file one run writes, so a later run can tell its
    files (still bearing it) from ones put in their place: whole even seconds, which every
    filesystem's timestamps keep exactly, FAT's included."""
    return time.time_ns() // 2_000_000_000 * 2_000_000_000


def stamp_of(path: Path) -> int | None:
    """A file's modification time (ns), None when there is none (not a file, or not there)."""
    try:
        return path.stat().st_mtime_ns if path.is_file() else None
    except OSError:
        return None
