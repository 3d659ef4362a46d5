"""Atomic file writes: a temporary sibling (a dotfile named with the process id, in the target's
folder: a rename is atomic within one filesystem), fsync'd, then renamed into place, so a final
name never holds a half-written file. Anything but a plain file where the file would go is
refused (`NotOursError`), never followed nor replaced.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from nailseg.errors import UserError

TMP_SUFFIX = ".tmp"
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class NotOursError(UserError, RuntimeError):
    """A path nailseg would write, replace or remove is not provably its own: it was left as it
    was, and the message names it."""


def refuse_non_file(path: Path) -> None:
    """Raise NotOursError when `path` exists as anything but a plain file: nailseg writes only
    plain files, so a link (or folder) there is someone else's."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if stat.S_ISLNK(mode):
        raise NotOursError(
            f"{path} is a symbolic link (to {os.readlink(path)}) where nailseg would write a file: "
            "nailseg never makes one there, so it neither follows nor replaces it; remove it, or "
            "choose another folder"
        )
    if not stat.S_ISREG(mode):
        raise NotOursError(
            f"{path} is a folder or special file where nailseg would write a file: it is left "
            "as it is; move it, or choose another folder"
        )


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def write_atomic(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], object],
    mtime_ns: int | None = None,
    before_rename: Callable[[Path], object] | None = None,
) -> Path:
    """`write(file)` into a temporary sibling, fsync, then rename; `mtime_ns` stamps the file
    first, `before_rename(temporary)` is called just before the rename (a kill after the rename
    then finds it done). The folder is fsync'd after the rename so the new name is durable."""
    path = Path(path)
    refuse_non_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with os.fdopen(_create(tmp), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _create(tmp: Path) -> int:
    """A new file at `tmp`; a plain file of that name is a killed writer's of an earlier process
    with this id (its name says so), replaced; anything else there is refused."""
    try:
        return os.open(tmp, _CREATE, 0o644)
    except FileExistsError:
        refuse_non_file(tmp)
        os.unlink(tmp)
        return os.open(tmp, _CREATE, 0o644)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    return write_atomic(path, lambda f: f.write(data))


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    return write_bytes(path, text.encode())


def save_figure(path: str | os.PathLike[str], fig, dpi: int = 100) -> Path:
    """A matplotlib figure as PNG."""
    return write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
