"""Seeded train/valid/test splits, stratified by group, that keep each subject on one side.

A subject is what `group_regex` extracts from a file stem (its first non-empty capture group, or
the whole match): all photos of one subject in a group land in the same split, so near-identical
shots of one hand cannot leak from train into valid. A stem the regex does not match is its own
subject.

The split sizes are allocated over the whole set, not per group: every subject gets a position in
[0, 1) within its group (the middle of its share of the group's samples, in a seeded shuffle), and
subjects are taken in order of position, so each split draws from every group in proportion, and
the overall split is within one subject of the requested fraction however small the groups are
(50 groups of one photo each still give a 20% validation split). The result depends only on the
seed and the names, never on their order.

Leave-one-source-out: every photo of a group named in `holdout_groups` is "test", and the other
groups are split exactly as if the held-out groups were absent (the fractions count the remaining
photos only), so holding a group out never moves a photo of another group between train and valid.

The split CSVs prepare writes are read back by `read_split_file`, which names the file, row and
column of a damaged value (a column missing, a cell emptied, NaN) before training starts.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pandas as pd

from nailseg.prep.format import CSV_COLUMNS, NUMERIC_DTYPES

Unit = tuple[str, str]  # (group, subject): what is kept whole


class SplitFileError(ValueError):
    """A split CSV that cannot be trained on; the message names the file, row and column."""


def _fraction(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and 0.0 <= value <= 1.0


# what each of CSV_COLUMNS must hold, as text, and how to say it
_VALID: dict[str, tuple[Callable[[str], bool], str]] = {
    "images": (bool, "a path"),
    "masks": (bool, "a path"),
    "group": (bool, "a group name"),
    "height": (lambda text: re.fullmatch("[0-9]+", text) is not None and int(text) > 0, "a size"),
    "width": (lambda text: re.fullmatch("[0-9]+", text) is not None and int(text) > 0, "a size"),
    "fg_fraction": (_fraction, "a fraction in [0, 1]"),
}


def read_split_file(path: Path) -> pd.DataFrame:
    """A split CSV's rows, typed as `format.read_table` types them, every value checked first:
    a missing column or a value that is not what its column holds (empty, NaN) is a
    SplitFileError naming the file, the row (1: the first below the header) and the column."""
    try:
        rows = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (ValueError, pd.errors.ParserError) as err:  # an empty file, a broken quote
        raise SplitFileError(f"{path}: not a readable CSV ({err})") from err
    missing = [column for column in CSV_COLUMNS if column not in rows.columns]
    if missing:
        raise SplitFileError(
            f"{path}: no column {missing[0]!r} (a split CSV has {', '.join(CSV_COLUMNS)}): "
            "prepare the data again"
        )
    for row, values in enumerate(rows[list(_VALID)].itertuples(index=False), start=1):
        for (column, (valid, what)), text in zip(_VALID.items(), values, strict=True):
            if not valid(text):
                raise SplitFileError(
                    f"{path}, row {row}, column {column}: {text!r} is not {what}; prepare the "
                    "data again"
                )
    return rows.astype({c: NUMERIC_DTYPES[c] for c in CSV_COLUMNS if c in NUMERIC_DTYPES})


def holdout_names(holdout_groups: Iterable[object] | None) -> list[str]:
    """The held-out group names as text, sorted and without repeats (Hydra gives `[2]` as 2)."""
    if holdout_groups is None:
        return []
    if isinstance(holdout_groups, str | bytes):  # a bare name would hold out each of its letters
        raise ValueError(
            f"split.holdout_groups={holdout_groups!r} must be a list of group names, "
            f"e.g. [{holdout_groups}]"
        )
    return sorted({str(name) for name in holdout_groups})


def check_split_settings(
    valid_fraction: float,
    test_fraction: float,
    folds: int,
    fold: int,
    holdout_groups: Iterable[object] | None = (),
    groups: Iterable[str] | None = None,
    group_regex: str | None = None,
) -> None:
    """Raise ValueError naming the `split.` key and value that is out of range, or the
    `group_regex` that does not compile (and why).

    With `groups` (the groups of the input), also a held-out group that is not one of them, and
    holding out every group (nothing would be left to train on).
    """
    if group_regex:
        try:
            re.compile(group_regex)
        except re.error as err:
            raise ValueError(
                f"split.group_regex={group_regex!r} is not a valid regular expression: {err}"
            ) from err
    for key, value in (("valid_fraction", valid_fraction), ("test_fraction", test_fraction)):
        if not 0 <= value < 1:
            raise ValueError(f"split.{key}={value} is outside [0, 1)")
    if valid_fraction + test_fraction >= 1:
        raise ValueError(
            f"split.valid_fraction={valid_fraction} + split.test_fraction={test_fraction} must be "
            "below 1: nothing would be left to train on"
        )
    if folds < 1:
        raise ValueError(f"split.folds={folds} must be at least 1")
    if folds > 1 and not 0 <= fold < folds:
        raise ValueError(f"split.fold={fold} is outside 0..{folds - 1} (split.folds={folds})")
    held = holdout_names(holdout_groups)
    if groups is None or not held:
        return
    existing = sorted(set(groups))
    unknown = [name for name in held if name not in existing]
    if unknown:
        raise ValueError(
            f"split.holdout_groups names {unknown}, not among the input's groups {existing} "
            "(the folder names under Images/)"
        )
    if held == existing:
        raise ValueError(
            f"split.holdout_groups={held} holds out every group of the input: nothing would be "
            "left to train on or validate with"
        )


def subject_of(stem: str, pattern: re.Pattern[str] | None) -> str:
    """The subject id of one file stem (the stem itself when there is no pattern or no match)."""
    if pattern is None:
        return stem
    match = pattern.search(stem)
    if match is None:
        return stem
    return next((g for g in match.groups() if g), match.group(0))


def _rank(seed: int, unit: Unit) -> bytes:
    """A seeded pseudo-random sort key of one unit, independent of every other name."""
    text = "\0".join((str(seed), *unit)).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(text, digest_size=8).digest()


def _stratified_order(sizes: Counter[Unit], seed: int) -> list[Unit]:
    """Units by their position within their group (ties broken by the seeded rank)."""
    by_group: dict[str, list[Unit]] = defaultdict(list)
    for unit in sizes:
        by_group[unit[0]].append(unit)
    keyed = []
    for units in by_group.values():
        units.sort(key=lambda u: _rank(seed, u))
        total, before = sum(sizes[u] for u in units), 0
        for unit in units:
            keyed.append(((before + sizes[unit] / 2) / total, _rank(seed, unit), unit))
            before += sizes[unit]
    return [unit for *_, unit in sorted(keyed)]


def _take(order: list[Unit], sizes: Counter[Unit], fraction: float, total: int) -> list[Unit]:
    """Units from the front of `order` until their samples reach `fraction` of `total`: at least
    one when the fraction is positive, never the last one (something must stay behind)."""
    target = max(1, round(fraction * total)) if fraction > 0 else 0
    taken, count = [], 0
    for unit in order[:-1]:
        if count >= target:
            break
        taken.append(unit)
        count += sizes[unit]
    return taken


def _fold(order: list[Unit], sizes: Counter[Unit], folds: int, fold: int) -> list[Unit]:
    """Fold `fold` of `folds` contiguous, near-equal runs of the stratified order."""
    total, before, chosen = sum(sizes[u] for u in order), 0, []
    for unit in order:
        if int(folds * (before + sizes[unit] / 2) / total) == fold:
            chosen.append(unit)
        before += sizes[unit]
    return chosen


def assign_splits(
    groups: Sequence[str],
    stems: Sequence[str],
    *,
    valid_fraction: float = 0.2,
    test_fraction: float = 0.0,
    seed: int = 0,
    group_regex: str | None = None,
    folds: int = 1,
    fold: int = 0,
    holdout_groups: Iterable[object] | None = (),
) -> list[str]:
    """The split name ("train", "valid" or "test") of each sample, in input order.

    With `folds > 1`, the samples left after the test split are cut into `folds` subject-disjoint
    folds of near-equal size; fold `fold` is "valid", the rest "train" (`valid_fraction` unused).

    Every sample of a group in `holdout_groups` (names compared as text) is "test". The other
    groups are split exactly as they would be with the held-out groups absent: the fractions and
    folds apply to the remaining samples, and `test_fraction` still takes its share of them into
    "test" too (use 0 for a test split of the held-out groups only). A held-out name that is not
    among `groups`, or holding out every group, is a ValueError.
    """
    check_split_settings(
        valid_fraction, test_fraction, folds, fold, holdout_groups, groups, group_regex
    )
    held = set(holdout_names(holdout_groups))
    pattern = re.compile(group_regex) if group_regex else None
    units = [(g, subject_of(s, pattern)) for g, s in zip(groups, stems, strict=True)]
    kept = [unit for unit in units if unit[0] not in held]
    sizes = Counter(kept)
    order = _stratified_order(sizes, seed)
    test = _take(order, sizes, test_fraction, len(kept))
    rest = order[len(test) :]
    if folds > 1:
        valid = _fold(rest, sizes, folds, fold)
    else:
        valid = _take(rest, sizes, valid_fraction, len(kept))
    split_of = {unit: "test" for unit in test} | {unit: "valid" for unit in valid}
    return ["test" if unit[0] in held else split_of.get(unit, "train") for unit in units]
