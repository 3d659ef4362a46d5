"""The prepared root's on-disk contract: file names, CSV columns, the one CSV reader and writer, and
the modification-time stamps predict's outputs carry. A prepared root is nailseg's folder of kind
`KIND` (`nailseg.io.folder`); its marker holds `complete` and, for a synthetic set, `synthetic`.

Every CSV is read with `keep_default_na=False` and every column but the numeric ones as text, so a
group or file stem named `NA`, `null`, `None` or `nan` stays that string through a rerun and into
training; names with commas, quotes or newlines are quoted by the writer and round-trip.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from nailseg.io.atomic import write_bytes

CSV_COLUMNS = ["images", "masks", "group", "height", "width", "fg_fraction"]
SPLITS = ("train", "valid", "test")
KIND = "prepare"  # the kind of a prepared root's folder (`nailseg.io.folder`)
MANIFEST_FILE = "manifest.csv"  # every pair of the last complete run, with what it was made from
JOURNAL_FILE = "manifest.journal"  # pairs voided and converted since the last complete run
EXCLUDED_FILE = "excluded.csv"
ROOT_FILES = frozenset({MANIFEST_FILE, JOURNAL_FILE, EXCLUDED_FILE, *(f"{s}.csv" for s in SPLITS)})
NUMERIC_DTYPES = {"height": "int64", "width": "int64", "fg_fraction": "float64"}


def split_file(split: str) -> str:
    return f"{split}.csv"


def output_paths(key: str) -> tuple[str, str]:
    """The image and mask arrays of the pair `<group>/<stem>`, relative to the root."""
    return f"images/{key}.npy", f"masks/{key}.npy"


def read_table(path: Path, required: Sequence[str] = ()) -> pd.DataFrame:
    """A CSV written by `write_table`: text columns as `str`, nothing read as missing."""
    dtypes = defaultdict(lambda: str, NUMERIC_DTYPES)
    rows = pd.read_csv(path, dtype=dtypes, keep_default_na=False)
    missing = set(required) - set(rows.columns)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)} (expected {list(required)})")
    return rows


def table_bytes(rows: pd.DataFrame) -> bytes:
    """The CSV; a name that is not valid Unicode (only ever in a detail) is backslash-escaped."""
    text = rows.to_csv(index=False, float_format="%.6f", lineterminator="\n")
    return text.encode("utf-8", "backslashreplace")


def write_table(path: Path, rows: pd.DataFrame) -> None:
    write_bytes(path, table_bytes(rows))
