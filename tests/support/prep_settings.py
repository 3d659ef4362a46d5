"""prepare and assign_splits as the tests call them: conf/prepare.yaml's settings, with the keys
given as keywords changed (split keys by their own names)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from functools import cache
from pathlib import Path

import nailseg.prep.prepare
import nailseg.prep.splits
from nailseg.prep.prepare import PrepareSettings, Summary, compose_prepare
from nailseg.prep.splits import SplitSettings

_SPLIT_KEYS = frozenset(f.name for f in fields(SplitSettings))


@cache
def _defaults() -> PrepareSettings:
    return PrepareSettings.from_config(compose_prepare())


def settings(**changes: object) -> PrepareSettings:
    """conf/prepare.yaml's settings with `changes` made."""
    base = _defaults()
    split = replace(base.split, **{k: v for k, v in changes.items() if k in _SPLIT_KEYS})
    return replace(base, split=split, **{k: v for k, v in changes.items() if k not in _SPLIT_KEYS})


def prepare(
    input_dir: Path | str, output_dir: Path | str, source: dict | None = None, **changes: object
) -> Summary:
    return nailseg.prep.prepare.prepare(input_dir, output_dir, settings(**changes), source)


def assign_splits(groups: Sequence[str], stems: Sequence[str], **changes: object) -> list[str]:
    return nailseg.prep.splits.assign_splits(groups, stems, settings(**changes).split)
