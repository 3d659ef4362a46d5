"""The prepared root's on-disk contract: file names, CSV columns, the one CSV reader and writer.

Every column but the numeric ones is read as text, nothing as missing: a group or stem named `NA`
or `null` stays that string through a rerun and into training.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from nailseg.errors import UserError
from nailseg.io.atomic import write_bytes

CSV_COLUMNS = ["images", "masks", "group", "height", "width", "fg_fraction"]
SPLITS = ("train", "valid", "test")
KIND = "prepare"  # the kind of a prepared root's folder (`nailseg.io.folder`)
MANIFEST_FILE = "manifest.csv"  # every pair of the last complete run, with what it was made from
JOURNAL_FILE = "manifest.journal"  # pairs voided and converted since the last complete run
EXCLUDED_FILE = "excluded.csv"
ROOT_FILES = frozenset({MANIFEST_FILE, JOURNAL_FILE, EXCLUDED_FILE, *(f"{s}.csv" for s in SPLITS)})
NUMERIC_DTYPES = {"height": "int64", "width": "int64", "fg_fraction": "float64"}


class SplitFileError(UserError, ValueError):
    """A CSV that cannot be trained on; the message names the file, row and column."""


def _fraction(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and 0.0 <= value <= 1.0


# what each of CSV_COLUMNS must hold, as text, and how to say it
_SIZE = re.compile("0*[1-9][0-9]*").fullmatch  # a positive integer
_VALID: dict[str, tuple[Callable[[str], object], str]] = {
    "images": (bool, "a path"),
    "masks": (bool, "a path"),
    "group": (bool, "a group name"),
    "height": (_SIZE, "a size"),
    "width": (_SIZE, "a size"),
    "fg_fraction": (_fraction, "a fraction in [0, 1]"),
}


def split_file(split: str) -> str:
    return f"{split}.csv"


def output_paths(key: str) -> tuple[str, str]:
    """The image and mask arrays of the pair `<group>/<stem>`, relative to the root."""
    return f"images/{key}.npy", f"masks/{key}.npy"


def read_table(path: Path, required: Sequence[str] = ()) -> pd.DataFrame:
    """A CSV written by `write_table`, each value of `CSV_COLUMNS` checked before it is typed: a
    missing `required` column or a value that is not what its column holds is a SplitFileError
    naming the file, the row (1: the first below the header) and the column."""
    try:
        rows = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (ValueError, pd.errors.ParserError) as err:  # an empty file, a broken quote
        raise SplitFileError(f"{path}: not a readable CSV ({err})") from err
    missing = [column for column in required if column not in rows.columns]
    if missing:
        raise SplitFileError(
            f"{path}: no column {missing[0]!r} (expected {', '.join(required)}): prepare the "
            "data again"
        )
    checked = [column for column in _VALID if column in rows.columns]
    for row, values in enumerate(rows[checked].itertuples(index=False), start=1):
        for column, text in zip(checked, values, strict=True):
            valid, what = _VALID[column]
            if not valid(text):
                raise SplitFileError(
                    f"{path}, row {row}, column {column}: {text!r} is not {what}; prepare the "
                    "data again"
                )
    return rows.astype({c: t for c, t in NUMERIC_DTYPES.items() if c in rows.columns})


def table_bytes(rows: pd.DataFrame) -> bytes:
    """The CSV; a name that is not valid Unicode (only in a detail) is backslash-escaped."""
    text = rows.to_csv(index=False, float_format="%.6f", lineterminator="\n")
    return text.encode("utf-8", "backslashreplace")


def write_table(path: Path, rows: pd.DataFrame) -> None:
    write_bytes(path, table_bytes(rows))
