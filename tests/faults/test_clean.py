"""`make clean` removes only what the project generates: a user's photos and prepared data stay."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GENERATED = [
    "outputs/train/run/checkpoints/last.ckpt",
    "multirun/sweep/0/metrics.json",
    "data/synthetic/raw/synthetic.json",
    "data/synthetic/raw/Images/desk/s0000.png",
    "data/synthetic/prepared/prepare.json",
    "data/synthetic/prepared/train.csv",
    "data/synthetic-mix/raw/synthetic.json",  # make cross-source's mixed-in set
    "data/synthetic-mix/prepared/prepare.json",
    ".pytest_cache/README.md",
    ".ruff_cache/x",
]
USERS = [
    "data/nails/raw/Images/1/a.png",  # dataset=nails' default raw_dir
    "data/nails/prepared/train.csv",
    "data/mine/Images/g/photo.png",
    "data/synthetic/notes.txt",
    "data/synthetic-mix/notes.txt",
]


def test_make_clean_removes_only_what_the_project_generates(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for name in GENERATED + USERS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    subprocess.run(["make", "clean"], cwd=tmp_path, check=True, capture_output=True)
    assert [name for name in USERS if not (tmp_path / name).is_file()] == []
    assert [name for name in GENERATED if (tmp_path / name).exists()] == []


def test_make_clean_leaves_no_empty_folder_of_its_own_behind(tmp_path):
    """It left data/, data/synthetic/ and data/synthetic-mix/ behind, empty."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for name in GENERATED:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    subprocess.run(["make", "clean"], cwd=tmp_path, check=True, capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Makefile"]


@pytest.mark.parametrize(
    "folder",
    ["synthetic/raw", "synthetic/prepared", "synthetic-mix/raw", "synthetic-mix/prepared"],
)
def test_make_clean_keeps_a_synthetic_folder_nailseg_did_not_mark(tmp_path, folder):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    photo = tmp_path / "data" / folder / "Images" / "g" / "photo.png"
    photo.parent.mkdir(parents=True)
    photo.write_text("a user's photo where the synthetic set would go")
    subprocess.run(["make", "clean"], cwd=tmp_path, check=True, capture_output=True)
    assert photo.is_file()
