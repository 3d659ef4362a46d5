"""prepare.py on generated folders (every pairing rule and exclusion) and on the real photos."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image, PngImagePlugin
from rich.console import Console
from support.image_files import box_mask, photo, save_image
from support.prep_settings import assign_splits, prepare

from nailseg.io.folder import OWN_NAMES, read_marker
from nailseg.prep.format import JOURNAL_FILE, read_table
from nailseg.prep.layout import (
    DUPLICATE_STEM,
    EMPTY_MASK,
    NO_IMAGE,
    NO_MASK,
    SIZE_MISMATCH,
    UNREADABLE,
    UNSUPPORTED,
)
from nailseg.prep.prepare import PrepareError
from nailseg.prep.splits import subject_of
from nailseg.progress import progress

ROOT = Path(__file__).resolve().parents[2]
REAL_SUBJECT = r"^(\d+_\d+)_|^(None_\d+)-"


def _pair(
    root: Path, group: str, stem: str, image_ext: str = "png", mask_ext: str = "png", seed: int = 0
):
    save_image(root / "Images" / group / f"{stem}.{image_ext}", photo(seed=seed))
    save_image(root / "Masks" / group / f"{stem}.{mask_ext}", box_mask())


def _load(root: Path, rel: str) -> np.ndarray:
    return np.load(root / rel, allow_pickle=False)


def _all_rows(out: Path) -> pd.DataFrame:
    frames = [
        read_table(out / f"{s}.csv") for s in ("train", "valid") if (out / f"{s}.csv").exists()
    ]
    return pd.concat(frames, ignore_index=True)


def test_pairs_across_extensions_and_case(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pair(raw, "g1", "a", "JPG", "png")
    _pair(raw, "g1", "b", "png", "TIFF")
    _pair(raw, "g2", "c", "jpeg", "BMP")
    _pair(raw, "g2", "d", "Png", "jpg")
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == 4 and not summary.excluded
    files = [p for p in out.rglob("*") if p.is_file() and not p.name.startswith(".nailseg")]
    assert summary.megabytes == pytest.approx(sum(p.stat().st_size for p in files) / 1e6)
    rows = _all_rows(out)
    assert sorted(rows["images"]) == [
        "images/g1/a.npy",
        "images/g1/b.npy",
        "images/g2/c.npy",
        "images/g2/d.npy",
    ]
    for _, row in rows.iterrows():
        image, mask = _load(out, row["images"]), _load(out, row["masks"])
        assert image.dtype == np.uint8 and image.shape == (24, 32, 3) and image.flags.c_contiguous
        assert mask.dtype == np.uint8 and mask.shape == (24, 32, 1)
        assert set(np.unique(mask)) <= {0, 1}
        assert row["height"] == 24 and row["width"] == 32
        assert row["fg_fraction"] == pytest.approx(36 / (24 * 32), abs=2e-2)  # JPEG masks: ±edge


def test_flat_images_folder_is_one_group(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    for stem in ("x", "y", "z"):
        save_image(raw / "Images" / f"{stem}.png", photo())
        save_image(raw / "Masks" / f"{stem}.png", box_mask())
    save_image(raw / "Images" / "lonely.png", photo())
    summary = prepare(raw, out, num_workers=1, valid_fraction=0.3)
    rows = _all_rows(out)
    assert set(rows["group"]) == {"all"} and len(rows) == 3
    # the missing mask where the user would put it (it named Masks/all/lonely.*: no such folder)
    assert [e.detail for e in summary.excluded] == ["no Masks/lonely.* found"]


def test_noisy_jpeg_masks_are_binarised(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    yy, xx = np.mgrid[:64, :64]
    truth = (((yy - 30) ** 2 + (xx - 35) ** 2) < 15**2).astype(np.uint8) * 255
    save_image(raw / "Images" / "g" / "n.png", photo(64, 64))
    save_image(raw / "Masks" / "g" / "n.jpg", truth, quality=60)
    _pair(raw, "g", "clean")
    assert len(np.unique(np.asarray(Image.open(raw / "Masks" / "g" / "n.jpg")))) > 2  # really noisy
    summary = prepare(raw, out, num_workers=1)
    assert summary.nonbinary_masks == 1 and summary.max_distinct_values > 2
    mask = _load(out, "masks/g/n.npy")[..., 0]
    assert set(np.unique(mask)) == {0, 1}
    assert (mask != (truth > 127)).mean() < 0.01


def test_mask_threshold_and_01_masks(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    grey = np.zeros((24, 32), np.uint8)
    grey[:, :16] = 100  # below the default threshold, above 50
    grey[0, 0] = 255
    save_image(raw / "Images" / "g" / "t.png", photo())
    save_image(raw / "Masks" / "g" / "t.png", grey)
    save_image(raw / "Images" / "g" / "u.png", photo())
    save_image(raw / "Masks" / "g" / "u.png", (box_mask() > 0).astype(np.uint8))  # stored as {0, 1}
    prepare(raw, out, num_workers=1)
    assert _load(out, "masks/g/t.npy").sum() == 1
    assert _load(out, "masks/g/u.npy").sum() == 36  # {0,1} masks are not emptied by the threshold
    redone = prepare(raw, out, num_workers=1, mask_threshold=50)  # settings change: redo
    assert redone.written == 2 and redone.up_to_date == 0
    assert _load(out, "masks/g/t.npy").sum() == 24 * 16


def test_image_modes_and_exif_orientation(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    rgb = photo(20, 30)
    save_image(raw / "Images" / "g" / "grey.png", rgb[..., 0])
    save_image(
        raw / "Images" / "g" / "rgba.png", np.dstack([rgb, np.full((20, 30), 128, np.uint8)])
    )
    Image.fromarray(rgb).convert("P").save(raw / "Images" / "g" / "pal.png")
    save_image(raw / "Images" / "g" / "deep.png", (rgb[..., 0].astype(np.uint16) * 257))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise to display
    Image.fromarray(rgb).save(raw / "Images" / "g" / "rot.jpg", exif=exif.tobytes(), quality=95)
    for stem in ("grey", "rgba", "pal", "deep"):
        save_image(raw / "Masks" / "g" / f"{stem}.png", box_mask(20, 30, box=5))
    save_image(
        raw / "Masks" / "g" / "rot.png", box_mask(30, 20, box=5)
    )  # drawn on the displayed photo
    red = np.zeros((20, 30, 3), np.uint8)
    red[5:10, 5:10, 0] = 255  # a coloured annotation: red nail on black
    save_image(raw / "Images" / "g" / "red.png", rgb)
    save_image(raw / "Masks" / "g" / "red.png", red)
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == 6, summary.excluded
    assert summary.rescaled == {16: 1}
    assert np.array_equal(_load(out, "images/g/grey.npy"), np.repeat(rgb[..., :1], 3, axis=2))
    assert np.array_equal(_load(out, "images/g/rgba.npy"), rgb)
    assert _load(out, "images/g/pal.npy").shape == (20, 30, 3)
    assert np.array_equal(_load(out, "images/g/deep.npy")[..., 0], rgb[..., 0])
    assert _load(out, "images/g/rot.npy").shape == (30, 20, 3)
    assert _load(out, "masks/g/red.npy").sum() == 25


@pytest.mark.parametrize("layout", ["bit-replicated", "zero-padded"])
def test_sbit_image_scaled_to_16_bits_as_the_png_spec_says(tmp_path, layout):
    raw, out = tmp_path / "raw", tmp_path / "out"
    grey = np.random.default_rng(0).integers(0, 4096, (24, 32))
    grey[0, 0] = 4095
    stored = grey << 4 | (grey >> 8 if layout == "bit-replicated" else 0)  # 12 significant bits
    info = PngImagePlugin.PngInfo()
    info.add(b"sBIT", bytes([12]))
    save_image(raw / "Images" / "g" / "deep.png", stored.astype(np.uint16), pnginfo=info)
    save_image(raw / "Masks" / "g" / "deep.png", box_mask())
    _pair(raw, "g", "plain")
    summary = prepare(raw, out, num_workers=1)
    assert summary.written == 2 and summary.rescaled == {12: 1}
    expected = np.round(grey * 255 / 4095).astype(np.uint8)
    assert np.array_equal(_load(out, "images/g/deep.npy"), np.repeat(expected[..., None], 3, 2))


def test_every_exclusion_names_file_and_fault(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    _pair(raw, "g", "good")
    _pair(raw, "g", "fine")
    save_image(raw / "Images" / "g" / "lonely.png", photo())
    save_image(raw / "Masks" / "g" / "orphan.png", box_mask())
    save_image(raw / "Masks" / "g" / "corrupt.png", box_mask())
    (raw / "Images" / "g" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    buf = io.BytesIO()
    Image.fromarray(photo()).save(buf, format="PNG")
    save_image(raw / "Masks" / "g" / "truncated.png", box_mask())
    (raw / "Images" / "g" / "truncated.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    save_image(raw / "Images" / "g" / "big.png", photo(40, 40))
    save_image(raw / "Masks" / "g" / "big.png", box_mask())
    save_image(raw / "Images" / "g" / "blank.png", photo())
    save_image(raw / "Masks" / "g" / "blank.png", np.zeros((24, 32), np.uint8))
    save_image(raw / "Images" / "g" / "twice.png", photo())
    save_image(raw / "Images" / "g" / "twice.jpg", photo())
    save_image(raw / "Masks" / "g" / "twice.png", box_mask())
    (raw / "Images" / "g" / "notes.txt").write_text("not an image")
    (raw / "Images" / "g" / ".DS_Store").write_bytes(b"ignored")

    summary = prepare(raw, out, num_workers=2)
    assert summary.written == 2
    by_name = {}
    for exclusion in summary.excluded:
        by_name.setdefault(exclusion.path.name, []).append(exclusion)
    expected = {
        "lonely.png": NO_MASK,
        "orphan.png": NO_IMAGE,
        "corrupt.png": UNREADABLE,
        "truncated.png": UNREADABLE,
        "big.png": SIZE_MISMATCH,
        "blank.png": EMPTY_MASK,
        "twice.jpg": DUPLICATE_STEM,
        "notes.txt": UNSUPPORTED,
    }
    for name, kind in expected.items():
        assert by_name[name][0].kind == kind, (name, by_name[name])
        assert name in str(by_name[name][0])  # the message names the file ...
    assert "40x40" in by_name["big.png"][0].detail and "32x24" in by_name["big.png"][0].detail
    assert {e.path.name for e in summary.excluded if e.kind == DUPLICATE_STEM} == {
        "twice.png",
        "twice.jpg",
    }
    assert ".DS_Store" not in by_name
    listed = read_table(out / "excluded.csv")
    assert len(listed) == len(summary.excluded) and set(listed["reason"]) == set(expected.values())

    with pytest.raises(PrepareError, match="strict"):
        prepare(raw, out, num_workers=1, strict=True)


def test_nothing_usable_fails_naming_the_reason(tmp_path):
    raw = tmp_path / "raw"
    with pytest.raises(PrepareError, match="does not exist"):
        prepare(raw, tmp_path / "out")
    raw.mkdir()
    with pytest.raises(PrepareError, match="Images"):
        prepare(raw, tmp_path / "out")
    (raw / "Images").mkdir()
    (raw / "Masks").mkdir()
    with pytest.raises(PrepareError, match="no image files found"):
        prepare(raw, tmp_path / "out")
    save_image(raw / "Images" / "g" / "a.png", photo())
    save_image(raw / "Masks" / "g" / "a.png", np.zeros((24, 32), np.uint8))
    with pytest.raises(PrepareError, match="1 empty mask"):
        prepare(raw, tmp_path / "out", num_workers=1)


def _run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "prepare.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.slow
def test_a_synthetic_prepare_shows_its_progress_in_a_pipe(tmp_path):
    """`python prepare.py dataset=synthetic_mix` printed nothing for minutes in a pipe or a log
    (a progress bar draws only on a terminal): each long step now says where it is."""
    data = tmp_path / "data"
    proc = _run_cli("dataset=synthetic_mix", "dataset.synthetic.n=6", f"paths.data_dir={data}")
    lines = proc.stdout.splitlines()
    steps = [
        "generating synthetic photos: 0/6 (0%)",
        "generating synthetic photos: 6/6 (100%)",
        "converting pairs: 0/6 (0%)",
        "converting pairs: 6/6 (100%)",
        "prepare summary",
    ]
    at = [next(i for i, line in enumerate(lines) if step in line) for step in steps]
    assert at == sorted(at), proc.stdout
    rerun = _run_cli("dataset=synthetic_mix", "dataset.synthetic.n=6", f"paths.data_dir={data}")
    assert "generating" not in rerun.stdout and "converting" not in rerun.stdout  # nothing to do


def test_progress_off_a_terminal_is_a_line_now_and_then():
    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    with progress("converting pairs", 3, console, every_s=0.0) as advance:
        for _ in range(3):
            advance(1)
    lines = console.file.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "converting pairs: 0/3 (0%)",
        "converting pairs: 1/3 (33%)",
        "converting pairs: 2/3 (67%)",
        "converting pairs: 3/3 (100%)",
    ]
    assert all(re.fullmatch(r".*, \d+ s", line) for line in lines)


@pytest.mark.slow
def test_cli_exit_codes(tmp_path):
    raw = tmp_path / "raw"
    _pair(raw, "g", "a")
    _pair(raw, "g", "c")
    save_image(raw / "Images" / "g" / "b.png", photo())
    out = tmp_path / "out"
    ok = _run_cli(
        f"input_dir={raw}", f"output_dir={out}", "num_workers=1", f"hydra.run.dir={tmp_path}/h1"
    )
    assert "pairs written" in ok.stdout and "b.png" in ok.stdout
    strict = _run_cli(
        f"input_dir={raw}",
        f"output_dir={out}",
        "strict=true",
        f"hydra.run.dir={tmp_path}/h2",
        check=False,
    )
    assert strict.returncode != 0 and "strict" in strict.stderr and "b.png" in strict.stderr
    missing = _run_cli(
        f"input_dir={tmp_path}/nope",
        f"output_dir={out}",
        f"hydra.run.dir={tmp_path}/h3",
        check=False,
    )
    assert missing.returncode != 0 and "nope" in missing.stderr


def test_subject_split_keeps_each_subject_on_one_side():
    stems = [f"170517_{s}_{hand}_{take}" for s in range(30) for hand in "LR" for take in (1, 2)]
    stems += [f"None_2017032{d}-1511{t}" for d in range(5) for t in range(3)]
    groups = ["1"] * len(stems)
    split = assign_splits(groups, stems, valid_fraction=0.2, seed=3, group_regex=REAL_SUBJECT)
    pattern = re.compile(REAL_SUBJECT)
    sides: dict[str, set[str]] = {}
    for stem, name in zip(stems, split, strict=True):
        sides.setdefault(subject_of(stem, pattern), set()).add(name)
    assert all(len(s) == 1 for s in sides.values())
    assert 0.15 <= split.count("valid") / len(split) <= 0.25
    assert subject_of("None_20170327-151128", pattern) == "None_20170327"
    assert split == assign_splits(
        groups, stems, valid_fraction=0.2, seed=3, group_regex=REAL_SUBJECT
    )
    assert split != assign_splits(
        groups, stems, valid_fraction=0.2, seed=4, group_regex=REAL_SUBJECT
    )


def test_split_is_stratified_by_group():
    groups = ["a"] * 80 + ["b"] * 20
    stems = [f"s{i}" for i in range(100)]
    split = assign_splits(groups, stems, valid_fraction=0.25, seed=0)
    valid_a = sum(g == "a" and s == "valid" for g, s in zip(groups, split, strict=True))
    valid_b = sum(g == "b" and s == "valid" for g, s in zip(groups, split, strict=True))
    assert (valid_a, valid_b) == (20, 5)
    with_test = assign_splits(groups, stems, valid_fraction=0.2, test_fraction=0.1, seed=0)
    assert with_test.count("test") == 10 and with_test.count("valid") == 20


def test_k_fold_covers_each_sample_once():
    stems = [f"170517_{s}_L_{t}" for s in range(23) for t in (1, 2, 3)]
    groups = [str(i % 2) for i in range(len(stems))]
    times_valid = np.zeros(len(stems), int)
    for fold in range(5):
        split = assign_splits(groups, stems, seed=1, group_regex=REAL_SUBJECT, folds=5, fold=fold)
        times_valid += np.array([s == "valid" for s in split])
        assert 0.1 <= split.count("valid") / len(stems) <= 0.3
    assert (times_valid == 1).all()
    with pytest.raises(ValueError, match="fold"):
        assign_splits(groups, stems, folds=5, fold=5)


def _snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every file but the marker and journal, which hold the root's own id and its files' records."""
    return {
        p.relative_to(out).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in OWN_NAMES
    }


