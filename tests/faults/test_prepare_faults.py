"""prepare and the synthetic generator under bad inputs and faults: one test per fault case.

The rule under test: nailseg deletes or overwrites only what it provably created, and a request it
cannot carry out safely fails before it changes anything. Every test uses real files; kills and
the lock use real processes. docs/FAULTS.md lists the cases.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image, PngImagePlugin
from support.image_files import box_mask, photo, save_image
from support.prep_settings import assign_splits, prepare

from nailseg.io.atomic import NotOursError
from nailseg.io.folder import MARKER, OWN_NAMES, ForeignFolderError
from nailseg.prep.layout import OUTPUT_TAKEN
from nailseg.prep.prepare import PrepareError
from nailseg.synth.scene import generate

ROOT = Path(__file__).resolve().parents[2]
# a prepare in its own process, on the code of this checkout
PREPARE = (
    "import sys; from nailseg.prep.prepare import PrepareSettings, compose_prepare, prepare; "
    "prepare(*sys.argv[1:], PrepareSettings.from_config(compose_prepare(['num_workers=1'])))"
)


def _pairs(raw: Path, n: int, groups: int = 2, size: tuple[int, int] = (24, 32)) -> None:
    for i in range(n):
        save_image(raw / "Images" / f"g{i % groups}" / f"s{i:03d}.png", photo(*size, seed=i))
        save_image(
            raw / "Masks" / f"g{i % groups}" / f"s{i:03d}.png", box_mask(*size, box=4 + i % 5)
        )


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `root` (dotfiles too, but nailseg's marker and journal) with its bytes
    and modification time."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in OWN_NAMES
    }


def _rows(out: Path) -> list[str]:
    """The image paths listed in the split CSVs."""
    import pandas as pd

    frames = [pd.read_csv(out / f"{s}.csv", keep_default_na=False) for s in ("train", "valid")]
    return sorted(pd.concat(frames)["images"])


def _reasons(out: Path) -> dict[str, str]:
    """excluded.csv as file name -> reason."""
    import pandas as pd

    rows = pd.read_csv(out / "excluded.csv", keep_default_na=False, dtype=str)
    return {Path(p).name: r for p, r in zip(rows["path"], rows["reason"], strict=True)}


@pytest.fixture
def prepared(tmp_path: Path) -> tuple[Path, Path]:
    """(raw, out): 10 pairs in two groups, prepared once."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 10)
    prepare(raw, out, num_workers=1)
    return raw, out


# 1. output ownership


