"""Ownership by identity: what nailseg may replace or delete, and the only code that deletes.

A folder is nailseg's when its marker file is one nailseg wrote (tool, kind, a random id); a file
of that name holding anything else makes the folder foreign: refused, named, never written.
Inside it, a file is replaced or deleted only while it is still the one nailseg recorded
(`Record`, or a writer's own listing); otherwise it is the user's and stays. Links are never
followed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from nailseg.io.atomic import TMP_SUFFIX, NotOursError, refuse_non_file, write_text

TOOL = "nailseg"
MARKER_VERSION = 1
_ID = re.compile(r"[0-9a-f]{32}")
TEMP_NAME = re.compile(rf"\.(?P<target>.+)\.\d+{re.escape(TMP_SUFFIX)}")  # atomic.temp_path's


class ForeignFolderError(NotOursError):
    """A folder nailseg was asked to write into is not provably its own."""


@dataclass(frozen=True)
class Record:
    """What identifies a file nailseg wrote: any edit, replacement or copy changes one of them."""

    size: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, path: str | os.PathLike[str]) -> Record | None:
        """The record of the plain file at `path` (links not followed), None when there is none."""
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        return cls(st.st_size, st.st_mtime_ns, st.st_ino)

    def as_list(self) -> list[int]:
        return [self.size, self.mtime_ns, self.ino]

    @classmethod
    def from_list(cls, values: Any) -> Record | None:
        """A record read back from a marker; None when it is not three integers."""
        if isinstance(values, list) and len(values) == 3 and all(type(v) is int for v in values):
            return cls(*values)
        return None


# what proves a file is still the one nailseg wrote: its record, or a test of its record (a
# writer's own listing may keep only the modification time it stamped the file with)
Proof = Record | Callable[[Record], bool]


def new_marker(kind: str, **fields: Any) -> dict[str, Any]:
    """A marker for a new folder of `kind`; `fields` are the writer's own (settings, records)."""
    return {
        "tool": TOOL,
        "kind": kind,
        "id": secrets.token_hex(16),
        "marker_version": MARKER_VERSION,
    } | (fields)


def is_marker(content: Any, kind: str) -> bool:
    return (
        isinstance(content, dict)
        and content.get("tool") == TOOL
        and content.get("kind") == kind
        and isinstance(content.get("id"), str)
        and bool(_ID.fullmatch(content["id"]))
        and content.get("marker_version") == MARKER_VERSION
    )


def read_marker(folder: Path, name: str, kind: str) -> dict[str, Any] | None:
    """The marker nailseg wrote at `folder/name`; None when nothing has that name. Raises
    ForeignFolderError, naming the folder, when something else does."""
    path = folder / name
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    content = None
    if stat.S_ISREG(mode):
        with contextlib.suppress(OSError, ValueError):
            content = json.loads(path.read_bytes())
    if not is_marker(content, kind):
        raise ForeignFolderError(
            f"{folder} holds a {name} that nailseg did not write (not a nailseg {kind} marker), "
            "so nailseg did not make this folder and writes nothing into it: choose a new or "
            "empty folder"
        )
    return content


def write_marker(folder: Path, name: str, marker: dict[str, Any]) -> None:
    """Write `marker` (atomically; never through a link in its place)."""
    write_text(folder / name, json.dumps(marker, indent=1, sort_keys=True) + "\n")


def require_owned(
    folder: Path, name: str, kind: str, ours: re.Pattern[str]
) -> dict[str, Any] | None:
    """The folder's marker; None when `folder` is missing or holds only names that are `ours` (a
    new folder). Raises ForeignFolderError when it is neither: the check that keeps nailseg from
    writing into a user's folder."""
    marker = read_marker(folder, name, kind)
    if marker is not None:
        return marker
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return None
    except NotADirectoryError as err:
        raise ForeignFolderError(f"{folder} is a file, not a folder") from err
    foreign = [n for n in names if not ours.fullmatch(n)]
    if foreign:
        raise ForeignFolderError(
            f"{folder} is not empty and has no {name} written by nailseg, so nailseg did not "
            f"make it: it holds {first_of(folder, foreign)}. Nothing was written; choose a new "
            "or empty folder"
        )
    return None


def first_of(folder: Path, names: list[str]) -> str:
    """The first of `names` in `folder`, and how many more there are: what a refusal names."""
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return f"{folder / names[0]}{more}"


def records_of(root: Path, rel_paths: Iterable[str]) -> dict[str, list[int]]:
    """The records of the files at `rel_paths` below `root`, as a marker keeps them."""
    found = {rel: Record.of(root / rel) for rel in rel_paths}
    return {rel: record.as_list() for rel, record in sorted(found.items()) if record is not None}


def recorded(marker: dict[str, Any] | None) -> dict[str, Record]:
    """The files a marker records (`files`: path -> record), those below its folder only."""
    files = (marker or {}).get("files")
    if not isinstance(files, dict):
        return {}
    records = {rel: Record.from_list(values) for rel, values in files.items()}
    return {rel: r for rel, r in records.items() if r is not None and below(rel)}


