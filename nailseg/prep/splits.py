"""Seeded train/valid/test splits, stratified by group, that keep each subject on one side.

A subject is what `group_regex` extracts from a file stem: all photos of one subject land in one
split, so near-identical shots of one hand cannot leak from train into valid. Subjects are taken
in their seeded order within their group, so each split draws from every group in proportion.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nailseg.errors import PrepareError

Unit = tuple[str, str]  # (group, subject): what is kept whole


@dataclass(frozen=True)
class SplitSettings:
    """How prepare splits the pairs: conf/prepare.yaml's `split`."""

    valid_fraction: float
    test_fraction: float
    seed: int
    group_regex: str | None
    folds: int  # > 1: k-fold by subject, `fold` is the validation fold (valid_fraction unused)
    fold: int
    holdout_groups: Sequence[str | int]  # groups whose every photo is "test"


def holdout_names(holdout_groups: Iterable[object]) -> list[str]:
    """The held-out group names as text (the schema's; a caller's `2` is "2"), sorted, unique."""
    return sorted({str(name) for name in holdout_groups})


def check_split_settings(settings: SplitSettings, groups: Iterable[str] | None = None) -> None:
    """PrepareError naming a `split.` key out of range or a `group_regex` that does not compile;
    with `groups` (the input's), a held-out group not among them, or every group held out."""
    group_regex, folds, fold = settings.group_regex, settings.folds, settings.fold
    valid, test = settings.valid_fraction, settings.test_fraction
    try:
        re.compile(group_regex or "")
    except re.error as err:
        raise PrepareError(
            f"split.group_regex={group_regex!r} is not a valid regular expression: {err}"
        ) from err
    for key, value in (("valid_fraction", valid), ("test_fraction", test)):
        if not 0 <= value < 1:
            raise PrepareError(f"split.{key}={value} is outside [0, 1)")
    if valid + test >= 1:
        raise PrepareError(
            f"split.valid_fraction={valid} + split.test_fraction={test} must be below 1: nothing "
            "would be left to train on"
        )
    if folds < 1:
        raise PrepareError(f"split.folds={folds} must be at least 1")
    if folds > 1 and not 0 <= fold < folds:
        raise PrepareError(f"split.fold={fold} is outside 0..{folds - 1} (split.folds={folds})")
    held = holdout_names(settings.holdout_groups)
    if groups is None or not held:
        return
    existing = sorted(set(groups))
    unknown = [name for name in held if name not in existing]
    if unknown:
        raise PrepareError(
            f"split.holdout_groups names {unknown}, not among the input's groups {existing} "
            "(the folder names under Images/)"
        )
    if held == existing:
        raise PrepareError(
            f"split.holdout_groups={held} holds out every group of the input: nothing would be "
            "left to train on or validate with"
        )


def subject_of(stem: str, pattern: re.Pattern[str] | None) -> str:
    """The subject id of one file stem (the stem itself when there is no pattern or no match)."""
    match = pattern.search(stem) if pattern else None
    return stem if match is None else next((g for g in match.groups() if g), match.group(0))


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
    groups: Sequence[str], stems: Sequence[str], settings: SplitSettings
) -> list[str]:
    """The split name ("train", "valid" or "test") of each sample, in input order. With `folds >
    1` the samples left after the test split are cut into `folds` subject-disjoint folds, fold
    `fold` "valid". `test_fraction` takes its share of the groups not held out."""
    check_split_settings(settings, groups)
    held = set(holdout_names(settings.holdout_groups))
    pattern = re.compile(settings.group_regex) if settings.group_regex else None
    units = [(g, subject_of(s, pattern)) for g, s in zip(groups, stems, strict=True)]
    kept = [unit for unit in units if unit[0] not in held]
    sizes = Counter(kept)
    order = _stratified_order(sizes, settings.seed)
    test = _take(order, sizes, settings.test_fraction, len(kept))
    rest = order[len(test) :]
    if settings.folds > 1:
        valid = _fold(rest, sizes, settings.folds, settings.fold)
    else:
        valid = _take(rest, sizes, settings.valid_fraction, len(kept))
    split_of = {unit: "test" for unit in test} | {unit: "valid" for unit in valid}
    return ["test" if unit[0] in held else split_of.get(unit, "train") for unit in units]


def split_usable(groups: Sequence[str], stems: Sequence[str], settings: SplitSettings) -> list[str]:
    """`assign_splits` of the pairs prepare converted: PrepareError also when a held-out group has
    no usable pair left, or the valid or the train split is empty (training needs both)."""
    lost = [g for g in holdout_names(settings.holdout_groups) if g not in set(groups)]
    if lost:
        raise PrepareError(
            f"split.holdout_groups: group(s) {lost} have no usable pair left (every one of their "
            "files was excluded, see the summary): the test split would not hold them"
        )
    try:
        names = assign_splits(groups, stems, settings)
    except PrepareError as err:  # every usable pair in a held-out group
        raise PrepareError(f"{err} (of the {len(groups)} usable pairs)") from err
    subjects = "subject" if settings.group_regex else "photo"
    for split, need in (("valid", "to validate"), ("train", "to train on")):
        if split not in names:
            raise PrepareError(
                f"the {split} split of the {len(groups)} usable pairs is empty, and training "
                f"needs one {need}: prepare more than one {subjects}, or change split.*"
            )
    return names
