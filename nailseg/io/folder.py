"""One way to own a folder: every writer of nailseg claims its folder here (docs/FAULTS.md).

The marker `.nailseg.json` (tool, kind, a random id, the folder's device and inode: a copy is known
as one) makes a folder nailseg's; the journal `.nailseg.journal` lists a JSON line per file written
(size, mtime, inode), removed, or reserved for a library while it writes (then `adopt`ed). Only
what the journal proves is replaced or removed; writes are atomic and never go through a link or
into a hard-linked file in place. A claim holds the folder's `flock` (it dies with the process).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from nailseg.io.atomic import NotOursError, refuse_non_file, write_atomic

MARKER = ".nailseg.json"
JOURNAL = ".nailseg.journal"
OWN_NAMES = frozenset({MARKER, JOURNAL})
VERSION = 2


class ForeignFolderError(NotOursError):
    """A folder nailseg was asked to write into is not provably its own."""


class BusyError(NotOursError):
    """Another live process holds the folder."""


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
        return cls(st.st_size, st.st_mtime_ns, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def below(rel: str) -> bool:
    """Whether `rel` (a path read off disk or from a user) names something below its root: not
    empty, not absolute, no `..`, no line separator."""
    path = PurePosixPath(rel)
    clean = not any(c in rel for c in "\n\r\0")
    return bool(rel) and clean and not path.is_absolute() and ".." not in path.parts


def read_regular(path: Path, limit: int | None = None) -> bytes:
    """The bytes of the plain file at `path`; a link, FIFO or folder there is refused (reading a
    FIFO would wait forever), `limit`: at most that many bytes are read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotOursError(f"{path} is not a plain file: it is not read")
        return f.read() if limit is None else f.read(limit)


def _home(folder: Path) -> list[int]:
    st = os.stat(folder)
    return [st.st_dev, st.st_ino]


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The marker nailseg wrote in `folder`; None when it has none or one nailseg did not write."""
    try:
        content = json.loads(read_regular(folder / MARKER, 1 << 20))
    except (OSError, ValueError, NotOursError):  # none, not JSON, or not a plain file
        return None
    types = {"tool": str, "version": int, "kind": str, "id": str, "home": list}
    ok = isinstance(content, dict) and all(type(content.get(k)) is t for k, t in types.items())
    return content if ok and (content["tool"], content["version"]) == ("nailseg", VERSION) else None


def is_copy(folder: Path, marker: dict[str, Any]) -> bool:
    """Whether `folder` is a copy of the nailseg folder its marker was written in (`cp -a`, a
    restored backup): the original is the folder of that device and inode."""
    try:
        return marker["home"] != _home(folder)
    except OSError:
        return True


def _first_foreign(folder: Path, names: Iterable[str]) -> str:
    names = sorted(names)
    return f"{folder / names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def _added(rel: str, r: Record) -> dict[str, Any]:
    return {"op": "add", "path": rel, "rec": [r.size, r.mtime_ns, r.ino]}


class Journal:
    """What nailseg wrote in one folder: path -> Record, and the paths reserved for libraries."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.files: dict[str, Record] = {}
        self.reserved: dict[str, bool] = {}  # path -> lasting (never adopted)
        try:
            text = read_regular(folder / JOURNAL).decode("utf-8", "surrogateescape")
        except (FileNotFoundError, NotOursError):  # none, or not a file nailseg wrote: no proof
            text = ""
        lines = text.splitlines()
        self.lines = len(lines)
        for line in lines:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                self._apply(json.loads(line))

    def _apply(self, entry: dict[str, Any]) -> None:
        rel = entry["path"]
        if not isinstance(rel, str) or not below(rel):
            return
        if entry["op"] == "add" and all(type(v) is int for v in entry["rec"]):
            self.files[rel] = Record(*entry["rec"])
        elif entry["op"] == "del":
            self.files.pop(rel, None)
            self.reserved.pop(rel, None)
        elif entry["op"] == "reserve":
            self.reserved[rel] = entry.get("lasting") is True
        elif entry["op"] == "adopt":
            self.reserved.pop(rel, None)

    def append(self, entries: list[dict[str, Any]]) -> None:
        """Journal `entries` (one `write` of whole lines, appended: workers of one command may
        append at once)."""
        for entry in entries:
            self._apply(entry)
        data = "".join(json.dumps(e, ensure_ascii=True) + "\n" for e in entries).encode()
        path = self.folder / JOURNAL
        refuse_non_file(path)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with os.fdopen(os.open(path, flags, 0o644), "wb", buffering=0) as f:
            f.write(data)

    def add(self, rel: str, at: Path | None = None) -> None:
        """Journal the file nailseg wrote at `rel` (or is about to rename from `at` to `rel`)."""
        found = Record.of(at or self.folder / rel)
        if found is not None:
            self.append([_added(rel, found)])

    def proves(self, rel: str) -> bool:
        """Whether the file at `rel` is nailseg's: recorded and unchanged, or under a reserved path."""
        found = Record.of(self.folder / rel)
        return found is not None and (self.files.get(rel) == found or self.reserves(rel))

    def reserves(self, rel: str) -> bool:
        parts = PurePosixPath(rel).parts
        return any("/".join(parts[:n]) in self.reserved for n in range(1, len(parts) + 1))

    def compact(self) -> None:
        """Rewrite the journal as what holds now: the files still as recorded, the reservations."""
        self.files = {rel: r for rel, r in self.files.items() if Record.of(self.folder / rel) == r}
        lines = [
            {"op": "reserve", "path": p, "lasting": v} for p, v in sorted(self.reserved.items())
        ]
        lines += [_added(rel, r) for rel, r in sorted(self.files.items())]
        text = "".join(json.dumps(e, ensure_ascii=True) + "\n" for e in lines)
        write_atomic(self.folder / JOURNAL, lambda f: f.write(text.encode()))


