"""Shared fixtures: prepared data written the way `prepare.py` writes it, and paths to the real data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.prepared import write_prepared

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

REAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "nails"


@pytest.fixture
def real_data() -> Path:
    """The real photos in ../shared/data/nails; skips where a fresh clone has no ../shared."""
    if not (REAL_DATA / "Images").is_dir():
        pytest.skip(
            f"real nail data not found at {REAL_DATA} (../shared is absent in a fresh clone)"
        )
    return REAL_DATA


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    return write_prepared(tmp_path / "prepared")
