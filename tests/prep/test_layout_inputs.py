"""Inputs that used to hang a command or go through silently wrong, each run through the user's
command: special files (never opened), palette masks (read by index), EXIF orientations that
disagree, float images, names one file apart only by Unicode normalisation, names too long for a
temporary file, an unwritable output folder and a damaged split CSV."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import subprocess
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from support.cli import run_command
from support.image_files import box_mask, photo, save_image
from support.inference import own_run
from support.prepared import write_prepared
from support.train import small_overrides

from nailseg.prep.format import read_table
from nailseg.prep.layout import (
    CASE_CLASH,
    NAME_TOO_LONG,
    NOT_REGULAR,
    ORIENTATION_MISMATCH,
    UNREADABLE,
)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120  # a command that waits on a FIFO fails the test, not the suite


def _command(*args: str, **popen) -> subprocess.CompletedProcess:
    """`python *args` from the repository, as the user runs it; a hang fails after TIMEOUT_S."""
    try:
        return subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env={**os.environ, "COLUMNS": "1000"},  # the summary's lines whole
            **popen,
        )
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{' '.join(args)} hung for {TIMEOUT_S} s") from err


def _prepare(
    raw: Path, out: Path, run_dir: Path | None = None, **popen
) -> subprocess.CompletedProcess:
    run_dir = run_dir or out.parent / f"{out.name}_hydra"
    args = [f"input_dir={raw}", f"output_dir={out}", "num_workers=1", f"hydra.run.dir={run_dir}"]
    return _command("prepare.py", *args, **popen)


def _pair(raw: Path, stem: str, group: str = "g", seed: int = 0) -> None:
    save_image(raw / "Images" / group / f"{stem}.png", photo(seed=seed))
    save_image(raw / "Masks" / group / f"{stem}.png", box_mask())


def _excluded(out: Path) -> dict[str, tuple[str, str]]:
    """excluded.csv: file name → (reason, detail)."""
    rows = read_table(out / "excluded.csv")
    return {
        Path(p).name: (r, d)
        for p, r, d in rows[["path", "reason", "detail"]].itertuples(index=False)
    }


@pytest.mark.slow
def test_special_files_are_left_out_unopened(tmp_path):
    """A FIFO named like a photo hung prepare (PIL waits for a writer); now it and a socket are
    excluded, named, and the rest is prepared."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    for i in range(3):
        _pair(raw, f"ok{i}", seed=i)
    os.mkfifo(raw / "Images" / "g" / "fifo.png")
    save_image(raw / "Masks" / "g" / "fifo.png", box_mask())
    save_image(raw / "Images" / "g" / "sock.png", photo())
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(raw / "Masks" / "g" / "sock.png"))
        done = _prepare(raw, out)
    assert done.returncode == 0, done.stderr
    excluded = _excluded(out)
    assert excluded["fifo.png"] == (NOT_REGULAR, "FIFO")
    assert excluded["sock.png"] == (NOT_REGULAR, "socket")
    assert f"fifo.png: {NOT_REGULAR} (FIFO)" in done.stdout  # the summary names it too
    assert len(read_table(out / "train.csv")) + len(read_table(out / "valid.csv")) == 3


@pytest.fixture(scope="module")
def ckpt(trained_run, tmp_path_factory) -> Path:
    return own_run(trained_run, tmp_path_factory.mktemp("layout_inputs_run") / "train")


@pytest.mark.slow
def test_predict_skips_a_fifo_naming_it(ckpt, tmp_path):
    """predict hung on a FIFO among the photos, and on one given as the input itself."""
    photos = tmp_path / "photos"
    save_image(photos / "x.png", photo())
    os.mkfifo(photos / "fifo.png")
    os.mkfifo(tmp_path / "given.png")
    out = tmp_path / "out"
    inputs = f"input=[{photos},{tmp_path / 'given.png'}]"
    done = _command(
        "-m", "nailseg", "predict", f"ckpt={ckpt}", inputs, f"output={out}", "device=cpu"
    )
    assert done.returncode == 0, done.stderr
    assert (out / "masks" / "x.png").is_file()
    assert not (out / "masks" / "fifo.png").exists() and not (out / "masks" / "given.png").exists()
    skipped = json.loads((out / "summary.json").read_text())["skipped"]
    reasons = {Path(entry["path"]).name: entry["reason"] for entry in skipped}
    assert reasons == {"fifo.png": f"{NOT_REGULAR} (FIFO)", "given.png": f"{NOT_REGULAR} (FIFO)"}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> tuple[Path, dict[str, tuple[str, str]], str]:
    """One prepare.py run on an input of every kind below, beside three plain pairs: the output
    root, its excluded.csv by file name, and the command's output."""
    tmp = tmp_path_factory.mktemp("faulty")
    raw, out = tmp / "raw", tmp / "out"
    images, masks = raw / "Images" / "g", raw / "Masks" / "g"
    for i in range(3):
        _pair(raw, f"ok{i}", seed=i)

    # palette mask: index 1 is the nail, shown black on a white background (index 0)
    indexed = Image.fromarray((box_mask() > 0).astype(np.uint8), mode="P")
    indexed.putpalette([255, 255, 255, 0, 0, 0])
    save_image(images / "palette.png", photo())
    indexed.save(masks / "palette.png")

    # a square photo stored on its side (EXIF orientation 6), its mask without the tag: the
    # mask fits the photo as stored and as shown, so which it was drawn on is unknown
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(photo(32, 32)).save(images / "square.jpg", exif=exif.tobytes())
    save_image(masks / "square.png", box_mask(32, 32))
    # the same on a 24x32 photo whose mask has the stored shape: drawn ignoring the tag
    Image.fromarray(photo(24, 32)).save(images / "sideways.jpg", exif=exif.tobytes())
    save_image(masks / "sideways.png", box_mask(24, 32))

    # float images (32-bit float TIFF): in [0, 1] scaled, beyond it refused
    grey = np.random.default_rng(0).random((24, 32)).astype(np.float32)
    Image.fromarray(grey).save(images / "float.tif")
    save_image(masks / "float.png", box_mask())
    Image.fromarray(grey * 4).save(images / "float4.tif")
    save_image(masks / "float4.png", box_mask())

    # one name in two Unicode forms: one file on macOS
    for form in ("NFC", "NFD"):
        name = unicodedata.normalize(form, "caf\u00e9") + ".png"
        save_image(images / name, photo())
        save_image(masks / name, box_mask())

    done = _prepare(raw, out)
    assert done.returncode == 0, done.stderr
    return out, _excluded(out), done.stdout