def test_foreign_output_folder_is_refused_before_any_write(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "mine"
    _pairs(raw, 4)
    (out / "thesis").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    with pytest.raises(ForeignFolderError, match=r"notes\.txt") as err:
        prepare(raw, out, num_workers=1)
    assert str(out) in str(err.value)
    assert _snapshot(out) == before and sorted(os.listdir(out)) == ["notes.txt", "thesis"]


@pytest.mark.parametrize("threshold", [127, 50], ids=["same-settings", "threshold-changed"])
def test_user_files_inside_the_output_survive_a_rerun(prepared, threshold):
    raw, out = prepared
    mine = {
        "images/extra.txt": b"a note",
        "images/g0/mine.npy": b"not an array nailseg wrote",
        "masks/own/readme.md": b"mine too",
    }
    for rel, data in mine.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    summary = prepare(raw, out, num_workers=1, mask_threshold=threshold)
    assert summary.written == (10 if threshold != 127 else 0)
    for rel, data in mine.items():
        assert (out / rel).read_bytes() == data, rel
    arrays = {p.relative_to(out).as_posix() for p in out.rglob("*.npy")}
    assert arrays - {"images/g0/mine.npy"} == {
        f"{kind}/g{i % 2}/s{i:03d}.npy" for kind in ("images", "masks") for i in range(10)
    }


def test_temp_files_of_a_killed_run_go_but_look_alikes_of_users_stay(prepared):
    raw, out = prepared
    ours = [out / "images/g0/.s000.npy.4242.tmp", out / ".manifest.csv.4242.tmp"]
    users = [out / "images/g0/.keep", out / "images/g0/.notes.txt.1.tmp", out / ".hidden"]
    for path in ours + users:
        path.write_bytes(b"x")
    prepare(raw, out, num_workers=1)
    assert not any(p.exists() for p in ours)
    assert all(p.read_bytes() == b"x" for p in users)


def test_output_path_holding_a_users_file_is_not_overwritten(prepared):
    raw, out = prepared
    (out / "images/g0/s010.npy").write_bytes(b"the user's")
    save_image(raw / "Images" / "g0" / "s010.png", photo(seed=10))
    save_image(raw / "Masks" / "g0" / "s010.png", box_mask())
    prepare(raw, out, num_workers=1)
    assert (out / "images/g0/s010.npy").read_bytes() == b"the user's"
    assert "did not write" in _reasons(out)["s010.npy"]
    assert not (out / "masks/g0/s010.npy").exists()


# 2. input and output must not overlap


@pytest.mark.parametrize(
    "layout", ["same", "output-inside-input", "input-inside-output", "other-case", "symlink"]
)
def test_overlapping_input_and_output_are_refused(tmp_path, layout):
    data = tmp_path / "data"
    raw, out = {
        "same": (data, data),
        "output-inside-input": (data, data / "prepared"),
        "input-inside-output": (data / "raw", data),
        "other-case": (data, tmp_path / "Data" / "prepared"),
        "symlink": (data, tmp_path / "link"),
    }[layout]
    _pairs(raw, 4)
    if layout == "symlink":
        out.symlink_to(data)
    before = _snapshot(tmp_path)
    with pytest.raises(PrepareError, match="overlap") as err:
        prepare(raw, out, num_workers=1)
    assert str(raw) in str(err.value) and str(out) in str(err.value)
    assert _snapshot(tmp_path) == before
    assert layout != "other-case" or not (tmp_path / "Data").exists()


# 3. a bad request fails before the first write


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"valid_fraction": 1.5}, "split.valid_fraction=1.5"),
        ({"test_fraction": -0.1}, "split.test_fraction=-0.1"),
        ({"valid_fraction": 0.5, "test_fraction": 0.5}, "split.valid_fraction=0.5 + split.test"),
        ({"folds": 0}, "split.folds=0"),
        ({"folds": 5, "fold": 5}, "split.fold=5"),
        ({"valid_fraction": 0.0}, "split.valid_fraction=0 "),
        ({"input_dir": "no-images"}, "Images"),
        ({"input_dir": "no-masks"}, "Masks"),
    ],
    ids=[
        "valid_fraction=1.5",
        "test_fraction=-0.1",
        "fractions-sum-to-1",
        "folds=0",
        "fold=5-of-5",
        "valid_fraction=0",
        "no-Images",
        "no-Masks",
    ],
)
def test_bad_request_fails_before_any_write(prepared, settings, message):
    raw, out = prepared
    settings = dict(settings)
    broken = settings.pop("input_dir", None)
    if broken:
        raw = out.parent / broken
        (raw / ("Masks" if broken == "no-images" else "Images") / "g").mkdir(parents=True)
    before = _snapshot(out)
    with pytest.raises(PrepareError, match=re.escape(message)):
        prepare(raw, out, num_workers=1, **settings)
    assert _snapshot(out) == before


