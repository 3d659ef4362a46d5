"""Seeded train/valid/test splits, stratified by group, that keep each subject on one side.

A subject is what `group_regex` extracts from a file stem (its first non-empty capture group, or
the whole match): all photos of one subject land in the same split, so near-identical shots of one
hand cannot leak from train into valid. A stem the regex does not match is its own subject.
Splits are computed per group, so every group is represented in proportion; within a group whole
subjects are assigned, so fractions are met as closely as subject sizes allow.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

import numpy as np


def subject_of(stem: str, pattern: re.Pattern[str] | None) -> str:
    """The subject id of one file stem (the stem itself when there is no pattern or no match)."""
    if pattern is None:
        return stem
    match = pattern.search(stem)
    if match is None:
        return stem
    return next((g for g in match.groups() if g), match.group(0))


def _take(subjects: list[str], sizes: dict[str, int], target: int) -> list[str]:
    """Subjects from the front of the list until their samples reach `target` (at least one)."""
    taken: list[str] = []
    count = 0
    for subject in subjects:
        if count >= target and taken:
            break
        taken.append(subject)
        count += sizes[subject]
    return taken


def _balanced_folds(subjects: list[str], sizes: dict[str, int], folds: int) -> list[list[str]]:
    """Greedy balance: biggest subjects first, each into the fold with the fewest samples."""
    buckets: list[list[str]] = [[] for _ in range(folds)]
    load = [0] * folds
    for subject in sorted(subjects, key=lambda s: -sizes[s]):  # stable: ties keep shuffled order
        i = int(np.argmin(load))
        buckets[i].append(subject)
        load[i] += sizes[subject]
    return buckets


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
) -> list[str]:
    """The split name ("train", "valid" or "test") of each sample, in input order.

    With `folds > 1`, the samples left after the test split are cut into `folds` subject-disjoint
    folds of near-equal size; fold `fold` is "valid", the rest "train" (`valid_fraction` unused).
    The result depends only on the inputs, never on their order.
    """
    if not 0 <= valid_fraction < 1 or not 0 <= test_fraction < 1:
        raise ValueError(
            f"fractions must be in [0, 1): valid={valid_fraction}, test={test_fraction}"
        )
    if folds > 1 and not 0 <= fold < folds:
        raise ValueError(f"split.fold={fold} is outside 0..{folds - 1} (split.folds={folds})")
    pattern = re.compile(group_regex) if group_regex else None
    subjects = [subject_of(stem, pattern) for stem in stems]
    split_of_subject: dict[tuple[str, str], str] = {}

    for group in sorted(set(groups)):
        sizes: dict[str, int] = {}
        for g, subject in zip(groups, subjects, strict=True):
            if g == group:
                sizes[subject] = sizes.get(subject, 0) + 1
        rng = np.random.default_rng([seed, zlib.crc32(group.encode())])
        names = sorted(sizes)
        order = [names[i] for i in rng.permutation(len(names))]
        total = sum(sizes.values())

        # the last subject of the shuffled order always stays in train
        test = _take(order[:-1], sizes, round(test_fraction * total)) if test_fraction > 0 else []
        rest = [s for s in order if s not in set(test)]
        if folds > 1:
            valid = _balanced_folds(rest, sizes, folds)[fold]
        elif valid_fraction > 0 and len(rest) > 1:
            valid = _take(rest[:-1], sizes, round(valid_fraction * total))
        else:
            valid = []
        for name, chosen in (("test", test), ("valid", valid)):
            split_of_subject.update({(group, s): name for s in chosen})

    return [split_of_subject.get((g, s), "train") for g, s in zip(groups, subjects, strict=True)]
