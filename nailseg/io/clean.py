"""`make clean` (`python -m nailseg.io.clean [ROOT]`): remove what nailseg provably wrote under a
project's generated folders (`GENERATED`) and the tool caches, and name everything it keeps."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nailseg.io.folder import (
    JOURNAL,
    MARKER,
    OWN_NAMES,
    Journal,
    Record,
    is_copy,
    is_live,
    read_marker,
    remove_empty_parents,
)

GENERATED = ("outputs", "multirun", "data/synthetic", "data/synthetic-mix")
TOOL_CACHES = (".pytest_cache", ".ruff_cache")


@dataclass
class Cleaned:
    """What `clean` did: files removed, and what it left, each with why."""

    removed: int = 0
    skipped: dict[Path, str] = field(default_factory=dict)  # whole folders left, and why


def clean(top: Path, cleaned: Cleaned | None = None) -> Cleaned:
    """Remove, under `top`, the files nailseg's folders show as nailseg's, their journals and
    markers, and the folders this leaves empty; a folder in use (its lock held), a copy of a
    nailseg folder, and every file nailseg did not write stay (the folders named in `skipped`)."""
    cleaned = cleaned or Cleaned()
    if top.is_symlink() or not top.is_dir():
        return cleaned
    marker = read_marker(top)
    if marker is not None and is_live(top):
        cleaned.skipped[top] = "in use by a running nailseg command"
        return cleaned
    if marker is not None and is_copy(top, marker):
        cleaned.skipped[top] = "a copy of a nailseg folder: yours"
        return cleaned
    for entry in sorted(os.scandir(top), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            clean(Path(entry.path), cleaned)
    if marker is not None:
        journal = Journal(top)
        for rel in sorted(_files_below(top)):  # a library's links (W&B's) hold nothing of anyone's
            if journal.proves(rel) or (os.path.islink(top / rel) and journal.reserves(rel)):
                (top / rel).unlink()
                cleaned.removed += 1
                remove_empty_parents((top / rel).parent, top)
        for name in (JOURNAL, MARKER):
            if Record.of(top / name) is not None:  # a plain file: a FIFO of that name is not ours
                (top / name).unlink()
                cleaned.removed += 1
    with contextlib.suppress(OSError):
        top.rmdir()
    return cleaned


def _files_below(folder: Path, rel: str = "") -> Iterator[str]:
    """Paths of the plain files and links below `folder`, not descending into links nor into a
    folder with a marker of its own (it is cleaned by itself)."""
    for entry in os.scandir(folder / rel if rel else folder):
        path = f"{rel}{entry.name}"
        if entry.is_dir(follow_symlinks=False):
            if not os.path.lexists(Path(entry.path) / MARKER):
                yield from _files_below(folder, f"{path}/")
        elif (entry.is_file(follow_symlinks=False) or entry.is_symlink()) and path not in OWN_NAMES:
            yield path


def clean_project(root: Path) -> tuple[Cleaned, list[Path]]:
    """Clean the project at `root`. Returns what was done and the files it left under
    `GENERATED` outside the folders it skipped whole."""
    for name in TOOL_CACHES:
        cache = root / name
        if cache.is_dir() and not cache.is_symlink():
            shutil.rmtree(cache)
    cleaned, left = Cleaned(), []
    for name in GENERATED:
        top = root / name
        clean(top, cleaned)
        if top.is_dir() and not top.is_symlink():
            files = (p for p in top.rglob("*") if not p.is_dir() and p.name not in OWN_NAMES)
            left += sorted(p for p in files if not any(s in p.parents for s in cleaned.skipped))
    if (root / "data").is_dir() and not os.listdir(root / "data"):
        (root / "data").rmdir()
    return cleaned, left


def main(argv: list[str]) -> int:
    cleaned, left = clean_project(Path(argv[0] if argv else "."))
    print(f"clean: removed {cleaned.removed} files nailseg wrote")
    for folder, why in cleaned.skipped.items():
        print(f"  kept {folder}: {why}")
    for path in left[:50]:
        print(f"  kept {path}: not provably nailseg's (yours, changed since, or never recorded)")
    if len(left) > 50:
        print(f"  ... and {len(left) - 50} more files kept")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
