"""Atomic file writes: every output goes to a temporary sibling, then is renamed into place, so a
final name never holds a half-written file (an interrupted run, a reader watching the folder).

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
    """`write(file)` into a temporary sibling, then rename; `mtime_ns` stamps the file first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
        if mtime_ns is not None:
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    return write_atomic(path, lambda f: f.write(data))


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    return write_bytes(path, text.encode())


def save_figure(path: str | os.PathLike[str], fig, dpi: int = 100) -> Path:
    """A matplotlib figure as PNG."""
    return write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