_claimed: dict[Path, OwnedFolder] = {}  # this process's folders, so a second claim is the same one


class OwnedFolder:
    """A folder nailseg claimed for `kind` (see the module docstring). Claim with `claim`; a
    worker process of the same command attaches with `attach`."""

    def __init__(self, path: Path, marker: dict[str, Any], fd: int | None) -> None:
        self.path = path
        self.marker = marker
        self.kind: str = marker["kind"]
        self.id: str = marker["id"]
        self._fd = fd
        self.journal = Journal(path)
        self.kept: list[Path] = []  # files in the way that were left as the user's

    @classmethod
    def claim(
        cls,
        path: str | os.PathLike[str],
        kind: str,
        *,
        key: str = "the output folder",
        wait_s: float = 0.0,
    ) -> OwnedFolder:
        """The folder at `path` as nailseg's `kind`: made and marked when missing or empty, opened
        when it is nailseg's of that kind, and locked for this process.

        Raises:
            ForeignFolderError: the folder holds files but no marker of `kind` (a user's), a link,
                or is a copy of a nailseg folder; the message names it and `key`.
            BusyError: another process holds it for longer than `wait_s`.
        """
        folder = Path(os.path.abspath(path))
        if folder in _claimed:
            return _claimed[folder]
        refuse_linked(folder)
        folder.mkdir(parents=True, exist_ok=True)
        fd = _locked(folder, wait_s, False, key)
        try:
            marker = _marker_for(folder, kind, key)
            refuse_non_file(folder / JOURNAL)  # a FIFO there: refused, never read nor appended to
        except BaseException:
            os.close(fd)
            raise
        owned = _claimed[folder] = cls(folder, marker, fd)
        journal = owned.journal  # rewritten when a hard-linked snapshot shares it (it must not
        # grow with this one's) or when stale lines outnumber the live ones
        linked = os.path.lexists(folder / JOURNAL) and os.lstat(folder / JOURNAL).st_nlink > 1
        if linked or journal.lines > 2 * (len(journal.files) + len(journal.reserved)) + 64:
            journal.compact()
        owned._remove_temp_files()
        owned.adopt()  # what a killed process's libraries wrote
        return owned

    @classmethod
    def attach(cls, path: str | os.PathLike[str]) -> OwnedFolder:
        """The folder another process of this command claimed (a worker's view: no lock)."""
        folder = Path(os.path.abspath(path))
        marker = read_marker(folder)
        if marker is None:
            raise ForeignFolderError(f"{folder} has no nailseg marker")
        return cls(folder, marker, None)

    def release(self) -> None:
        """Drop the lock (the process's end drops it too); a writer first removes what writes
        killed before their rename left of the paths it wrote since its claim."""
        _claimed.pop(self.path, None)
        if self._fd is not None:
            self._remove_temp_files()
            self.adopt()
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OwnedFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def update_marker(self, **fields: Any) -> None:
        """Keep `fields` (a writer's own settings or state) in the marker."""
        identity = {k: self.marker[k] for k in ("tool", "version", "kind", "id", "home")}
        self.marker = {**self.marker, **fields, **identity}
        _write_marker(self.path, self.marker)

    def file(self, rel: str) -> Path:
        """The path of `rel` in the folder; refuses a path that leaves it or passes a link."""
        if not below(rel):
            raise NotOursError(f"{rel!r} is not a path below {self.path}")
        path = self.path / rel
        refuse_linked(path, self.path)
        return path

    def owns(self, rel: str) -> bool:
        return self.journal.proves(rel)

    def may_write(self, rel: str) -> bool:
        path = self.file(rel)
        return not os.path.lexists(path) or self.owns(rel)

    def check_free(self, rels: Iterable[str]) -> None:
        """Raise NotOursError, before any write, when a file that is not nailseg's lies at one of
        `rels`."""
        taken = [rel for rel in rels if not self.may_write(rel)]
        if taken:
            raise NotOursError(
                f"{_first_foreign(self.path, taken)} lies where nailseg would write, and nailseg "
                "did not write it (or it changed since), so it is not replaced: nothing was "
                "written; move it away, or choose another folder"
            )

    def write(
        self, rel: str, data: bytes | Callable[[BinaryIO], object], *, strict: bool = True
    ) -> Path | None:
        """Write `data` (bytes, or a function writing into the file) at `rel`, atomically, and
        journal it. A file there that is not nailseg's raises NotOursError (`strict`) or is left,
        named in `kept`, and None returned."""
        path = self.file(rel)
        if os.path.lexists(path) and not self.owns(rel):
            if strict:
                self.check_free([rel])
            self._keep(path)
            return None
        write = data if callable(data) else (lambda f, data=data: f.write(data))
        # journaled before its rename: a kill right after the rename leaves it nailseg's
        write_atomic(path, write, before_rename=lambda tmp: self.record(rel, tmp))
        return path

    def record(self, rel: str, at: Path | None = None) -> None:
        """Journal the file nailseg has just written at `rel` (atomically, by its own code), or
        is about to rename from `at` to `rel` (a rename keeps size, times and inode)."""
        self.journal.add(rel, at)

    def reserve(self, rel: str, lasting: bool = False) -> Path:
        """Make `rel` (where a library is about to write) nailseg's, all under it included, until
        `adopt` (`lasting`: for good; a library writing after the command) if all there is ours."""
        path = self.file(rel)
        if rel not in self.journal.reserved:
            self.check_free(self._files(rel))
            self.journal.append([{"op": "reserve", "path": rel, "lasting": lasting}])
        return path

    def adopt(self) -> None:
        """End the reservations but the lasting: what the libraries wrote under them is journaled
        file by file, so a file put there later is not nailseg's (at a release, and at the next
        claim after a kill). Links hold nothing of anyone's (W&B makes some), never followed."""
        entries = []
        for rel in sorted(rel for rel, lasting in self.journal.reserved.items() if not lasting):
            found = ((f, Record.of(self.path / f)) for f in self._files(rel))
            entries += [_added(f, r) for f, r in found if r is not None]
            entries.append({"op": "adopt", "path": rel})
        if entries:
            self.journal.append(entries)

    def _files(self, rel: str) -> list[str]:
        """The paths of the files (not links) at or under `rel`."""
        top = self.path / rel
        walk = [] if top.is_symlink() else os.walk(top)
        files = [Path(d, name) for d, _, names in walk for name in names] or [top]
        return [f.relative_to(self.path).as_posix() for f in files if Record.of(f) is not None]

    def remove(self, rel: str) -> bool:
        """Remove the file at `rel` while it is nailseg's; False (named in `kept`) when it is not."""
        path = self.file(rel)
        if not os.path.lexists(path):
            return True
        if not self.owns(rel):
            self._keep(path)
            return False
        path.unlink()
        self.journal.append([{"op": "del", "path": rel}])
        remove_empty_parents(path.parent, self.path)
        return True

    def prune(self, keep: Iterable[str]) -> None:
        """Remove every journaled file but `keep`."""
        self.journal = Journal(self.path)  # what worker processes journaled meanwhile too
        for rel in sorted(set(self.journal.files) - set(keep)):
            self.remove(rel)

    def open_append(self, rel: str) -> int:
        """A descriptor appending to nailseg's file at `rel` (made when missing). A file of
        several names (a hard-linked snapshot) is first replaced by a copy of its own, so the
        other names keep what they hold."""
        path = self.reserve(rel)
        if os.path.lexists(path) and os.lstat(path).st_nlink > 1:
            write_atomic(path, lambda f: f.write(path.read_bytes()))
        return os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )

    def _keep(self, path: Path) -> None:
        if path not in self.kept:
            self.kept.append(path)

    def _remove_temp_files(self) -> None:
        """Temporary files of atomic writes killed before their rename, of nailseg's paths only."""
        targets = set(self.journal.files) | {MARKER, JOURNAL}
        for folder in {PurePosixPath(t).parent for t in targets}:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                for entry in os.scandir(self.path / folder):
                    target = (folder / entry.name[1:].rsplit(".", 2)[0]).as_posix()
                    temp = entry.name.startswith(".") and entry.name.endswith(".tmp")
                    if temp and target in targets and entry.is_file(follow_symlinks=False):
                        os.unlink(entry.path)


