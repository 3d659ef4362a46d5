"""`make clean` (`python -m nailseg.io.clean [ROOT]`): remove what nailseg provably wrote under a
project's generated folders (`GENERATED`) and the tool caches, and name everything it keeps."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from nailseg.io.folder import OWN_NAMES, Cleaned, clean

GENERATED = ("outputs", "multirun", "data/synthetic", "data/synthetic-mix")
TOOL_CACHES = (".pytest_cache", ".ruff_cache")


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
