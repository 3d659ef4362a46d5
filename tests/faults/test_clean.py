"""`make clean` removes only what nailseg provably wrote (`nailseg.io.clean`): the folders are
made by the user's own command (prepare.py generating and preparing the synthetic set, its Hydra
run folder), and a user's files sit in the way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import run_command
from support.prepared import write_prepared
from support.train import small_overrides

from nailseg.io.folder import JOURNAL, MARKER

ROOT = Path(__file__).resolve().parents[2]
RAW, PREPARED, RUN = "data/synthetic/raw", "data/synthetic/prepared", "outputs/prepare/run"
USERS = [
    "data/nails/raw/Images/1/a.png",  # dataset=nails' default raw_dir
    "data/nails/prepared/train.csv",
    "data/mine/Images/g/photo.png",
    "data/synthetic/notes.txt",
    "outputs/notes.txt",
    f"{RAW}/Images/desk/mine.png",  # inside folders nailseg made: still the user's
    f"{PREPARED}/my_split.csv",
    f"{RUN}/notes.txt",
]


def _prepare(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The synthetic set generated and prepared by prepare.py, as `make prepare` does, into
    `project`; its run folder too."""
    done = run_command(
        [
            "prepare.py",
            "dataset=synthetic",
            "dataset.synthetic.n=8",
            f"dataset.raw_dir={project / RAW}",
            f"dataset.root={project / PREPARED}",
            f"hydra.run.dir={project / RUN}",
        ],
        capsys,
    )
    assert done.returncode == 0, done.stderr


def _make_clean(project: Path) -> str:
    shutil.copy(ROOT / "Makefile", project / "Makefile")
    done = subprocess.run(
        ["make", "clean", f"PY={sys.executable}"],
        cwd=project,
        check=True,
        capture_output=True,
        timeout=120,  # a hang (a FIFO read) fails the test
        text=True,
    )
    return done.stdout


def _write(project: Path, names: list[str]) -> None:
    for name in names:
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(f"the user's {name}")


def _files(project: Path) -> list[str]:
    return sorted(p.relative_to(project).as_posix() for p in project.rglob("*") if not p.is_dir())


@pytest.mark.slow
def test_make_clean_removes_what_nailseg_wrote_and_names_what_it_keeps(tmp_path, capsys):
    """Before, it removed outputs/ whole and every folder holding a file of the marker's name,
    the user's files in them included."""
    _prepare(tmp_path, capsys)
    _write(tmp_path, [*USERS, ".pytest_cache/README.md", ".ruff_cache/x"])
    out = _make_clean(tmp_path)
    assert _files(tmp_path) == sorted(["Makefile", *USERS])
    for name in USERS:
        assert (tmp_path / name).read_text() == f"the user's {name}"
        if name.split("/")[0] == "outputs" or name.startswith("data/synthetic"):
            assert f"kept {name}" in out, name


@pytest.mark.parametrize(
    "content",
    [
        {"tool": "nailseg", "kind": "run"},  # no id, no home: not a marker nailseg wrote
        {"note": "mine"},
        "not json",
    ],
)
def test_make_clean_keeps_a_folder_whose_marker_nailseg_did_not_write(tmp_path, content):
    """A marker's name proves nothing: its content must be nailseg's (tool, kind, id, the
    folder's own device and inode). Before, a folder holding a file of that name went whole."""
    folder = tmp_path / "outputs" / "train" / "run"
    photo = folder / "Images" / "g" / "photo.png"
    _write(tmp_path, [photo.relative_to(tmp_path).as_posix()])
    text = content if isinstance(content, str) else json.dumps(content)
    (folder / MARKER).write_text(text)
    out = _make_clean(tmp_path)
    assert photo.read_text().startswith("the user's")
    assert (folder / MARKER).read_text() == text
    assert f"kept {photo.relative_to(tmp_path)}" in out


@pytest.mark.slow
def test_make_clean_keeps_copies_of_nailsegs_folders_whole(tmp_path, capsys):
    """A `cp -a` backup of a prepared root and of the generator's photos is the user's: kept
    whole, its marker included, and named. Before, clean removed the copies' files and markers."""
    _prepare(tmp_path, capsys)
    for name in (RAW, PREPARED):
        shutil.copytree(tmp_path / name, tmp_path / f"{name}-backup", symlinks=True)
    before = {name: _files(tmp_path / f"{name}-backup") for name in (RAW, PREPARED)}
    out = _make_clean(tmp_path)
    for name in (RAW, PREPARED):
        assert _files(tmp_path / f"{name}-backup") == before[name]
        assert MARKER in before[name]
        assert f"kept {name}-backup: a copy of a nailseg folder" in out
    assert not (tmp_path / RAW).exists() and not (tmp_path / PREPARED).exists()


