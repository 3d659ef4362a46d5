"""What prepare made of which sources, so a rerun converts only the pairs whose sources changed.

The manifest lists the pairs of the last complete run with their sources' identities and the
conversion settings; the pair journal, fsync'd as a run goes, voids the pairs a run converts and
records each once written, so a killed run resumes. Whether an output is still the file prepare
wrote is the folder's journal's business (`nailseg.io.folder`), not this ledger's.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path, PurePosixPath

from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OwnedFolder, below, read_regular
from nailseg.prep.format import JOURNAL_FILE, MANIFEST_FILE, output_paths, read_table
from nailseg.prep.layout import OUTPUT_CLASH, OUTPUT_TAKEN, Exclusion, Pair
from nailseg.prep.request import PrepareError

FORMAT_VERSION = 3  # bump when the outputs of one source change: every pair is then reconverted
MAX_VANISHED_SHARE = 0.10  # a rerun missing more of its prepared pairs fails (unless prune=true)


@dataclass(frozen=True)
class Source:
    """What identifies a source file's content. Equal size, modification time, inode and change
    time mean unchanged content (a rename, a copy or `touch -d` changes the inode or the change
    time, which no user can set); when only those two differ, the digest decides."""

    size: int
    mtime_ns: int
    ino: int
    ctime_ns: int
    digest: str

    def __str__(self) -> str:
        return f"{self.size} {self.mtime_ns} {self.ino} {self.ctime_ns} {self.digest}"

    @classmethod
    def parse(cls, text: str) -> Source | None:
        try:
            size, mtime, ino, ctime, digest = text.split(" ")
            return cls(int(size), int(mtime), int(ino), int(ctime), digest)
        except ValueError:
            return None

    @classmethod
    def of(cls, st: os.stat_result, digest: str) -> Source:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns, digest)

    def current(self, path: Path) -> Source | None:
        """This identity as `path` has it now (refreshed when only its inode or change time
        moved), None when its content changed or it cannot be read."""
        try:
            st = os.stat(path)
            if (st.st_size, st.st_mtime_ns) != (self.size, self.mtime_ns):
                return None
            if (st.st_ino, st.st_ctime_ns) == (self.ino, self.ctime_ns):
                return self
            return Source.of(st, self.digest) if digest(path) == self.digest else None
        except OSError:
            return None


def digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


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
    image_source: str  # `Source` of the files the outputs were made from
    mask_source: str
    settings: str  # the conversion settings the outputs were made under

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


def _journal_entries(folder: OwnedFolder) -> list[dict]:
    """The pair journal's complete lines; a line cut short by a kill does not parse."""
    try:
        data = read_regular(folder.file(JOURNAL_FILE))
    except (FileNotFoundError, NotOursError):
        return []
    entries = []
    for line in data.split(b"\n"):
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    return [e for e in entries if isinstance(e, dict)]


def load_records(folder: OwnedFolder) -> dict[str, Record]:
    """The manifest of the last complete run, updated by the pair journal of any run since; a
    manifest that cannot be read (damaged, not a plain file) counts as none: every pair is
    converted again, and the manifest is replaced only while it is prepare's own file."""
    try:
        read_regular(folder.file(MANIFEST_FILE), 0)  # refuses a FIFO before pandas opens it
        rows = read_table(folder.file(MANIFEST_FILE), required=RECORD_COLUMNS).to_dict("records")
        records = {
            r.key: r for r in (Record(**{k: row[k] for k in RECORD_COLUMNS}) for row in rows)
        }
    except (OSError, ValueError, NotOursError, UnicodeDecodeError):
        records = {}
    for entry in _journal_entries(folder):
        if isinstance(entry.get("void"), list):
            for key in entry["void"]:
                if key in records:
                    records[key] = replace(records[key], settings="")
        elif isinstance(entry.get("record"), dict):
            try:
                record = Record(**entry["record"])
            except TypeError:
                continue
            records[record.key] = record
    outside = sorted(p for r in records.values() for p in r.outputs if not below(p))
    if outside:  # refused before any write
        raise PrepareError(
            f"{folder.path / MANIFEST_FILE} (or {JOURNAL_FILE}) lists {outside[0]!r}, which is "
            "not below the output folder: nothing was written; restore the file, or choose a "
            "new output_dir"
        )
    return records


class PairJournal:
    """Append-only lines of JSON, each fsync'd before the next output is written."""

    def __init__(self, folder: OwnedFolder) -> None:
        self.fd = folder.open_append(JOURNAL_FILE)
        if os.fstat(self.fd).st_size:
            os.write(self.fd, b"\n")  # ends a line a kill cut short: the next one parses again

    def append(self, entry: dict) -> None:
        os.write(self.fd, (json.dumps(entry) + "\n").encode())
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def refuse_mass_vanishing(
    records: dict[str, Record], pairs: list[Pair], prune: bool, input_dir: Path, root: Path
) -> None:
    present = {pair.key for pair in pairs}
    gone = sum(key not in present for key in records)
    if prune or gone <= MAX_VANISHED_SHARE * len(records):
        return
    raise PrepareError(
        f"{gone} of the {len(records)} pairs prepared in {root} are no longer in {input_dir} "
        f"(more than {MAX_VANISHED_SHARE:.0%}): is the input all there (a share not mounted, a "
        "folder renamed)? Nothing was changed. If they were removed on purpose, rerun with "
        "prune=true: they leave the CSVs and their outputs are deleted"
    )


def _up_to_date(pair: Pair, folder: OwnedFolder, record: Record | None, settings: str):
    """The record of a pair whose outputs are current, else None: same settings, sources of the
    same content, outputs as prepare wrote them."""
    if record is None or record.settings != settings:
        return None
    image, mask = Source.parse(record.image_source), Source.parse(record.mask_source)
    if image is None or mask is None or not all(folder.owns(rel) for rel in record.outputs):
        return None
    image, mask = image.current(pair.image), mask.current(pair.mask_file)
    if image is None or mask is None:
        return None
    return replace(record, image_source=str(image), mask_source=str(mask))


def _blocker(folder: OwnedFolder, pair: Pair) -> Exclusion | None:
    """Why the pair's outputs cannot be written, None when they can: a file nailseg did not write
    on an output's path, or a file where one of its folders must be. Such files stay."""
    for rel in output_paths(pair.key):
        try:
            if not folder.may_write(rel):
                return Exclusion(folder.path / rel, OUTPUT_TAKEN, "move it away to prepare this")
        except NotOursError as err:  # a link on the way
            return Exclusion(folder.path / rel, OUTPUT_TAKEN, str(err))
        for parent in PurePosixPath(rel).parents:
            path = folder.path / parent
            if path.is_dir():
                break
            if os.path.lexists(path):
                detail = (
                    f"a file where {rel} needs a folder: move it away, or prune=true if nailseg "
                    "kept it for a pair gone from the input"
                )
                return Exclusion(path, OUTPUT_CLASH, detail)
    return None


def triage(
    pairs: list[Pair], folder: OwnedFolder, records: dict[str, Record], settings: str
) -> tuple[list[Record], list[Pair], list[Exclusion]]:
    """The records of the pairs whose outputs are current, the pairs to convert, and why the
    others cannot be converted."""
    current, stale, blocked = [], [], []
    for pair in pairs:
        record = _up_to_date(pair, folder, records.get(pair.key), settings)
        if record is not None:
            current.append(record)
        elif (why := _blocker(folder, pair)) is not None:
            blocked.append(why)
        else:
            stale.append(pair)
    return current, stale, blocked
