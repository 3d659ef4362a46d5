"""prepare under requests it must refuse and inputs that change under it: a refused request writes
nothing (not even for the synthetic generator), a killed or raced run never leaves outputs that a
rerun takes as current, and odd inputs get a reason instead of a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from support.image_files import box_mask, photo, save_image
from support.prep_settings import prepare

import nailseg.prep.convert
from nailseg.config import CONF_DIR
from nailseg.errors import UserError
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OWN_NAMES
from nailseg.prep.format import read_table, write_table
from nailseg.prep.layout import OUTPUT_CLASH, UNREADABLE
from nailseg.prep.prepare import PrepareError, run

ROOT = Path(__file__).resolve().parents[2]
# prepare in its own process, killed (SIGKILL) the moment its first mask output is renamed into
# place: after that pair's outputs are written, before the parent journals its record
KILL_AFTER_FIRST_MASK = """
import os, signal, sys
real_replace = os.replace
def replace_then_die(src, dst, *args, **kwargs):
    real_replace(src, dst, *args, **kwargs)
    if os.fspath(dst).endswith(".npy") and "masks" in os.fspath(dst):
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace_then_die
from nailseg.prep.prepare import prepare
from nailseg.prep.prepare import PrepareSettings, compose_prepare
cfg = compose_prepare(["num_workers=1", f"mask_threshold={sys.argv[3]}"])
prepare(sys.argv[1], sys.argv[2], PrepareSettings.from_config(cfg))
"""


def _soft_mask(box: int) -> np.ndarray:
    """A 0/255 box with a ring of 200 above it: thresholds 127 and 250 give other masks."""
    mask = box_mask(box=box)
    mask[box - 1, box - 1 : 2 * box + 1] = 200
    return mask


def _pairs(raw: Path, n: int, soft: bool = False) -> None:
    for i in range(n):
        group, box = f"g{i % 2}", 4 + i % 5
        save_image(raw / "Images" / group / f"s{i:03d}.png", photo(seed=i))
        save_image(
            raw / "Masks" / group / f"s{i:03d}.png", _soft_mask(box) if soft else box_mask(box=box)
        )


def _files(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root` (dotfiles too, but nailseg's marker and journal) with its bytes
    and modification time."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in OWN_NAMES
    }


def _arrays(root: Path) -> dict[str, bytes]:
    return {k: v[0] for k, v in _files(root).items() if k.endswith(".npy")}


def _listed(out: Path) -> list[str]:
    return sorted(
        row for split in ("train", "valid") for row in read_table(out / f"{split}.csv")["images"]
    )


# --- interrupted and raced runs ------------------------------------------------------------------


@pytest.mark.slow
def test_outputs_a_killed_rerun_wrote_before_recording_them_are_redone(tmp_path):
    raw, out, reference = tmp_path / "raw", tmp_path / "out", tmp_path / "reference"
    _pairs(raw, 10, soft=True)
    prepare(raw, reference, num_workers=1)
    prepare(raw, out, num_workers=1)
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_FIRST_MASK, str(raw), str(out), "250"],
        cwd=ROOT,
        capture_output=True,
    )
    assert killed.returncode == -9, killed.stderr.decode()
    assert _arrays(out) != _arrays(reference)  # one mask made under 250 is on disk
    resumed = prepare(raw, out, num_workers=1)  # the original threshold again
    assert resumed.written >= 1
    assert _arrays(out) == _arrays(reference)
    assert prepare(raw, out, num_workers=1).written == 0  # and then it is up to date


def test_a_source_saved_while_it_is_read_is_read_again(tmp_path, monkeypatch):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 6)
    edited = raw / "Masks" / "g0" / "s000.png"
    real_read = nailseg.prep.convert.read_mask_values
    saves = []

    def read_then_the_user_saves(path: Path) -> np.ndarray:
        values = real_read(path)
        if path == edited and not saves:  # the annotation tool saves just after the read
            save_image(edited, box_mask(box=10))
            os.utime(edited, ns=(10**18, 10**18))
            saves.append(path)
        return values

    monkeypatch.setattr(nailseg.prep.convert, "read_mask_values", read_then_the_user_saves)
    prepare(raw, out, num_workers=1)
    assert saves and np.load(out / "masks/g0/s000.npy").sum() == 100  # the saved content
    monkeypatch.undo()
    again = prepare(raw, out, num_workers=1)
    assert (again.written, again.up_to_date) == (0, 6)


def test_a_source_gone_since_the_last_run_is_excluded_like_on_a_first_run(tmp_path):
    raw, out, fresh = tmp_path / "raw", tmp_path / "out", tmp_path / "fresh"
    _pairs(raw, 20)
    prepare(raw, out, num_workers=1)
    image = raw / "Images" / "g0" / "s000.png"
    image.unlink()
    image.symlink_to(tmp_path / "moved-away.png")  # a link to nothing
    for root in (fresh, out):
        summary = prepare(raw, root, num_workers=1)
        assert [(e.path, e.kind) for e in summary.excluded] == [(image, UNREADABLE)]
        assert "images/g0/s000.npy" not in _listed(root) and len(_listed(root)) == 19


# --- a refused request writes nothing -----------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"group_regex": "(unclosed"}, r"split\.group_regex='\(unclosed'.*unterminated subpattern"),
        ({"mask_threshold": -1}, r"mask_threshold=-1 is outside 0\.\.65534"),
        ({"mask_threshold": 65535}, r"mask_threshold=65535 is outside 0\.\.65534"),
    ],
    ids=["bad-regex", "threshold=-1", "threshold=65535"],
)
def test_bad_settings_fail_before_any_write(tmp_path, settings, message):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 6)
    with pytest.raises(UserError, match=message):
        prepare(raw, out, num_workers=1, **settings)
    assert not out.exists()
    prepare(raw, out, num_workers=1)
    before = _files(out)
    with pytest.raises(UserError, match=message):
        prepare(raw, out, num_workers=1, **settings)
    assert _files(out) == before


def _compose_synthetic(raw: Path, out: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(
            "prepare",
            overrides=[
                f"dataset.raw_dir={raw}",
                f"dataset.root={out}",
                "dataset.synthetic.n=4",
                "num_workers=0",
                *overrides,
            ],
        )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("split.valid_fraction=1.5", r"split\.valid_fraction=1\.5"),
        ("split.group_regex='(unclosed'", r"split\.group_regex"),
        ("mask_threshold=-1", r"mask_threshold=-1"),
        ("output_dir=${dataset.raw_dir}/prepared", r"overlap"),
        ("split.holdout_groups=[zzz]", r"names \['zzz'\], not among the input's groups"),
        ("split.holdout_groups=[studio,desk,fabric,clutter]", r"holds out every group"),
        ("dataset.synthetic.n=0", r"dataset\.synthetic\.n=0: must be at least 1"),
    ],
    ids=[
        "valid_fraction",
        "group_regex",
        "mask_threshold",
        "output-inside-raw",
        "holdout-unknown",
        "holdout-all",
        "n=0",
    ],
)
def test_a_synthetic_run_checks_the_request_before_generating(tmp_path, override, message):
    raw, out = tmp_path / "raw", tmp_path / "out"
    with pytest.raises(UserError, match=message):
        run(_compose_synthetic(raw, out, override))
    assert list(tmp_path.iterdir()) == []  # no photo generated, no output folder


def test_a_threshold_that_empties_every_mask_says_what_it_left(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 4)  # {0, 255} masks: nothing lies above 255
    with pytest.raises(PrepareError, match="empty mask") as new_root:
        prepare(raw, out, num_workers=1, mask_threshold=255)
    assert "Nothing was changed" not in str(new_root.value)
    assert "holds only nailseg's marker and journal" in str(new_root.value)
    assert sorted(os.listdir(out)) == sorted(OWN_NAMES)
    prepare(raw, out, num_workers=1)
    before = _files(out)
    with pytest.raises(PrepareError, match=r"empty mask.*Nothing was changed"):
        prepare(raw, out, num_workers=1, mask_threshold=255)
    assert _files(out) == before


def test_output_dir_a_link_to_nothing_is_refused(tmp_path):
    raw, out, target = tmp_path / "raw", tmp_path / "out", tmp_path / "elsewhere" / "new"
    _pairs(raw, 4)
    out.symlink_to(target)
    with pytest.raises(PrepareError, match=r"output_dir=.*symlink to .*new, which does not exist"):
        prepare(raw, out, num_workers=1)
    with pytest.raises(PrepareError, match=r"symlink to .*new, which does not exist"):
        prepare(raw, out / "below", num_workers=1)
    assert not (tmp_path / "elsewhere").exists()


# --- inputs whose outputs would clash ------------------------------------------------------------


def test_a_file_and_a_folder_of_one_output_name_exclude_both_pairs(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 4)
    for rel in ("g0/x.png", "g0/x.npy/y.png"):
        save_image(raw / "Images" / rel, photo())
        save_image(raw / "Masks" / rel, box_mask())
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == 4
    clashes = [e for e in summary.excluded if e.kind == OUTPUT_CLASH]
    assert sorted(e.path.relative_to(raw).as_posix() for e in clashes) == [
        "Images/g0/x.npy/y.png",
        "Images/g0/x.png",
        "Masks/g0/x.npy/y.png",
        "Masks/g0/x.png",
    ]
    assert all("Images/g0/x.png and Images/g0/x.npy/y.png" in e.detail for e in clashes)


def test_a_kept_output_where_a_new_pair_needs_a_folder_excludes_that_pair(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 12)  # x is one pair of 13: under the share of gone pairs a rerun accepts
    save_image(raw / "Images" / "g0" / "x.png", photo())
    save_image(raw / "Masks" / "g0" / "x.png", box_mask())
    prepare(raw, out, num_workers=1)
    for kind in ("Images", "Masks"):  # x goes; x.npy/y comes: images/g0/x.npy stays, kept
        (raw / kind / "g0" / "x.npy").mkdir()
        (raw / kind / "g0" / "x.png").rename(raw / kind / "g0" / "x.npy" / "y.png")
    summary = prepare(raw, out, num_workers=1)
    assert summary.kept_gone == 1 and summary.written == 0
    assert [(e.path, e.kind) for e in summary.excluded] == [(out / "images/g0/x.npy", OUTPUT_CLASH)]


def test_a_manifest_naming_a_path_outside_the_output_is_refused_before_deleting(tmp_path):
    """manifest.csv is read off disk: a row edited by hand or damaged to `../victim.npy` made a
    pruning rerun delete that file, outside the output folder."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 4)
    prepare(raw, out, num_workers=1)
    victim = tmp_path / "victim.npy"
    victim.write_text("a user's file")
    manifest = read_table(out / "manifest.csv")
    gone = manifest.loc[0]
    manifest.loc[0, "images"] = "../victim.npy"
    write_table(out / "manifest.csv", manifest)
    for kind in ("Images", "Masks"):
        next((raw / kind / gone["group"]).glob(f"{gone['stem']}.*")).unlink()
    with pytest.raises(NotOursError, match=r"manifest\.csv lies where nailseg would write"):
        prepare(raw, out, num_workers=1, prune=True)
    assert victim.read_text() == "a user's file"