@pytest.mark.slow
def test_make_clean_keeps_files_changed_since_nailseg_wrote_them(tmp_path, capsys):
    """A file nailseg wrote and the user then edited or replaced is the user's. Before, it went
    with its folder."""
    _prepare(tmp_path, capsys)
    edited = [
        f"{RAW}/Images/studio/s0000.png",
        f"{PREPARED}/train.csv",
    ]
    for name in edited:
        with open(tmp_path / name, "a") as file:
            file.write("the user's edit")
    replaced = next((tmp_path / PREPARED / "images").rglob("*.npy"))
    replaced.unlink()
    replaced.write_bytes(b"the user's own array")
    out = _make_clean(tmp_path)
    kept = [*edited, replaced.relative_to(tmp_path).as_posix()]
    assert _files(tmp_path) == sorted(["Makefile", *kept])
    for name in kept:
        assert f"kept {name}" in out


@pytest.mark.slow
def test_make_clean_never_follows_or_removes_a_link(tmp_path, capsys):
    """A link where nailseg's picture was, and a link to a user's folder under outputs/: both
    stay, and what they lead to is untouched. Before, the links went."""
    _prepare(tmp_path, capsys)
    elsewhere = tmp_path / "elsewhere"
    _write(tmp_path, ["elsewhere/mine.png", "elsewhere/data/x.png"])
    picture = tmp_path / RAW / "Images" / "studio" / "s0000.png"
    picture.unlink()
    picture.symlink_to(elsewhere / "mine.png")
    (tmp_path / "outputs" / "shared").symlink_to(elsewhere / "data", target_is_directory=True)
    _make_clean(tmp_path)
    assert picture.is_symlink() and (tmp_path / "outputs" / "shared").is_symlink()
    assert sorted(os.listdir(elsewhere)) == ["data", "mine.png"]
    assert (elsewhere / "data" / "x.png").read_text() == "the user's elsewhere/data/x.png"


@pytest.mark.slow
def test_make_clean_leaves_no_empty_folder_of_its_own_behind(tmp_path, capsys):
    """Once its files are gone, the folders they leave empty go too (rmdir: only empty ones)."""
    _prepare(tmp_path, capsys)
    _make_clean(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Makefile"]


@pytest.mark.slow
def test_make_clean_removes_a_sweeps_runs_and_keeps_a_users_files_among_them(tmp_path, capsys):
    """A `train.py -m` sweep's folder and its jobs' folders are marked and recorded (checkpoints,
    logs, metrics.json, Hydra's files); clean removes those and keeps the user's notes there."""
    prepared = write_prepared(tmp_path / "prepared")
    sweep = tmp_path / "multirun" / "sweep"
    overrides = small_overrides(prepared, "logger=csv", "trainer.max_epochs=1", "test=false")
    done = run_command(
        ["train.py", "-m", *overrides, "seed=1,2", f"hydra.sweep.dir={sweep}"], capsys
    )
    assert done.returncode == 0, done.stderr
    assert (sweep / "0" / "checkpoints" / "last.ckpt").is_file()
    users = ["multirun/sweep/notes.txt", "multirun/sweep/1/mine.txt"]
    _write(tmp_path, users)
    before = _files(tmp_path / "prepared")
    out = _make_clean(tmp_path)
    assert [p for p in _files(tmp_path) if not p.startswith("prepared/")] == sorted(
        ["Makefile", *users]
    )
    assert _files(tmp_path / "prepared") == before
    assert all(f"kept {name}" in out for name in users)


@pytest.mark.slow
@pytest.mark.parametrize("name", [MARKER, JOURNAL])
def test_make_clean_never_waits_on_a_fifo_in_a_folder_of_nailsegs(tmp_path, capsys, name):
    """A FIFO where nailseg reads its marker or journal: clean reads neither (a read would wait
    forever), removes nothing the journal cannot prove, and leaves the FIFO."""
    _prepare(tmp_path, capsys)
    fifo = tmp_path / PREPARED / name
    fifo.unlink()
    os.mkfifo(fifo)
    out = _make_clean(tmp_path)
    assert fifo.exists() and "clean: removed" in out