def marker_proofs(marker: dict[str, Any] | None) -> dict[str, Proof]:
    """What a marker shows as nailseg's: each recorded file while it is as written, and whatever
    lies on a path it claims (`claimed`: a run cut short wrote there after checking it free)."""
    proofs: dict[str, Proof] = dict(recorded(marker))
    claimed = (marker or {}).get("claimed", [])
    for rel in claimed if isinstance(claimed, list) else []:
        if isinstance(rel, str) and below(rel):
            proofs.setdefault(rel, lambda _: True)
    return proofs


def stamped(stamp: int) -> Callable[[Record], bool]:
    """The proof of a file a writer stamped with modification time `stamp` and listed so."""
    return lambda found: found.mtime_ns == stamp


def is_ours(path: Path, proof: Proof) -> bool:
    """Whether `path` is a plain file that `proof` shows nailseg wrote."""
    record = Record.of(path)
    if record is None:
        return False
    return record == proof if isinstance(proof, Record) else proof(record)


def remove_file(path: Path, proof: Proof) -> bool:
    """Delete `path` while it is still nailseg's file (`is_ours`); False, leaving it, when it is
    not: the caller names it as the user's. Missing counts as removed."""
    if not os.path.lexists(path):
        return True
    if not is_ours(path, proof):
        return False
    path.unlink(missing_ok=True)
    return True


def replaceable(path: Path, proof: Proof | None) -> bool:
    """Whether nailseg may write at `path`: nothing is there, or the file is provably its own."""
    if not os.path.lexists(path):
        return True
    return proof is not None and is_ours(path, proof)


def below(rel: str) -> bool:
    """Whether `rel`, a path read from a listing on disk, names something below its root: not
    empty, not absolute, no `..` (a listing edited by hand or damaged must not reach out)."""
    path = PurePosixPath(rel)
    return bool(rel) and not path.is_absolute() and ".." not in path.parts


def delete_listed(root: Path, listed: Mapping[str, Proof]) -> list[Path]:
    """Delete the files at `listed`'s paths (relative to `root`, from a listing of nailseg's own
    outputs) that are still nailseg's by their proof, and the folders below `root`'s top-level
    ones that this left empty (rmdir: only an empty one goes). Returns the listed files left as
    the user's. Raises ValueError, before deleting any, when a path is not below `root`."""
    outside = [rel for rel in listed if not below(rel)]
    if outside:
        raise ValueError(f"{root}: {outside[0]!r} is not below it: nothing was deleted")
    kept = []
    for rel, proof in listed.items():
        path = root / rel
        if not remove_file(path, proof):
            kept.append(path)
            continue
        folder = path.parent
        while folder.parent != root and remove_empty_folder(folder):
            folder = folder.parent
    return kept


def remove_empty_folder(folder: Path) -> bool:
    """rmdir: only an empty folder goes (never a link); whether it went."""
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


def remove_temp_files(root: Path, targets: Iterable[str]) -> None:
    """Temporary files that interrupted runs left (`atomic.temp_path`'s names) for one of
    `targets`, the paths below `root` that nailseg owns there: an atomic write killed before its
    rename. Only plain files: an atomic write makes nothing else, so a folder or link of that
    name is someone else's."""
    targets = set(targets)
    for folder in {PurePosixPath(t).parent for t in targets}:
        try:
            entries = list(os.scandir(root / folder))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            match = TEMP_NAME.fullmatch(entry.name)
            owned = match and (folder / match["target"]).as_posix() in targets
            if owned and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)


def make_folder(folder: Path) -> Path:
    """`folder` and its missing parents."""
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def open_append(path: Path) -> int:
    """A descriptor appending to the file at `path` (made if missing); a link there is refused,
    never followed."""
    refuse_non_file(path)
    return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)


def truncate(path: Path, size: int | None) -> None:
    """Back to `size` bytes (a file nailseg appends to); None: it did not exist, it goes."""
    if size is None:
        path.unlink(missing_ok=True)
    else:
        os.truncate(path, size)


@contextmanager
def scratch_folder(parent: Path | None = None, prefix: str = ".nailseg-") -> Iterator[Path]:
    """A folder made for this process alone (`mkdtemp`: a name no one else's can have; in the
    system's temporary folder when `parent` is None) and removed whole when the block ends:
    everything in it is this process's."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def hard_link(source: Path, target: Path) -> None:
    """`target` as another name of `source` (a new name: an existing one is refused)."""
    os.link(source, target)


def claim_files(folder: Path, ledger: str, kind: str, rels: Iterable[str]) -> None:
    """Raise NotOursError, before any write, when a file at one of `rels` in `folder` is not one
    the writer's ledger (a marker of `kind` at `folder/ledger`) records as written and unchanged:
    for a writer whose few files go into a folder that is not its own (compare's into a sweep)."""
    files = recorded(read_marker(folder, ledger, kind))
    for rel in rels:
        if not replaceable(folder / rel, files.get(rel)):
            raise NotOursError(
                f"{folder / rel} is not a file nailseg wrote there (not recorded in "
                f"{folder / ledger}, or changed since), so it is not replaced: nothing was "
                "written; move it away"
            )


def record_files(folder: Path, ledger: str, kind: str, rels: Iterable[str]) -> None:
    """Record the files at `rels` in `folder`'s ledger (see `claim_files`), made if missing."""
    marker = read_marker(folder, ledger, kind) or new_marker(kind)
    marker["files"] = marker.get("files", {}) | records_of(folder, rels)
    write_marker(folder, ledger, marker)
