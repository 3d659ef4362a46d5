"""Whether this user may write a folder, asked before a command's first write: an output folder
it cannot write is then one line naming that folder, not a PermissionError's traceback part-way
(root bypasses the permission bits; the effective user's rights are what a write gets)."""

from __future__ import annotations

import os
from pathlib import Path

_EFFECTIVE_IDS = os.access in os.supports_effective_ids


def may_write(folder: Path) -> bool:
    """Whether this process may create and remove entries in `folder`."""
    return os.access(folder, os.W_OK | os.X_OK, effective_ids=_EFFECTIVE_IDS)


def unwritable_folder(path: Path) -> Path | None:
    """The folder that `path` is, or would be made in (its nearest existing ancestor), when this
    process may not write in it; else None."""
    folder = next((p for p in (path, *path.parents) if p.is_dir()), None)
    return folder if folder is not None and not may_write(folder) else None
