"""Ownership by identity (issue #31), through the user's commands: a marker nailseg did not write,
a file nailseg wrote that the user has since changed, and a link where nailseg's file would be
are each left as they are, and named."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from support.cli import run_command
from support.image_files import box_mask, photo, save_image
from support.prep_settings import prepare

from nailseg.io.folder import JOURNAL, OwnedFolder

ROOT = Path(__file__).resolve().parents[2]


def _pairs(raw: Path, n: int) -> None:
    for i in range(n):
        save_image(raw / "Images" / f"g{i % 2}" / f"s{i:03d}.png", photo(seed=i))
        save_image(raw / "Masks" / f"g{i % 2}" / f"s{i:03d}.png", box_mask(box=4 + i % 5))


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` (links as their target's name) with its bytes."""
    return {
        p.relative_to(root).as_posix(): os.readlink(p).encode()
        if p.is_symlink()
        else p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


@pytest.fixture
def command(capsys: pytest.CaptureFixture[str]) -> Callable[..., subprocess.CompletedProcess]:
    """`python *args` as the user runs it (in this process: `run_command`)."""
    return lambda *args: run_command(list(args), capsys)


def _prepare_py(command, tmp_path: Path, raw: Path, out: Path, *overrides: str):
    return command(
        str(ROOT / "prepare.py"),
        f"input_dir={raw}",
        f"output_dir={out}",
        "num_workers=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        *overrides,
    )


# a marker's name proves nothing


@pytest.mark.parametrize(
    "content",
    [
        '{"format": 2, "mask_threshold": 127}\n',  # what f5710aa's prepare wrote
        '{"tool": "nailseg", "kind": "predict", "id": "0123456789abcdef0123456789abcdef"}',
        "my notes, in a file I happen to call prepare.json\n",
    ],
)
def test_prepare_refuses_a_folder_whose_prepare_json_nailseg_did_not_write(
    tmp_path, content, command
):
    """Before, any prepare.json holding a `format` key made the folder prepare's own."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 4)
    (out / "images").mkdir(parents=True)
    (out / "prepare.json").write_text(content)
    (out / "images" / "mine.npy").write_bytes(b"the user's array")
    (out / "train.csv").write_text("the user's own split\n")
    before = _files(out)
    done = _prepare_py(command, tmp_path, raw, out)
    assert done.returncode == 1
    assert f"output_dir={out} is not a folder nailseg made" in done.stderr
    assert _files(out) == before


@pytest.mark.slow
def test_the_generator_refuses_a_folder_whose_synthetic_json_nailseg_did_not_write(
    tmp_path, command
):
    """A folder of the user's photos with a synthetic.json of the old generator's content: before,
    the generator took the folder, wrote its pictures among the photos and deleted the user's
    `s0005.png` as a picture of its own left over from a larger set."""
    folder = tmp_path / "photos"
    save_image(folder / "Images" / "desk" / "s0005.png", photo(seed=5))
    save_image(folder / "Masks" / "desk" / "s0005.png", box_mask())
    (folder / "synthetic.json").write_text(json.dumps({"n": 8, "seed": 0, "version": 1}))
    before = _files(folder)
    done = command("-m", "nailseg.synth", f"out={folder}", "n=4")
    assert done.returncode == 1
    assert f"out={folder} is not a folder nailseg made" in done.stderr
    assert _files(folder) == before


# a file nailseg wrote, changed by the user since, is the user's


@pytest.mark.slow
def test_prepare_keeps_an_output_the_user_replaced_and_names_it(tmp_path, command):
    """The user put an array of their own where prepare's was; a rerun under another
    mask_threshold leaves it (excluded, named) instead of overwriting it as before."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 6)
    prepare(raw, out, num_workers=1)
    mine = out / "masks" / "g0" / "s000.npy"
    mine.unlink()
    np.save(mine, np.ones((24, 32, 1), np.uint8))
    before = mine.read_bytes()
    done = _prepare_py(command, tmp_path, raw, out, "mask_threshold=100")
    assert done.returncode == 0, done.stderr
    assert mine.read_bytes() == before
    assert "masks/g0/s000.npy" in (out / "excluded.csv").read_text()


def test_prepare_prune_keeps_an_output_the_user_replaced_and_names_it(tmp_path, command):
    """`prune=true` deleted every listed output of a pair gone from the input, even one the
    user had replaced with a file of their own; now that file stays and the summary names it."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 10)
    prepare(raw, out, num_workers=1)
    mine = out / "images" / "g1" / "s001.npy"
    mine.unlink()
    mine.write_bytes(b"the user's own array")
    for kind in ("Images", "Masks"):
        (raw / kind / "g1" / "s001.png").unlink()
    done = _prepare_py(command, tmp_path, raw, out, "prune=true")
    assert done.returncode == 0, done.stderr
    assert mine.read_bytes() == b"the user's own array"
    assert not (out / "masks" / "g1" / "s001.npy").exists()  # prepare's own output of it went
    assert f"kept, not prepare's any more: {mine}" in done.stdout


@pytest.mark.slow
def test_prepare_refuses_to_replace_a_root_file_the_user_edited(tmp_path, command):
    """A train.csv the user edited after prepare wrote it is not replaced by a rerun (before, it
    was, silently): the rerun fails naming it, and writes nothing."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 6)
    prepare(raw, out, num_workers=1)
    with open(out / "train.csv", "a") as file:
        file.write("my,own,row,1,1,0.5\n")
    save_image(raw / "Images" / "g0" / "s000.png", photo(seed=99))  # a change to convert
    before = _files(out)
    done = _prepare_py(command, tmp_path, raw, out)
    assert done.returncode == 1
    assert f"{out / 'train.csv'} lies where nailseg would write" in done.stderr
    assert {k: v for k, v in _files(out).items() if k != JOURNAL} == {
        k: v for k, v in before.items() if k != JOURNAL
    }  # the folder's journal compacted as the claim took it


@pytest.mark.slow
def test_the_generator_keeps_a_picture_the_user_replaced(tmp_path, command):
    """Generating a smaller set removed every `sNNNN.png` beyond it by name; a picture the user
    replaced with their own now stays, named."""
    folder = tmp_path / "synthetic"
    assert command("-m", "nailseg.synth", f"out={folder}", "n=8").returncode == 0
    mine = folder / "Images" / "clutter" / "s0007.png"
    mine.unlink()
    save_image(mine, photo(seed=7))
    done = command("-m", "nailseg.synth", f"out={folder}", "n=4")
    assert done.returncode == 0, done.stderr
    assert mine.is_file() and not (folder / "Masks" / "clutter" / "s0007.png").exists()
    assert f"kept {mine}" in done.stdout + done.stderr


# a link where nailseg's file would be is never followed


@pytest.mark.slow
@pytest.mark.parametrize("name", ["manifest.journal", "train.csv"])
def test_prepare_never_writes_through_a_link_in_place_of_its_file(tmp_path, name, command):
    """Before, prepare appended its journal to the file a `manifest.journal` link led to, and
    replaced a `train.csv` link."""
    raw, out, theirs = tmp_path / "raw", tmp_path / "out", tmp_path / "theirs"
    _pairs(raw, 6)
    prepare(raw, out, num_workers=1)
    theirs.mkdir()
    (theirs / "notes.txt").write_text("the user's notes\n")
    link = out / name
    link.unlink(missing_ok=True)
    link.symlink_to(theirs / "notes.txt")
    save_image(raw / "Images" / "g0" / "s000.png", photo(seed=99))  # a change to convert
    done = _prepare_py(command, tmp_path, raw, out)
    assert done.returncode == 1
    assert str(link) in done.stderr and "link" in done.stderr
    assert link.is_symlink()
    assert _files(theirs) == {"notes.txt": b"the user's notes\n"}


def test_compare_never_replaces_a_users_compare_md_in_the_sweep_folder(tmp_path, command):
    """Before, compare wrote its compare.md, compare.csv and compare.png over the user's files of
    those names; now one its sweep folder's journal does not record is refused, named, and
    nothing is written."""
    sweep = tmp_path / "sweep"
    OwnedFolder.claim(sweep, "sweep").release()  # as train.py -m leaves it
    for name, aug in (("0", "light"), ("1", "heavy")):
        job = sweep / name
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- aug={aug}\n")
        (job / "metrics.json").write_text(json.dumps({"fit": {}, "throughput": None}))
    (sweep / "compare.md").write_text("my own notes on this sweep\n")
    done = command("-m", "nailseg", "compare", str(sweep))
    assert done.returncode == 1
    assert f"{sweep / 'compare.md'} lies where nailseg would write" in done.stderr
    assert (sweep / "compare.md").read_text() == "my own notes on this sweep\n"
    assert not (sweep / "compare.csv").exists()
