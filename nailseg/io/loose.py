"""One file nailseg writes alone in a folder no command claims (export's model, predict's threshold
cache beside a checkpoint): journaled in that folder, replaced only while it is as written."""

from __future__ import annotations

import os
from pathlib import Path

from nailseg.io.atomic import NotOursError, refuse_non_file, write_atomic
from nailseg.io.folder import Journal, read_marker


def check_loose(path: Path) -> None:
    """Raise NotOursError unless nailseg may write the one file at `path` in a folder no command
    claims (a user's: export's model): nothing there, or a file that folder's journal shows as
    nailseg's and unchanged; a claimed folder is its owner's."""
    refuse_non_file(path)
    if (marker := read_marker(path.parent)) is not None:
        raise NotOursError(
            f"{path.parent} is a nailseg {marker['kind']} folder: nothing else writes there; "
            "choose another folder"
        )
    if os.path.lexists(path) and not Journal(path.parent).proves(path.name):
        raise NotOursError(
            f"{path} exists and nailseg did not write it (or it changed since), so it is not "
            "replaced: nothing was written; move it, or choose another path"
        )


def write_loose(path: Path, data: bytes) -> None:
    """Write `data` at `path` atomically where `check_loose` allows, journaled in its folder (before
    the rename), so a later write replaces it only while it is as written."""
    check_loose(path)
    journal = Journal(path.parent)
    write_atomic(
        path, lambda f: f.write(data), before_rename=lambda tmp: journal.add(path.name, tmp)
    )
