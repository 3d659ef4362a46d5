"""Atomic file writes: every output goes to a temporary sibling, is flushed to the disk (fsync),
then renamed into place, so a final name never holds a half-written file: not after an
interrupted run (even `kill -9`), not for a reader watching the folder, not after a power cut.

The temporary name starts with a dot (folder scans skip dotfiles) and carries the process id, so
parallel writers never share one; it lives in the target's folder, since a rename is atomic only
within one filesystem.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".tmp"


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def write_atomic(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], object], mtime_ns: int | None = None
) -> Path:
    """`write(file)` into a temporary sibling, fsync, then rename; `mtime_ns` stamps the file
    first. The folder is fsync'd after the rename so the new name itself is durable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return path


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