def refuse_linked(path: Path, top: Path | None = None) -> None:
    """Raise NotOursError when `path`, or a folder between `top` and it, is a symbolic link
    (without `top`: `path` itself): a write there would land wherever the link points."""
    path = Path(os.path.abspath(path))
    chain = [path] + ([p for p in path.parents if top in p.parents or p == top] if top else [])
    for p in chain:
        if p.is_symlink():
            raise NotOursError(
                f"{p} is a symbolic link (to {os.readlink(p)}) where nailseg would write: it is "
                "neither followed nor replaced; remove it, or choose another folder"
            )


def _locked(folder: Path, wait_s: float, shared: bool, key: str) -> int:
    """A descriptor of `folder` holding its lock (a reader's: `shared`), waiting up to `wait_s`
    for another process's; BusyError after that. A writer never goes through a link; a reader
    may (a dataset root linked to where the data lies)."""
    nofollow = 0 if shared else os.O_NOFOLLOW
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | nofollow | os.O_CLOEXEC)
    mode = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, mode)
            return fd
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
        if time.monotonic() >= deadline:
            os.close(fd)
            raise BusyError(
                f"another nailseg command is using {folder}: wait for it to finish, or choose "
                f"another {key}"
            )
        time.sleep(0.2)


def is_live(folder: Path) -> bool:
    """Whether a live process holds `folder` (a writer's or a reader's lock)."""
    try:
        os.close(_locked(folder, 0.0, False, ""))
    except BusyError:
        return True
    except OSError:
        pass
    return False