def test_bad_request_never_creates_the_output_folder(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "new"
    _pairs(raw, 4)
    with pytest.raises(PrepareError, match=r"split\.valid_fraction=1\.5"):
        prepare(raw, out, num_workers=1, valid_fraction=1.5)
    assert not out.exists()


# 4. safe reruns


@pytest.mark.parametrize("fault", ["input-emptied", "every-mask-empty"])
def test_rerun_with_no_usable_pair_changes_nothing(prepared, fault):
    raw, out = prepared
    for path in sorted(raw.rglob("*.png")):
        if fault == "input-emptied":
            path.unlink()
        elif path.parent.parent.name == "Masks":
            save_image(path, np.zeros((24, 32), np.uint8))
    before = _snapshot(out)
    with pytest.raises(PrepareError, match=r"no image files found|no usable image/mask pair"):
        prepare(raw, out, num_workers=1)
    assert _snapshot(out) == before


def test_rerun_missing_many_pairs_changes_nothing_and_says_how_to_accept(prepared):
    raw, out = prepared
    for stem in ("s000", "s002", "s004"):
        (raw / "Images" / "g0" / f"{stem}.png").unlink()
    before = _snapshot(out)
    with pytest.raises(PrepareError, match=r"3 of the 10 pairs.*prune=true"):
        prepare(raw, out, num_workers=1)
    assert _snapshot(out) == before
    summary = prepare(raw, out, num_workers=1, prune=True)
    assert summary.pruned == 3
    assert not any((out / "images" / "g0" / f"{s}.npy").exists() for s in ("s000", "s002", "s004"))


def test_outputs_of_a_pair_gone_from_the_input_stay_unless_pruned(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 20)
    prepare(raw, out, num_workers=1)
    (raw / "Images" / "g1" / "s001.png").unlink()
    (raw / "Masks" / "g1" / "s001.png").unlink()
    (out / "images/g1/user.txt").write_text("mine")
    kept = prepare(raw, out, num_workers=1)
    assert kept.kept_gone == 1 and "images/g1/s001.npy" not in _rows(out)
    assert (out / "images/g1/s001.npy").exists() and (out / "masks/g1/s001.npy").exists()
    pruned = prepare(raw, out, num_workers=1, prune=True)
    assert pruned.pruned == 1 and pruned.kept_gone == 0
    assert not (out / "images/g1/s001.npy").exists() and not (out / "masks/g1/s001.npy").exists()
    assert (out / "images/g1/user.txt").read_text() == "mine"


# 5. a killed first run resumes


def _kill_when(args: list[str], done: Callable[[], bool], timeout: float = 60) -> None:
    """Run `args` in its own process group and SIGKILL the group once `done()` holds."""
    proc = subprocess.Popen(
        args, cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None and not done():
        time.sleep(0.005)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    _, stderr = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, stderr.decode()


@pytest.mark.slow
@pytest.mark.parametrize("cut", [False, True], ids=["killed", "killed-mid-journal-line"])
def test_killed_first_run_resumes_without_redoing_finished_pairs(tmp_path, cut):
    raw, out, reference = tmp_path / "raw", tmp_path / "out", tmp_path / "reference"
    total = 160
    _pairs(raw, total, groups=3, size=(120, 160))
    prepare(raw, reference, num_workers=1)
    _kill_when(
        [sys.executable, "-c", PREPARE, str(raw), str(out)],
        lambda: len(list(out.glob("masks/*/*.npy"))) >= 40,
    )
    finished = len(list(out.glob("masks/*/*.npy")))
    assert finished < total, "the kill landed after the run"
    if cut:  # as if the kill had come in the middle of a journal line
        journal = out / "manifest.journal"
        journal.write_bytes(journal.read_bytes()[:-7])
    summary = prepare(raw, out, num_workers=1)
    assert summary.written + summary.up_to_date == total
    assert summary.written <= total - finished + 2
    assert {k: v[0] for k, v in _snapshot(out).items()} == {
        k: v[0] for k, v in _snapshot(reference).items()
    }


# 6. one prepare at a time per output folder


@pytest.mark.slow
def test_second_prepare_on_one_root_fails_at_once(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 60, groups=1)
    first = subprocess.Popen(
        [sys.executable, "-c", PREPARE, str(raw), str(out)], cwd=ROOT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (out / MARKER).exists():
            time.sleep(0.001)
        os.killpg(first.pid, signal.SIGSTOP)  # its first write is done: it holds the lock
        assert first.poll() is None, "the first prepare ended before it was stopped"
        start = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-c", PREPARE, str(raw), str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode != 0 and "another prepare is writing" in second.stderr
        assert time.monotonic() - start < 15
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    rerun = prepare(raw, out, num_workers=1)  # kill -9 left no stale lock
    assert rerun.written + rerun.up_to_date == 60


# 7. CSV names that look like missing values or need quoting


def test_names_that_look_missing_or_need_quoting_survive_reruns_and_the_datamodule(tmp_path):
    from nailseg.data.datamodule import read_split

    raw, out = tmp_path / "raw", tmp_path / "out"
    groups, stems = ("NA", "null", "None", "nan"), ("NA", 'a,b "c"', "nan")
    for group in groups:
        for i, stem in enumerate(stems):
            save_image(raw / "Images" / group / f"{stem}.png", photo(seed=i))
            save_image(raw / "Masks" / group / f"{stem}.png", box_mask())
    prepare(raw, out, num_workers=1)
    again = prepare(raw, out, num_workers=1)
    assert (again.written, again.up_to_date) == (0, 12)
    rows = [read_split(out, split) for split in ("train", "valid")]
    assert {g for frame in rows for g in frame["group"]} == set(groups)
    images = sorted(p for frame in rows for p in frame["images"])
    assert images == sorted(f"images/{g}/{s}.npy" for g in groups for s in stems)
    assert all((out / p).is_file() for p in images)


# 8. names and pixels


def test_name_not_valid_utf8_is_excluded_with_its_reason(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 4)
    buf = io.BytesIO()
    Image.fromarray(photo()).save(buf, format="PNG")
    for kind in ("Images", "Masks"):
        try:
            with open(os.fsencode(raw / kind / "g0") + b"/caf\xe9.png", "wb") as f:
                f.write(buf.getvalue())
        except OSError:
            pytest.skip("this filesystem refuses names that are not UTF-8")
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == 4
    reasons = _reasons(out)
    assert "UTF-8" in reasons["caf\\xe9.png"]


def test_names_differing_only_in_case_are_both_excluded(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 4)
    for stem in ("Nail", "nail"):
        save_image(raw / "Images" / "g0" / f"{stem}.png", photo())
        save_image(raw / "Masks" / "g0" / f"{stem}.png", box_mask())
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == 4
    clashes = [e for e in summary.excluded if "case" in e.kind]
    assert sorted(e.path.name for e in clashes) == ["Nail.png", "Nail.png", "nail.png", "nail.png"]
    assert not (out / "images/g0/Nail.npy").exists() and not (out / "images/g0/nail.npy").exists()


def test_symlinked_group_folders_are_followed(tmp_path):
    raw, out, elsewhere = tmp_path / "raw", tmp_path / "out", tmp_path / "elsewhere"
    _pairs(raw, 4)
    _pairs(elsewhere, 3, groups=1)
    for kind in ("Images", "Masks"):
        (raw / kind / "linked").symlink_to(elsewhere / kind / "g0", target_is_directory=True)
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == 7 and not summary.excluded
    assert {f"images/linked/s{i:03d}.npy" for i in range(3)} <= set(_rows(out))


def test_symlink_loop_is_reported_and_does_not_hang(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 4)
    (raw / "Images" / "g0" / "sub").mkdir()
    (raw / "Images" / "g0" / "sub" / "back").symlink_to("../..", target_is_directory=True)
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == 4
    loops = [e for e in summary.excluded if "twice" in e.kind]
    assert [e.path.name for e in loops] == ["back"]
    assert _reasons(out)["back"] == loops[0].kind


@pytest.mark.parametrize(
    ("dtype", "high", "ext"),
    [(np.uint16, 1, "png"), (np.uint16, 255, "png"), (np.int32, 255, "tif")],
    ids=["uint16-0-1", "uint16-0-255", "int32-0-255"],
)
def test_deep_masks_keep_their_label_values(tmp_path, dtype, high, ext):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 2)
    deep = (box_mask() > 0).astype(dtype) * high
    save_image(raw / "Images" / "g0" / "deep.png", photo())
    save_image(raw / "Masks" / "g0" / f"deep.{ext}", deep)
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == 3, summary.excluded
    assert np.load(out / "masks/g0/deep.npy").sum() == 36


def _grey12(path: Path, values: np.ndarray, significant: int | None = None) -> None:
    info = PngImagePlugin.PngInfo()
    if significant:
        info.add(b"sBIT", bytes([significant]))
    save_image(path, values.astype(np.uint16), pnginfo=info)


@pytest.mark.parametrize("kind", ["grey-max", "grey-sbit", "colour-max"])
def test_deep_images_are_scaled_by_their_bit_depth(tmp_path, kind):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 2)
    rng = np.random.default_rng(0)
    path = raw / "Images" / "g0" / "deep.png"
    if kind == "colour-max":
        values = rng.integers(0, 4096, (24, 32, 3)).astype(np.uint16)
        values[0, 0] = 4095
        cv2.imwrite(str(path), np.ascontiguousarray(values[..., ::-1]))
    else:  # a dim 12-bit image: only its sBIT tells it from a 10-bit one
        top = 4096 if kind == "grey-max" else 1000
        grey = rng.integers(0, top, (24, 32))
        grey[0, 0] = top - 1
        _grey12(path, grey, 12 if kind == "grey-sbit" else None)
        values = np.repeat(grey[..., None], 3, axis=2)
    save_image(raw / "Masks" / "g0" / "deep.png", box_mask())
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == 3 and summary.rescaled == {12: 1}
    expected = np.round(values.astype(np.float64) * 255 / 4095).astype(np.uint8)
    assert np.array_equal(np.load(out / "images/g0/deep.npy"), expected)


# 9. splits


@pytest.mark.parametrize("per_group", [1, 2, 3])
def test_validation_split_is_allocated_over_all_groups(per_group):
    groups = [f"g{i:02d}" for i in range(50) for _ in range(per_group)]
    stems = [f"s{j}" for _ in range(50) for j in range(per_group)]
    split = assign_splits(groups, stems, valid_fraction=0.2, seed=0)
    assert abs(split.count("valid") - 0.2 * len(split)) <= 1


def test_single_subject_gives_an_empty_validation_split_and_fails(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    for i in range(4):
        save_image(raw / "Images" / "g" / f"hand1_{i}.png", photo(seed=i))
        save_image(raw / "Masks" / "g" / f"hand1_{i}.png", box_mask())
    with pytest.raises(PrepareError, match=r"valid split .* is empty"):
        prepare(raw, out, num_workers=1, group_regex=r"^(hand\d+)_")
    assert not (out / "train.csv").exists()


# 10. the synthetic generator stays in its own folder


def test_generator_refuses_a_folder_it_did_not_make(tmp_path):
    photos = tmp_path / "photos"
    _pairs(photos, 2)
    before = _snapshot(photos)
    with pytest.raises(RuntimeError, match="photos"):
        generate(photos, n=4, seed=0)
    assert _snapshot(photos) == before


@pytest.mark.slow
def test_prepare_cli_does_not_generate_into_a_raw_dir_of_real_photos(tmp_path):
    photos, out = tmp_path / "photos", tmp_path / "out"
    _pairs(photos, 4)
    before = _snapshot(photos)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "prepare.py"),
            f"dataset.raw_dir={photos}",
            f"output_dir={out}",
            "dataset.synthetic.n=8",
            f"hydra.run.dir={tmp_path}/hydra",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and str(photos) in proc.stderr
    assert _snapshot(photos) == before and not out.exists()


# 11. #45: the root's lock, sources identified by content, interrupts, damaged files

GENERATE = "import sys; from nailseg.synth.scene import generate; generate(sys.argv[1], 400, 0)"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["prepare", "generator"])
def test_make_clean_leaves_a_live_prepare_or_generator_whole(tmp_path, command):
    """A live generator's set lost files to `make clean`, then was marked complete."""
    from nailseg.io.clean import clean

    raw, top = tmp_path / "raw", tmp_path / "data"
    folder = top / ("prepared" if command == "prepare" else "synthetic")
    _pairs(raw, 120, groups=1, size=(120, 160))
    script, args = (PREPARE, [raw, folder]) if command == "prepare" else (GENERATE, [folder])
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)], cwd=ROOT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(folder.rglob("*/*/*.*"))) < 10:
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGSTOP)  # live, and in the middle of its work
        before = _snapshot(folder)
        cleaned = clean(top)
        assert _snapshot(folder) == before and "in use" in cleaned.skipped[folder]
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    assert proc.wait(timeout=120) == 0
    assert clean(top).removed > 10 and not top.exists()  # done: nailseg's to clean


