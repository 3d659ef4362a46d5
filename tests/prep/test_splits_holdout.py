"""Leave-one-source-out splits: `split.holdout_groups` sends every photo of the named groups to
test.csv and splits the other groups as if the held-out ones were absent."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from support.image_files import box_mask, photo, save_image
from support.prep_settings import assign_splits, prepare

from nailseg.config import CONF_DIR
from nailseg.prep.format import read_table
from nailseg.prep.prepare import PrepareError, run
from nailseg.prep.splits import subject_of

REAL_SUBJECT = r"^(\d+_\d+)_|^(None_\d+)-"
SIZES = {"1": 6, "2": 4, "3": 5}  # photos per group of the tiny raw folder


def _samples() -> tuple[list[str], list[str]]:
    """Three groups of unequal size, three photos per subject."""
    groups, stems = [], []
    for group, subjects in (("1", 12), ("2", 7), ("3", 9)):
        for s in range(subjects):
            for take in (1, 2, 3):
                groups.append(group)
                stems.append(f"170517_{group}{s}_L_{take}")
    return groups, stems


def _raw(root: Path) -> Path:
    for group, n in SIZES.items():
        for i in range(n):
            save_image(root / "Images" / group / f"p{i}.png", photo(seed=i))
            save_image(root / "Masks" / group / f"p{i}.png", box_mask())
    return root


def _compose(raw: Path, out: Path, *overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(
            "prepare",
            overrides=[f"input_dir={raw}", f"output_dir={out}", "num_workers=1", *overrides],
        )


def _groups(out: Path) -> dict[str, Counter[str]]:
    """Rows per group of each split CSV that exists."""
    return {
        split: Counter(read_table(out / f"{split}.csv")["group"])
        for split in ("train", "valid", "test")
        if (out / f"{split}.csv").exists()
    }


def _files(out: Path) -> dict[str, tuple[bytes, int]]:
    return {
        p.relative_to(out).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


# --- assign_splits ---------------------------------------------------------------------------


def test_holdout_group_is_all_test_and_only_it():
    groups, stems = _samples()
    split = assign_splits(groups, stems, seed=0, group_regex=REAL_SUBJECT, holdout_groups=["2"])
    by_group = {g: {s for gg, s in zip(groups, split, strict=True) if gg == g} for g in "123"}
    assert by_group["2"] == {"test"}
    assert by_group["1"] == by_group["3"] == {"train", "valid"}


@pytest.mark.parametrize(
    "settings",
    [
        dict(valid_fraction=0.2),
        dict(valid_fraction=0.3, test_fraction=0.2),
        dict(valid_fraction=0.25, group_regex=REAL_SUBJECT, seed=7),
        dict(group_regex=REAL_SUBJECT, folds=4, fold=1),
        dict(test_fraction=0.1, group_regex=REAL_SUBJECT, folds=3, fold=2),
    ],
    ids=["valid", "valid+test", "subjects", "folds", "test+folds"],
)
def test_the_other_groups_split_as_if_the_held_out_ones_were_absent(settings):
    groups, stems = _samples()
    held = assign_splits(groups, stems, holdout_groups=["2"], **settings)
    rest = [i for i, g in enumerate(groups) if g != "2"]
    alone = assign_splits([groups[i] for i in rest], [stems[i] for i in rest], **settings)
    assert [held[i] for i in rest] == alone
    assert {held[i] for i, g in enumerate(groups) if g == "2"} == {"test"}


def test_test_fraction_still_applies_to_the_remaining_groups():
    groups, stems = _samples()
    split = assign_splits(
        groups, stems, valid_fraction=0.2, test_fraction=0.25, holdout_groups=["1"]
    )
    remaining = sum(g != "1" for g in groups)
    from_rest = sum(s == "test" and g != "1" for g, s in zip(groups, split, strict=True))
    assert from_rest == round(0.25 * remaining)
    assert split.count("test") == groups.count("1") + from_rest


def test_holdout_names_compare_as_text_and_repeat_harmlessly():
    groups, stems = _samples()
    as_text = assign_splits(groups, stems, holdout_groups=["2"])
    assert assign_splits(groups, stems, holdout_groups=[2]) == as_text  # Hydra's `[2]` is an int
    assert assign_splits(groups, stems, holdout_groups=[2, "2"]) == as_text
    assert assign_splits(groups, stems, holdout_groups=[]) == assign_splits(groups, stems)
    both = assign_splits(groups, stems, holdout_groups=[1, 3])
    assert all((s == "test") == (g != "2") for g, s in zip(groups, both, strict=True))


def test_unknown_or_every_group_held_out_is_an_error():
    groups, stems = _samples()
    with pytest.raises(ValueError, match=r"split\.holdout_groups.*\['4', 'x'\].*\['1', '2', '3'\]"):
        assign_splits(groups, stems, holdout_groups=["x", 4, "2"])
    with pytest.raises(ValueError, match=r"split\.holdout_groups.*every group"):
        assign_splits(groups, stems, holdout_groups=["1", "2", "3"])
    with pytest.raises(ValueError, match=r"split\.valid_fraction"):  # the old checks still run
        assign_splits(groups, stems, valid_fraction=1.5, holdout_groups=["2"])


# --- prepare.py, composed through Hydra ----------------------------------------------------------


def test_default_is_no_holdout(tmp_path):
    cfg = _compose(tmp_path / "raw", tmp_path / "out")
    assert list(cfg.split.holdout_groups) == []


def test_prepare_holds_out_a_group_into_test_csv(tmp_path):
    raw, out = _raw(tmp_path / "raw"), tmp_path / "out"
    cfg = _compose(raw, out, "split.holdout_groups=[2]", "split.test_fraction=0")
    assert list(cfg.split.holdout_groups) == ["2"]
    summary = run(cfg)
    rows = _groups(out)
    assert rows["test"] == Counter({"2": SIZES["2"]})
    assert "2" not in rows["train"] and "2" not in rows["valid"]
    assert rows["train"] + rows["valid"] == Counter({"1": SIZES["1"], "3": SIZES["3"]})
    assert summary.split_sizes == {"train": 9, "valid": 2, "test": 4}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("holdout", "message"),
    [
        ("[2,nope]", r"split\.holdout_groups.*\['nope'\].*\['1', '2', '3'\]"),
        ("[1,2,3]", r"split\.holdout_groups.*every group"),
    ],
)
def test_a_bad_holdout_fails_before_any_write(tmp_path, holdout, message):
    raw, out = _raw(tmp_path / "raw"), tmp_path / "out"
    with pytest.raises(PrepareError, match=message):
        run(_compose(raw, out, f"split.holdout_groups={holdout}"))
    assert not out.exists()  # not even the marker or the lock file
    run(_compose(raw, out))
    before = _files(out)
    with pytest.raises(PrepareError, match=message):
        run(_compose(raw, out, f"split.holdout_groups={holdout}"))
    assert _files(out) == before  # an existing root: untouched, bytes and times


def test_a_held_out_group_with_no_usable_pair_fails(tmp_path):
    raw = _raw(tmp_path / "raw")
    for mask in (raw / "Masks" / "2").iterdir():  # every mask of group 2 empty: all excluded
        save_image(mask, box_mask() * 0)
    with pytest.raises(PrepareError, match=r"split\.holdout_groups.*\['2'\].*no usable pair"):
        run(_compose(raw, tmp_path / "out", "split.holdout_groups=[2]"))


@pytest.mark.slow
def test_rerun_with_another_holdout_resplits_without_converting(tmp_path):
    raw, out = _raw(tmp_path / "raw"), tmp_path / "out"
    run(_compose(raw, out, "split.holdout_groups=[2]"))
    assert set(_groups(out)["test"]) == {"2"}
    again = run(_compose(raw, out, "split.holdout_groups=[3]"))
    assert again.written == 0 and again.up_to_date == sum(SIZES.values())
    rows = _groups(out)
    assert rows["test"] == Counter({"3": SIZES["3"]})
    assert "3" not in rows["train"] + rows["valid"]
    assert {"1", "2"} <= set(rows["train"] + rows["valid"])
    run(_compose(raw, out))  # no holdout, test_fraction=0: test.csv goes
    assert "test" not in _groups(out)
    fresh = tmp_path / "fresh"
    run(_compose(raw, fresh))
    for split in ("train", "valid"):
        assert (out / f"{split}.csv").read_bytes() == (fresh / f"{split}.csv").read_bytes()


@pytest.mark.real_data
def test_real_data_holdout_group_2(real_data, tmp_path):
    out = tmp_path / "nails"
    summary = prepare(
        real_data,
        out,
        seed=42,
        group_regex=REAL_SUBJECT,
        test_fraction=0.0,
        holdout_groups=[2],
        num_workers=2,
    )
    test = read_table(out / "test.csv")
    assert len(test) == 502 and set(test["group"]) == {"2"}
    train, valid = read_table(out / "train.csv"), read_table(out / "valid.csv")
    assert set(train["group"]) == set(valid["group"]) == {"1"}
    assert summary.split_sizes["train"] + summary.split_sizes["valid"] == 665 - 502
    pattern = re.compile(REAL_SUBJECT)
    sides = [{subject_of(Path(p).stem, pattern) for p in f["images"]} for f in (train, valid)]
    assert not sides[0] & sides[1]