def test_rerun_is_idempotent_and_resyncs_changes(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    for i in range(10):
        _pair(raw, f"g{i % 2}", f"s{i}", seed=i)
    first = prepare(raw, out, num_workers=2)
    before = _snapshot(out)
    again = prepare(raw, out, num_workers=2)
    assert (first.written, again.written, again.up_to_date) == (10, 0, 10)
    after = _snapshot(out)
    assert after.keys() == before.keys()
    for name, (data, mtime) in before.items():
        assert after[name][0] == data, name  # CSVs byte-identical, arrays untouched
        if name.endswith(".npy"):
            assert after[name][1] == mtime, name  # not rewritten

    (raw / "Images" / "g0" / "s0.png").unlink()
    (raw / "Masks" / "g0" / "s0.png").unlink()
    save_image(raw / "Images" / "g1" / "s1.png", photo(seed=99))  # changed photo: reconverted
    save_image(raw / "Masks" / "g1" / "s3.png", box_mask(box=8))  # changed mask: new fg_fraction
    changed = prepare(raw, out, num_workers=1)
    assert (changed.written, changed.up_to_date, changed.kept_gone) == (2, 7, 1)
    rows = _all_rows(out).set_index("masks")
    assert rows.loc["masks/g1/s3.npy", "fg_fraction"] == pytest.approx(64 / (24 * 32), abs=1e-6)
    assert "masks/g0/s0.npy" not in rows.index  # gone from the CSVs ...
    assert (out / "images/g0/s0.npy").exists() and (out / "masks/g0/s0.npy").exists()  # not disk
    assert np.array_equal(_load(out, "images/g1/s1.npy"), photo(seed=99))

    pruned = prepare(raw, out, num_workers=1, prune=True)
    assert (pruned.written, pruned.up_to_date, pruned.pruned, pruned.kept_gone) == (0, 9, 1, 0)
    assert not (out / "images/g0/s0.npy").exists() and not (out / "masks/g0/s0.npy").exists()
    assert len(_all_rows(out)) == 9


def test_root_carries_its_marker_and_no_pair_journal_after_a_run(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    for i in range(4):
        _pair(raw, "g", f"s{i}", seed=i)
    prepare(raw, out, num_workers=1)
    marker = read_marker(out)
    assert (marker["kind"], marker["complete"], marker["mask_threshold"]) == ("prepare", True, 127)
    assert not (out / JOURNAL_FILE).exists()
    manifest = read_table(out / "manifest.csv")
    assert sorted(manifest["images"]) == [f"images/g/s{i}.npy" for i in range(4)]


def test_split_depends_on_names_and_seed_only():
    stems = [f"s{i}" for i in range(60)]
    groups = [f"g{i % 7}" for i in range(60)]
    split = assign_splits(groups, stems, valid_fraction=0.2, test_fraction=0.1, seed=5)
    shuffled = np.random.default_rng(0).permutation(60)
    again = assign_splits(
        [groups[i] for i in shuffled], [stems[i] for i in shuffled], valid_fraction=0.2,
        test_fraction=0.1, seed=5,
    )  # fmt: skip
    assert [again[list(shuffled).index(i)] for i in range(60)] == split
    assert (split.count("valid"), split.count("test")) == (12, 6)


@pytest.mark.slow
def test_kill_and_rerun_gives_the_uninterrupted_outputs(tmp_path):
    raw = tmp_path / "raw"
    for i in range(240):
        save_image(raw / "Images" / f"g{i % 3}" / f"s{i:03d}.png", photo(120, 160, seed=i))
        save_image(
            raw / "Masks" / f"g{i % 3}" / f"s{i:03d}.png", box_mask(120, 160, box=10 + i % 20)
        )
    reference = tmp_path / "reference"
    _run_cli(
        f"input_dir={raw}",
        f"output_dir={reference}",
        "num_workers=2",
        f"hydra.run.dir={tmp_path}/h0",
    )
    expected = {k: v[0] for k, v in _snapshot(reference).items()}

    out = tmp_path / "out"
    args = [
        sys.executable,
        str(ROOT / "prepare.py"),
        f"input_dir={raw}",
        f"output_dir={out}",
        "num_workers=2",
    ]
    left = []
    for attempt, threshold in enumerate((20, 80, 150)):
        proc = subprocess.Popen(
            [*args, f"hydra.run.dir={tmp_path}/k{attempt}"],
            cwd=ROOT,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(out.glob("masks/*/*.npy"))) < threshold:
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)  # the whole process group: the workers die too
        proc.wait()
        for path in out.rglob("*.npy"):  # no truncated array under a final name, ever
            np.load(path, allow_pickle=False)
        left.append(len(list(out.glob("masks/*/*.npy"))))
    assert min(left) < 240, "no kill landed mid-run"
    assert not (out / "train.csv").exists() or left[-1] == 240  # CSVs come last
    _run_cli(
        f"input_dir={raw}", f"output_dir={out}", "num_workers=2", f"hydra.run.dir={tmp_path}/h1"
    )
    assert {k: v[0] for k, v in _snapshot(out).items()} == expected


@pytest.mark.real_data
def test_real_data_all_pairs(real_data, tmp_path):
    out = tmp_path / "nails"
    summary = prepare(real_data, out, valid_fraction=0.2, seed=42, group_regex=REAL_SUBJECT)
    assert summary.written == 665 and not summary.excluded
    rows = _all_rows(out)
    assert len(rows) == 665 and set(rows["group"]) == {"1", "2"}
    for _, row in rows.iterrows():
        mask = _load(out, row["masks"])
        source = np.asarray(
            Image.open(
                real_data / "Masks" / row["masks"].removeprefix("masks/").replace(".npy", ".png")
            )
        )
        assert mask.dtype == np.uint8 and set(np.unique(mask)) <= {0, 1}
        assert int(mask.sum()) == int((source == 255).sum())
        assert _load(out, row["images"]).shape == (*source.shape[:2], 3)
    pattern = re.compile(REAL_SUBJECT)
    valid = read_table(out / "valid.csv")
    train = read_table(out / "train.csv")
    subjects = {
        name: {
            subject_of(Path(p).stem, pattern) for p in frame.loc[frame["group"] == "1", "images"]
        }
        for name, frame in (("train", train), ("valid", valid))
    }
    assert subjects["valid"] and not subjects["train"] & subjects["valid"]