@pytest.mark.parametrize("change", ["swapped-by-renaming", "rewritten-same-size-and-time"])
def test_a_rerun_sees_a_source_changed_under_its_old_time(tmp_path, change):
    """Masks swapped by renaming kept their times: the rerun said "up to date", mis-paired."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 10)
    a, b = raw / "Masks/g0/s000.bmp", raw / "Masks/g0/s002.bmp"
    for path, box in ((a, 4), (b, 9)):
        (raw / "Masks/g0" / f"{path.stem}.png").unlink()
        save_image(path, box_mask(box=box))  # BMP: one size for any content
        os.utime(path, ns=(1_600_000_000 * 10**9,) * 2)
    prepare(raw, out, num_workers=1)
    if change == "swapped-by-renaming":
        a.rename(raw / "swap.bmp")
        b.rename(a)
        (raw / "swap.bmp").rename(b)
    else:
        a.write_bytes(b.read_bytes())
        os.utime(a, ns=(1_600_000_000 * 10**9,) * 2)
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == (2 if change == "swapped-by-renaming" else 1)
    assert np.load(out / "masks/g0/s000.npy")[..., 0].sum() == 81
    assert prepare(raw, out, num_workers=1).written == 0  # then up to date, by the cheap check


def test_prepare_refuses_a_root_a_training_is_reading(tmp_path):
    """prepare rewrote and pruned the root under a training, which then died."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pairs(raw, 10)
    prepare(raw, out, num_workers=1)
    save_image(raw / "Images/g0/s000.png", photo(seed=99))
    reader = subprocess.Popen(  # as the datamodule holds it while a training reads
        [
            sys.executable,
            "-c",
            "import sys; from nailseg.io.folder import lock_shared; "
            "lock_shared(sys.argv[1], 'dataset.root'); print('reading', flush=True); "
            "sys.stdin.read()",
            str(out),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert reader.stdout.readline() == b"reading\n"
        before = _snapshot(out)
        with pytest.raises(PrepareError, match=f"output_dir={out} is in use: .*a training is"):
            prepare(raw, out, num_workers=1, prune=True)
        assert _snapshot(out) == before
    finally:
        reader.communicate(b"", timeout=30)
    assert prepare(raw, out, num_workers=1).written == 1  # the training done: prepared


def _prepare_cli(tmp_path: Path, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "prepare.py"), f"paths.root_dir={tmp_path}", *args],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


@pytest.mark.slow
def test_prepare_runs_started_at_once_write_no_shared_run_folder(tmp_path):
    """Two prepare.py started in one second shared one Hydra run folder."""
    for name in ("a", "b"):
        _pairs(tmp_path / f"raw_{name}", 4)
    procs = [
        _prepare_cli(tmp_path, f"input_dir=raw_{name}", f"output_dir=out_{name}", "num_workers=1")
        for name in ("a", "b")
    ]
    for proc in procs:
        assert proc.communicate(timeout=120) and proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out_a", "out_b", "raw_a", "raw_b"]


@pytest.mark.slow
def test_ctrl_c_says_one_line_and_the_next_run_resumes(tmp_path):
    raw, out, total = tmp_path / "raw", tmp_path / "out", 120
    _pairs(raw, total, groups=3, size=(120, 160))
    proc = _prepare_cli(tmp_path, "input_dir=raw", "output_dir=out", "num_workers=2",
                        start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(out.glob("masks/*/*.npy"))) < 10:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends the terminal's foreground group
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and stderr.strip().startswith("prepare interrupted: ")
    assert len(stderr.strip().splitlines()) == 1, stderr
    summary = prepare(raw, out, num_workers=1)  # pairs in flight at the interrupt are redone
    assert summary.up_to_date > 0 and summary.written + summary.up_to_date == total
    assert not summary.excluded


@pytest.mark.slow
@pytest.mark.parametrize("name", ["manifest.csv", "manifest.journal"])
def test_a_fifo_in_the_root_is_refused_not_waited_on(prepared, name):
    raw, out = prepared
    (out / name).unlink(missing_ok=True)
    os.mkfifo(out / name)
    done = subprocess.run(
        [sys.executable, "-c", PREPARE, str(raw), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and f"{out / name} lies where nailseg would write" in done.stderr


@pytest.mark.parametrize(
    "damage", ["manifest-column-gone", "manifest-cut", "journal-put-there", "npy-cut"]
)
def test_damaged_files_in_the_root_say_one_line_or_are_redone(prepared, damage):
    """Damaged prepared files prepare rereads gave a traceback."""
    raw, out = prepared
    manifest = out / "manifest.csv"
    if damage == "manifest-column-gone":
        manifest.write_text(manifest.read_text().replace("mask_source", "something"))
    elif damage == "manifest-cut":
        manifest.write_bytes(manifest.read_bytes()[:100])
    elif damage == "journal-put-there":
        (out / "manifest.journal").write_text('{"record": {"group": 1}}\n[]\n')
    else:
        npy = out / "images/g0/s000.npy"
        npy.write_bytes(npy.read_bytes()[:50])
    if damage == "npy-cut":  # prepare's no more: left, the pair excluded, saying why
        summary = prepare(raw, out, num_workers=1)
        assert [e.kind for e in summary.excluded] == [OUTPUT_TAKEN]
        return
    with pytest.raises(NotOursError, match=r"manifest\.(csv|journal) lies where nailseg would"):
        prepare(raw, out, num_workers=1)
    (out / ("manifest.journal" if damage == "journal-put-there" else "manifest.csv")).unlink()
    summary = prepare(raw, out, num_workers=1)  # moved away, as the message says: redone
    assert summary.written + summary.up_to_date == 10
