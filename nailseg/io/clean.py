"""`make clean` (`python -m nailseg.io.clean [ROOT]`): remove what nailseg provably wrote under a
project's generated folders (`GENERATED`), and nothing else.

Each folder whose marker nailseg wrote (`_KINDS`) loses the files its records show as nailseg's
and still as written, then its marker; folders left empty go. Anything else stays and is named.
The tool caches go whole.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nailseg.io import folder as owned
from nailseg.io.folder import MARKER as RUN_MARKER
from nailseg.io.ownership import (
    ForeignFolderError,
    Proof,
    Record,
    below,
    is_ours,
    marker_proofs,
    read_marker,
    recorded,
    remove_empty_folder,
    remove_file,
    stamped,
)
from nailseg.prep.format import MANIFEST_FILE, read_table

GENERATED = ("outputs", "multirun", "data/synthetic", "data/synthetic-mix")
TOOL_CACHES = (".pytest_cache", ".ruff_cache")
_LOCKS = (".prepare.lock", ".builtin.lock")  # empty files the locks open


@dataclass
class Cleaned:
    removed: int = 0
    kept: list[Path] = field(default_factory=list)  # files left: not provably nailseg's
    foreign: list[str] = field(default_factory=list)  # folders whose marker nailseg did not write


def _prepared(folder: Path, marker: dict) -> dict[str, Proof]:
    """A prepared root's outputs (listed in manifest.csv, each bearing its source's time), its
    root files (recorded in the marker) and its lock files."""
    proofs: dict[str, Proof] = dict(recorded(marker))
    if MANIFEST_FILE in proofs and is_ours(folder / MANIFEST_FILE, proofs[MANIFEST_FILE]):
        rows = read_table(folder / MANIFEST_FILE)
        for column, stamps in (("images", "image_mtime_ns"), ("masks", "mask_mtime_ns")):
            for rel, stamp in zip(rows[column], rows[stamps], strict=True):
                proofs[rel] = stamped(int(stamp))
    return proofs


# marker file -> (kind, the proofs of the files it shows as nailseg's besides itself)
_KINDS: dict[str, tuple[tuple[str, ...], Callable[[Path, dict], dict[str, Proof]]]] = {
    RUN_MARKER: (("run", "sweep", "bench"), lambda folder, marker: marker_proofs(marker)),
    "prepare.json": (("prepare",), _prepared),
    "synthetic.json": (("synthetic",), lambda folder, marker: marker_proofs(marker)),
    ".compare.json": (("compare",), lambda folder, marker: marker_proofs(marker)),
}


def clean_folder(folder: Path, cleaned: Cleaned) -> None:
    """Remove what the markers in `folder` and below show as nailseg's (see the module docstring),
    bottom-up, then the folders that left empty."""
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            clean_folder(Path(entry.path), cleaned)
    for name, (kinds, proofs_of) in _KINDS.items():
        if not os.path.lexists(folder / name):
            continue
        marker = _marker(folder, name, kinds, cleaned)
        if marker is None:
            continue
        proofs = proofs_of(folder, marker) | {lock: _empty for lock in _LOCKS}
        for rel, proof in sorted(proofs.items()):
            if not below(rel):  # a listing never leads outside its folder
                continue
            path = folder / rel
            if os.path.lexists(path) and remove_file(path, proof):
                cleaned.removed += 1
                _remove_empty_parents(path.parent, folder)
        (folder / name).unlink()
        cleaned.removed += 1
    remove_empty_folder(folder)


def _marker(folder: Path, name: str, kinds: tuple[str, ...], cleaned: Cleaned) -> dict | None:
    for kind in kinds:
        try:
            return read_marker(folder, name, kind)
        except ForeignFolderError:
            continue
    cleaned.foreign.append(f"{folder} (its {name} is not nailseg's)")
    return None


def _empty(found: Record) -> bool:
    return found.size == 0


def _remove_empty_parents(folder: Path, top: Path) -> None:
    while folder != top and remove_empty_folder(folder):
        folder = folder.parent


def clean(root: Path) -> Cleaned:
    """Clean the project at `root` (see the module docstring)."""
    cleaned = Cleaned()
    for name in TOOL_CACHES:
        cache = root / name
        if cache.is_dir() and not cache.is_symlink():
            shutil.rmtree(cache)
    for name in GENERATED:
        top = root / name
        if top.is_dir() and not top.is_symlink():
            done = owned.clean(top)  # the folders claimed through io/folder.py (prepare, synth)
            cleaned.removed += done.removed
            cleaned.foreign += [f"{path} ({why})" for path, why in done.skipped.items()]
        if top.is_dir() and not top.is_symlink():
            clean_folder(top, cleaned)
            if top.is_dir():
                cleaned.kept += sorted(p for p in top.rglob("*") if not p.is_dir())
    remove_empty_folder(root / "data")
    return cleaned


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else ".")
    cleaned = clean(root)
    print(f"clean: removed {cleaned.removed} files nailseg wrote")
    for folder in cleaned.foreign:
        print(f"  kept folder {folder}")
    for path in cleaned.kept[:50]:
        print(f"  kept {path}: not provably nailseg's (yours, changed since, or never recorded)")
    if len(cleaned.kept) > 50:
        print(f"  ... and {len(cleaned.kept) - 50} more files kept")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
