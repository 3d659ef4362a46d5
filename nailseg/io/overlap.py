"""Whether two paths overlap, the check that keeps nailseg's outputs off its inputs.

Compared on resolved paths (symlinks followed), by name ignoring case (one folder on a
case-insensitive filesystem, `data` and `Data`), and by identity (bind mounts, hard-linked
folders), in both directions.
"""

from __future__ import annotations

import os
from pathlib import Path


def within(inner: Path, outer: Path) -> bool:
    """Whether `inner` is `outer` or lies inside it."""
    inner, outer = Path(inner).resolve(), Path(outer).resolve()
    folded = [part.casefold() for part in outer.parts]
    if [part.casefold() for part in inner.parts[: len(folded)]] == folded:
        return True
    return outer.exists() and any(
        p.exists() and os.path.samefile(p, outer) for p in (inner, *inner.parents)
    )


def overlap(a: Path, b: Path) -> bool:
    """Whether one of `a` and `b` is, or lies inside, the other."""
    return within(a, b) or within(b, a)