def refuse_foreign(folder: Path, kind: str, key: str) -> dict[str, Any] | None:
    """The marker of `folder` when it is nailseg's `kind`; None when it is missing or holds
    nothing; otherwise ForeignFolderError naming it and `key`. `claim` asks again under the lock;
    a command asks first when it must refuse before any other write."""
    marker = read_marker(folder)
    if marker is None:
        being_written = (f"{MARKER}.", *(f".{name}." for name in OWN_NAMES))
        try:
            names = [n for n in os.listdir(folder) if not n.startswith(being_written)]
        except (FileNotFoundError, NotADirectoryError):
            return None
        names = [n for n in names if n not in OWN_NAMES]
        if not os.path.lexists(folder / MARKER) and not names:
            return None
        what = (
            f"its {MARKER} is not one nailseg wrote"
            if os.path.lexists(folder / MARKER)
            else f"it holds {_first_foreign(folder, names)}"
        )
        raise ForeignFolderError(
            f"{key}={folder} is not a folder nailseg made ({what}): nothing was written; "
            f"choose a new or empty folder"
        )
    if marker["kind"] != kind:
        raise ForeignFolderError(
            f"{key}={folder} is a nailseg {marker['kind']} folder, not a {kind} one: nothing was "
            "written; choose another folder"
        )
    if is_copy(folder, marker):
        raise ForeignFolderError(
            f"{key}={folder} is a copy of a nailseg {kind} folder (a backup, or a folder copied "
            "with its files): nailseg writes only into the folder it made; choose a new folder"
        )
    return marker


def _marker_for(folder: Path, kind: str, key: str) -> dict[str, Any]:
    marker = refuse_foreign(folder, kind, key)
    if marker is None:
        home, marker_id = _home(folder), secrets.token_hex(16)
        marker = dict(tool="nailseg", version=VERSION, kind=kind, id=marker_id, home=home)
        _write_marker(folder, marker)
    return marker


def _write_marker(folder: Path, marker: dict[str, Any]) -> None:
    text = json.dumps(marker, indent=1, sort_keys=True) + "\n"
    write_atomic(folder / MARKER, lambda f: f.write(text.encode()))


def remove_empty_parents(folder: Path, top: Path) -> None:
    while folder != top and top in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def lock_shared(path: str | os.PathLike[str], key: str) -> int:
    """A reader's lock on the folder at `path`, marker or none (a prepared root a training
    reads): the descriptor holding it, until closed. A writer's claim waits for it; BusyError
    while a writer holds the folder."""
    return _locked(Path(os.path.abspath(path)), 0.0, True, key)
