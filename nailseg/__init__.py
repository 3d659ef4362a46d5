"""nailseg's Python API: `nailseg.load(ckpt)` gives a Segmenter whose `predict` and
`probabilities` take photos in memory, as predict runs them (inference/segmenter.py). torch loads
at the first use of `load`, not at `import nailseg`: the commands' quick error paths import this."""

from __future__ import annotations

import importlib
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["Segmenter", "__version__", "load"]
_API = "nailseg.inference.segmenter"  # `load` and `Segmenter`


try:
    __version__ = metadata.version("nailseg")
except metadata.PackageNotFoundError:  # a source checkout that is not installed
    _PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
    __version__ = tomllib.loads(_PYPROJECT.read_text())["project"]["version"]


def __getattr__(name: str) -> Any:
    """`load` and `Segmenter`, imported at their first use."""
    if name not in ("load", "Segmenter"):
        raise AttributeError(f"module 'nailseg' has no attribute {name!r}")
    return getattr(importlib.import_module(_API), name)
