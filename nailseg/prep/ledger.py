"""What prepare wrote into a root, so reruns redo only what changed and delete only its own files.

The manifest lists every pair of the last complete run with its sources' modification times and
conversion settings; the journal, appended and fsync'd as a run goes, claims the outputs a run is
about to write and records each pair once both outputs are written, so a killed run resumes and
a claimed output is never taken as current before a later record.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path, PurePosixPath

from nailseg.io.atomic import refuse_non_file
from nailseg.io.ownership import (
    ForeignFolderError,
    Proof,
    below,
    new_marker,
    open_append,
    read_marker,
    recorded,
    replaceable,
    stamped,
    write_marker,
)
from nailseg.prep.format import (
    JOURNAL_FILE,
    MANIFEST_FILE,
    MARKER_FILE,
    MARKER_KIND,
    ROOT_FILES,
    output_paths,
    read_table,
)
from nailseg.prep.layout import OUTPUT_CLASH, OUTPUT_TAKEN, Exclusion, Pair
from nailseg.prep.request import PrepareError

FORMAT_VERSION = 2  # bump when the outputs of one source change: every pair is then reconverted
MAX_VANISHED_SHARE = 0.10  # a rerun missing more of its prepared pairs fails (unless prune=true)
NO_SETTINGS = ""  # a record's settings when its outputs' are unknown: never up to date
_LEGACY_COLUMNS = {"settings": NO_SETTINGS, "listed": 1}  # manifests of format 1 lack them


@dataclass(frozen=True)
class Record:
    """One prepared pair: a CSV row, the names it is sorted and split by, and what it was made from."""

    group: str
    stem: str
    images: str
    masks: str
    height: int
    width: int
    fg_fraction: float
    image_mtime_ns: int  # of the source files: what the outputs were made from
    mask_mtime_ns: int
    settings: str  # the conversion settings the outputs were made under
    listed: bool = True  # in the split CSVs; False: kept on disk for a pair gone from the input

    @property
    def key(self) -> str:
        return f"{self.group}/{self.stem}"

    @property
    def outputs(self) -> tuple[str, str]:
        return self.images, self.masks


RECORD_COLUMNS = [f.name for f in fields(Record)]


def conversion_settings(mask_threshold: int) -> str:
    """What a pair's outputs depend on besides its sources, as recorded with them."""
    return json.dumps({"format": FORMAT_VERSION, "mask_threshold": mask_threshold})


@dataclass
class Owned:
    """What nailseg wrote into the root: the pairs it recorded and every output path it claimed."""

    records: dict[str, Record]
    paths: set[str]
    claims: set[str]  # claimed by a run since the last complete one: whatever it left is its own

    def proof(self, rel: str) -> Proof | None:
        """What shows that the file at output path `rel` is still the one prepare wrote: any plain
        file on a claimed path, else its record's stamp (the source's modification time)."""
        if rel in self.claims:
            return lambda _: True
        stamp = self._stamps.get(rel)
        return None if stamp is None else stamped(stamp)

    @cached_property
    def _stamps(self) -> dict[str, int]:
        stamps = {r.images: r.image_mtime_ns for r in self.records.values()}
        return stamps | {r.masks: r.mask_mtime_ns for r in self.records.values()}


def claim_root(out_root: Path, settings: str) -> tuple[dict, bool]:
    """The root's marker and whether the root is new (its marker then written: the first write).
    Raises PrepareError, before any write, when a file of the root's names is not the one prepare
    recorded writing there: it is not replaced."""
    try:
        marker = read_marker(out_root, MARKER_FILE, MARKER_KIND)
    except ForeignFolderError as err:
        raise PrepareError(f"output_dir: {err}") from err
    if marker is None:
        marker = new_marker(MARKER_KIND, **json.loads(settings))
        write_marker(out_root, MARKER_FILE, marker)
        return marker, True
    files = recorded(marker)
    for name in sorted(ROOT_FILES - {MARKER_FILE, JOURNAL_FILE}):
        refuse_non_file(out_root / name)  # a link: named as one
        if not replaceable(out_root / name, files.get(name)):
            raise PrepareError(
                f"{out_root / name} is not the file prepare wrote there (changed or put there "
                "since), so it is not replaced: nothing was written; move it away, or choose a "
                "new output_dir"
            )
    return marker, False


