"""The files a training run writes, replaced or removed only while they are provably its own.

A path is the run's when nothing is there, or the plain file there is one nailseg recorded (in the
run folder's marker, or earlier in this process) and unchanged since: the same size and
modification time, which a moved or copied run folder keeps. Anything else (a user's file, a
link, a file under a linked folder) stays as it is, is never written through, and is named in the
run's summary (`kept`). Outside the run folder only this process's own files count.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from nailseg.io.atomic import NotOursError
from nailseg.io.ownership import (
    ForeignFolderError,
    Record,
    read_marker,
    recorded,
    remove_file,
    write_marker,
)
from nailseg.io.run_folder import RUN_MARKER, record_written

log = logging.getLogger(__name__)


class RunFiles:
    """The records of the files written in `folder`; `persist`: kept in its marker as well (the
    process holding the run folder)."""

    def __init__(self, folder: Path, persist: bool = False) -> None:
        self.folder = Path(os.path.abspath(folder))
        self.persist = persist
        self.kept: list[Path] = []
        self._lock = threading.Lock()
        self._records: dict[Path, Record] | None = None

    def _known(self) -> dict[Path, Record]:
        if self._records is None:
            try:
                marker = read_marker(self.folder, RUN_MARKER, "run")
            except ForeignFolderError:
                marker = None
            self._records = {self.folder / rel: r for rel, r in recorded(marker).items()}
        return self._records

    def is_ours(self, path: str | os.PathLike[str]) -> bool:
        """Whether the file at `path` is one nailseg recorded, unchanged."""
        path = Path(os.path.abspath(path))
        with self._lock:
            record = self._known().get(path)
        found = Record.of(path)
        return (
            record is not None
            and found is not None
            and (found.size, found.mtime_ns) == (record.size, record.mtime_ns)
            and not self._under_link(path)
        )

    def _under_link(self, path: Path) -> bool:
        """Whether a folder between the run folder and `path` is a link."""
        if self.folder not in path.parents:
            return False
        return any(p.is_symlink() for p in path.parents if self.folder in p.parents)

    def may_write(self, path: Path) -> bool:
        free = not os.path.lexists(path) and not self._under_link(path)
        return free or self.is_ours(path)

    def write(self, path: str | os.PathLike[str], write: Callable[[Path], object]) -> bool:
        """`write(path)` (an atomic write of nailseg.io) where `path` is free or the run's, then
        recorded; False, writing nothing, where it is not."""
        path = Path(os.path.abspath(path))
        if not self.may_write(path):
            self._keep(path)
            return False
        write(path)
        self.record(path)
        return True

    def remove(self, path: str | os.PathLike[str]) -> bool:
        """Remove the file at `path` if it is the run's; False, leaving it, where it is not."""
        path = Path(os.path.abspath(path))
        if os.path.lexists(path) and not (self.is_ours(path) and remove_file(path, lambda _: True)):
            self._keep(path)
            return False
        with self._lock:
            self._known().pop(path, None)
            self._save()
        return True

    def record(self, path: Path) -> None:
        """Record the file nailseg has just written at `path`."""
        record = Record.of(path)
        with self._lock:
            if record is not None:
                self._known()[Path(os.path.abspath(path))] = record
            self._save()

    def _keep(self, path: Path) -> None:
        if path not in self.kept:
            self.kept.append(path)
            log.warning("%s is not a file nailseg wrote, so it is left as it is", path)

    def _save(self) -> None:
        if not self.persist:
            return
        marker = read_marker(self.folder, RUN_MARKER, "run")
        if marker is None:
            return
        inside = {p: r for p, r in self._known().items() if self.folder in p.parents}
        marker["files"] = {
            p.relative_to(self.folder).as_posix(): r.as_list() for p, r in sorted(inside.items())
        }
        write_marker(self.folder, RUN_MARKER, marker)

    def record_written_since(self, since_ns: int) -> None:
        """Record the files written in the folder since `since_ns` (the loggers' own too)."""
        if self.persist:
            with self._lock:
                record_written(self.folder, "run", since_ns)
                self._records = None


def refuse_linked_folder(folder: Path, inside: Path) -> None:
    """Raise NotOursError when `inside`, or a folder between `folder` and it, is a link: a file
    written there would land wherever the link points."""
    folder, inside = Path(os.path.abspath(folder)), Path(os.path.abspath(inside))
    if folder not in inside.parents:
        return
    linked = [p for p in (inside, *inside.parents) if folder in p.parents and p.is_symlink()]
    if linked:
        raise NotOursError(
            f"{linked[-1]} is a link where nailseg would make a folder of the run: nailseg never "
            "writes through it; remove it, or choose another run folder"
        )


_held: dict[Path, RunFiles] = {}
_loose: dict[Path, RunFiles] = {}


def run_files(path: str | os.PathLike[str]) -> RunFiles:
    """The records that decide whether `path` may be written: the running run's whose folder
    holds it, else this process's own for its folder."""
    path = Path(os.path.abspath(path))
    for folder, files in _held.items():
        if folder == path or folder in path.parents:
            return files
    return _loose.setdefault(path.parent, RunFiles(path.parent))


@contextmanager
def holding(folder: Path, persist: bool) -> Iterator[RunFiles]:
    """The run's files in `folder` for the block; at its end, with `persist`, every file written
    there meanwhile is recorded in the marker."""
    files = RunFiles(folder, persist)
    _held[files.folder] = files
    started_ns = time.time_ns() - 20_000_000  # file times come from a coarse clock, a tick behind
    try:
        yield files
    finally:
        _held.pop(files.folder, None)
        files.record_written_since(started_ns)