@pytest.mark.slow
def test_palette_mask_read_by_index(faulty):
    out, excluded, _ = faulty
    assert "palette.png" not in excluded
    mask = np.load(out / "masks" / "g" / "palette.npy")
    assert np.array_equal(mask[..., 0], (box_mask() > 0).astype(np.uint8))


def test_exif_orientations_that_disagree_are_explained(faulty):
    out, excluded, stdout = faulty
    reason, detail = excluded["square.png"]
    assert reason == ORIENTATION_MISMATCH and "cannot be told" in detail, detail
    reason, detail = excluded["sideways.png"]
    assert reason == ORIENTATION_MISMATCH and "as stored, not as shown" in detail, detail
    assert not (out / "images" / "g" / "square.npy").exists()
    assert f"square.png: {ORIENTATION_MISMATCH}" in stdout


def test_float_images_scaled_from_0_1_or_refused(faulty):
    out, excluded, _ = faulty
    image = np.load(out / "images" / "g" / "float.npy")
    grey = np.random.default_rng(0).random((24, 32)).astype(np.float32)
    assert np.array_equal(image, np.repeat(np.round(grey * 255).astype(np.uint8)[..., None], 3, 2))
    reason, detail = excluded["float4.tif"]
    assert reason == UNREADABLE and "beyond [0, 1]" in detail, detail


def test_unicode_normalisation_twins_are_excluded(faulty):
    out, excluded, _ = faulty
    twins = {
        n: e for n, e in excluded.items() if unicodedata.normalize("NFC", n) == "caf\u00e9.png"
    }
    assert len(twins) == 2 and {reason for reason, _ in twins.values()} == {CASE_CLASH}
    assert not list((out / "images" / "g").glob("caf*"))


@pytest.mark.slow
def test_a_name_too_long_for_its_temporary_file_is_excluded(tmp_path):
    """`.<name>.npy.<pid>.tmp` beyond 255 bytes crashed prepare with a traceback."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    for i in range(3):
        _pair(raw, f"ok{i}", seed=i)
    long = "n" * 245
    _pair(raw, long)
    done = _prepare(raw, out)
    assert done.returncode == 0, done.stderr
    reason, detail = _excluded(out)[f"{long}.png"]
    assert reason == NAME_TOO_LONG and "shorten it" in detail, detail
    assert len(read_table(out / "train.csv")) + len(read_table(out / "valid.csv")) == 3


def _obey_permissions() -> None:
    """In the child before its exec: permission bits bind it even as root (the capabilities
    that override them, CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, dropped from its bounding set)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # <linux/capability.h>
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.slow
def test_an_unwritable_output_folder_is_named_in_one_line(tmp_path):
    """It failed with a PermissionError's traceback."""
    raw, locked = tmp_path / "raw", tmp_path / "locked"
    for i in range(3):
        _pair(raw, f"ok{i}", seed=i)
    locked.mkdir(mode=0o555)
    done = _prepare(raw, locked / "out", tmp_path / "hydra", preexec_fn=_obey_permissions)
    assert not (locked / "out").exists()
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{locked} is not writable" in lines[0], done.stderr


@pytest.mark.slow
def test_predict_names_an_unwritable_output_folder_in_one_line(ckpt, tmp_path):
    """It failed with a PermissionError's traceback, after loading the net."""
    save_image(tmp_path / "photos" / "x.png", photo())
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    args = [f"ckpt={ckpt}", f"input={tmp_path / 'photos'}", f"output={locked / 'out'}"]
    done = _command("-m", "nailseg", "predict", *args, "device=cpu", preexec_fn=_obey_permissions)
    assert done.returncode == 1 and not (locked / "out").exists(), done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{locked} is not writable" in lines[0], done.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("nan", "train.csv, row 3, column fg_fraction: 'nan' is not a fraction"),
        ("no column", "train.csv: no column 'masks'"),
    ],
)
def test_a_damaged_split_csv_is_named_with_file_row_and_column(tmp_path, capsys, damage, message):
    root = write_prepared(tmp_path / "prepared")
    rows = pd.read_csv(root / "train.csv", dtype=str, keep_default_na=False)
    if damage == "nan":
        rows.loc[2, "fg_fraction"] = "nan"
    else:
        rows = rows.drop(columns="masks")
    rows.to_csv(root / "train.csv", index=False)
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    done = run_command(["train.py", *small_overrides(root, "logger=none", run_dir)], capsys)
    stderr = done.stderr
    last = stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "Traceback" not in stderr and message in last, stderr[-3000:]