def _journal_entries(path: Path) -> Iterator[dict]:
    """The journal's complete lines; a line cut short by a kill does not parse and is skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    for line in data.split(b"\n"):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            yield entry


def _read_records(path: Path) -> dict[str, Record]:
    if not path.is_file():
        return {}
    rows = read_table(path, required=[n for n in RECORD_COLUMNS if n not in _LEGACY_COLUMNS])
    records = {}
    for row in rows.to_dict("records"):
        values = {name: row.get(name, _LEGACY_COLUMNS.get(name)) for name in RECORD_COLUMNS}
        record = Record(**values | {"listed": bool(values["listed"])})
        records[record.key] = record
    return records


def load_owned(out_root: Path) -> Owned:
    """The manifest of the last complete run, updated by the journal of any run since.

    A claim voids the settings of the records it names, and only a later record makes the pair
    up to date again: outputs a killed run rewrote are never taken as current, whatever their
    modification times say.
    """
    records = _read_records(out_root / MANIFEST_FILE)
    claims: set[str] = set()
    for entry in _journal_entries(out_root / JOURNAL_FILE):
        if "claim" in entry:
            claimed = set(entry["claim"])
            claims |= claimed
            for key, record in records.items():
                if claimed.intersection(record.outputs):
                    records[key] = replace(record, settings=NO_SETTINGS)
        elif "record" in entry:
            record = Record(**entry["record"])
            records[record.key] = record
    owned = Owned(records, claims | {p for r in records.values() for p in r.outputs}, claims)
    outside = sorted(p for p in owned.paths if not below(p))
    if outside:  # refused before any write: prepare deletes what these files list
        raise PrepareError(
            f"{out_root / MANIFEST_FILE} (or {JOURNAL_FILE}) lists {outside[0]!r}, which is not "
            "below the output folder: prepare never writes such a path, and nothing outside it "
            "is deleted. Nothing was written; restore the file, or choose a new output_dir"
        )
    return owned


class Journal:
    """Append-only lines of JSON, each flushed and fsync'd before the next output is written."""

    def __init__(self, path: Path) -> None:
        self.fd = open_append(path)
        size = os.fstat(self.fd).st_size
        if size and os.pread(self.fd, 1, size - 1) != b"\n":
            os.write(self.fd, b"\n")  # end the line a kill cut short: the next one parses again

    def append(self, entry: dict) -> None:
        os.write(self.fd, (json.dumps(entry) + "\n").encode())
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def refuse_mass_vanishing(
    owned: Owned, pairs: list[Pair], prune: bool, input_dir: Path, out_root: Path
) -> None:
    listed = [key for key, record in owned.records.items() if record.listed]
    present = {pair.key for pair in pairs}
    gone = sum(key not in present for key in listed)
    if prune or gone <= MAX_VANISHED_SHARE * len(listed):
        return
    raise PrepareError(
        f"{gone} of the {len(listed)} pairs prepared in {out_root} are no longer in {input_dir} "
        f"(more than {MAX_VANISHED_SHARE:.0%}): is the input all there (a share not mounted, a "
        "folder renamed)? Nothing was changed. If they were removed on purpose, rerun with "
        "prune=true: they leave the CSVs and their outputs are deleted"
    )


def _up_to_date(pair: Pair, out_root: Path, record: Record | None, settings: str) -> Record | None:
    """The record of a pair whose outputs are current, else None (also when a source or an
    output cannot be stat'ed: converting the pair then says why)."""
    if record is None or record.settings != settings:
        return None
    try:
        sources = (pair.image.stat().st_mtime_ns, pair.mask.stat().st_mtime_ns)
        outputs = tuple((out_root / p).stat().st_mtime_ns for p in record.outputs)
    except OSError:
        return None
    current = sources == outputs == (record.image_mtime_ns, record.mask_mtime_ns)
    return replace(record, listed=True) if current else None


def _blocker(out_root: Path, pair: Pair, owned: Owned) -> Exclusion | None:
    """Why the pair's outputs cannot be written, None when they can: a file nailseg did not write
    on an output's path, or a file (even one kept for a pair gone from the input) where one of
    its folders must be. Such files are never overwritten."""
    for rel in output_paths(pair.key):
        path = out_root / rel
        if not replaceable(path, owned.proof(rel)):  # a user's file, or one put in our place
            return Exclusion(path, OUTPUT_TAKEN, "move it away to prepare this")
        for parent in PurePosixPath(rel).parents:
            folder = out_root / parent
            if folder.is_dir():
                break
            if os.path.lexists(folder):
                detail = (
                    f"a file where {rel} needs a folder: move it away, or prune=true if nailseg "
                    "kept it for a pair gone from the input"
                )
                return Exclusion(folder, OUTPUT_CLASH, detail)
    return None


def triage(
    pairs: list[Pair], out_root: Path, owned: Owned, settings: str
) -> tuple[list[Record], list[Pair], list[Exclusion]]:
    """The records of the pairs whose outputs are current, the pairs to convert, and why the
    others cannot be converted."""
    records, stale, blocked = [], [], []
    for pair in pairs:
        record = _up_to_date(pair, out_root, owned.records.get(pair.key), settings)
        if record is not None:
            records.append(record)
        elif (why := _blocker(out_root, pair, owned)) is not None:
            blocked.append(why)
        else:
            stale.append(pair)
    return records, stale, blocked
