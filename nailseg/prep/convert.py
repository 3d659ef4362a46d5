"""Conversion, incremental: the manifest lists the pairs of the last complete run with their
sources' identities and the conversion settings, so a rerun converts only the pairs whose sources
or settings changed, each decoded, checked and written as `.npy` arrays, many in worker processes.
The pair journal, fsync'd as a run goes, voids the pairs a run converts and records each once
written, so a killed run resumes (whether an output is as written is `nailseg.io.folder`'s).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path, PurePosixPath

import numpy as np

from nailseg.collector import frozen_heap
from nailseg.errors import PrepareError
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import Journal, OwnedFolder, below, read_regular
from nailseg.lifetime import die_with_parent
from nailseg.prep.format import JOURNAL_FILE, MANIFEST_FILE, output_paths, read_table
from nailseg.prep.imageio import (
    UnreadableImage,
    binarise,
    decode_rgb,
    orientation_mismatch,
    read_mask_values,
)
from nailseg.prep.layout import (
    EMPTY_MASK,
    NAME_TOO_LONG,
    ORIENTATION_MISMATCH,
    OUTPUT_CLASH,
    OUTPUT_TAKEN,
    SIZE_MISMATCH,
    UNREADABLE,
    Exclusion,
    Pair,
)
from nailseg.progress import progress

FORMAT_VERSION = 3  # bump when the outputs of one source change: every pair is then reconverted
MAX_VANISHED_SHARE = 0.10  # a rerun missing more of its prepared pairs fails (unless prune=true)
IN_FLIGHT_PER_WORKER = 4  # pairs queued per worker: enough to keep each busy, few to hold
_READ_ATTEMPTS = 3  # reads of a pair whose sources keep changing while they are decoded
_worker_folder: OwnedFolder | None = None  # a pool worker's view of the root


def _stat(path: Path) -> tuple[int, int, int, int]:
    """Size, modification time, inode and change time: equal, the content is unchanged (a
    rename, a copy or `touch -d` changes the inode or the change time, which no user can set)."""
    try:
        st = os.stat(path)
    except OSError as err:  # vanished since the scan, or a link to nothing
        raise UnreadableImage(path, f"cannot read it: {err.strerror or err}") from err
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def _identity(stat: tuple[int, ...], path: Path) -> str:
    """A source file's content identity as the manifest records it: its `_stat` and digest."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()
    return " ".join([*map(str, stat), digest])


def _current(recorded: str, path: Path) -> str | None:
    """The recorded identity of `path`, refreshed when only its inode or change time moved and
    its digest is the same; None when its content changed or it cannot be read."""
    try:
        *stat, digest = recorded.split(" ")
        now = _stat(path)
        if now[:2] != tuple(int(v) for v in stat[:2]):
            return None
        if now[2:] == tuple(int(v) for v in stat[2:]):
            return recorded
        return fresh if (fresh := _identity(now, path)).endswith(f" {digest}") else None
    except (ValueError, OSError):
        return None


@dataclass(frozen=True)
class Record:
    """One prepared pair: a CSV row, the names it is sorted and split by, what it was made from."""

    group: str
    stem: str
    images: str
    masks: str
    height: int
    width: int
    fg_fraction: float
    image_source: str  # `_identity` of the image file the outputs were made from
    mask_source: str  # of the mask file, or a COCO entry's `CocoMask.source`
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


def load_records(folder: OwnedFolder) -> dict[str, Record]:
    """The manifest of the last complete run, updated by the pair journal of any run since; a
    manifest that cannot be read counts as none: every pair is converted again."""
    try:
        read_regular(folder.file(MANIFEST_FILE), 0)  # refuses a FIFO before pandas opens it
        rows = read_table(folder.file(MANIFEST_FILE), RECORD_COLUMNS).to_dict("records")
        records = {
            r.key: r for r in (Record(**{k: row[k] for k in RECORD_COLUMNS}) for row in rows)
        }
    except (OSError, ValueError, NotOursError, UnicodeDecodeError):
        records = {}
    try:
        lines = read_regular(folder.file(JOURNAL_FILE)).split(b"\n")
    except (FileNotFoundError, NotOursError):
        lines = []
    for line in lines:
        try:  # a line cut short by a kill does not parse
            entry = json.loads(line)
            for key in records.keys() & set(entry.get("void", [])):
                records[key] = replace(records[key], settings="")
            if "record" in entry:
                record = Record(**entry["record"])
                records[record.key] = record
        except (ValueError, TypeError, AttributeError):
            continue
    outside = sorted(p for r in records.values() for p in r.outputs if not below(p))
    if outside:  # refused before any write
        raise PrepareError(
            f"{folder.path / MANIFEST_FILE} (or {JOURNAL_FILE}) lists {outside[0]!r}, which is "
            "not below the output folder: nothing was written; restore the file, or choose a "
            "new output_dir"
        )
    return records


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
    """The record of a pair whose settings, sources' content and outputs are as recorded."""
    if record is None or record.settings != settings:
        return None
    if not all(folder.owns(rel) for rel in record.outputs):
        return None
    image = _current(record.image_source, pair.image)
    if pair.coco is not None:
        mask = pair.coco.source if record.mask_source == pair.coco.source else None
    else:
        mask = _current(record.mask_source, pair.mask)
    if image is None or mask is None:
        return None
    return replace(record, image_source=image, mask_source=mask)


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
    """The records of the pairs whose outputs are current, the pairs to convert, why not others."""
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


@dataclass(frozen=True)
class Outcome:
    """A pair's record or exclusion, its mask's distinct values if not binary, its image's depth."""

    record: Record | None = None
    exclusion: Exclusion | None = None
    nonbinary_values: int = 0
    image_bits: int = 8


def _save_npy(folder: OwnedFolder, rel: str, array: np.ndarray) -> None:
    folder.write(rel, lambda f: np.save(f, np.ascontiguousarray(array), allow_pickle=False))


def _read_sources(pair: Pair) -> tuple[np.ndarray, int, np.ndarray, list[str]]:
    """The decoded image, its bit depth, the mask's values, and the identities of the content
    read: a file saved while it was read is read again. A COCO mask is the entry as scanned."""
    files = [pair.image] if pair.coco else [pair.image, pair.mask]
    for _ in range(_READ_ATTEMPTS):
        before = [_stat(path) for path in files]
        image, bits = decode_rgb(pair.image)
        values = pair.coco.decode(image.shape) if pair.coco else read_mask_values(pair.mask)
        after = [_stat(path) for path in files]
        changed = [path for path, b, a in zip(files, before, after, strict=True) if b != a]
        if not changed:
            sources = [_identity(stat, path) for stat, path in zip(after, files, strict=True)]
            return image, bits, values, sources + ([pair.coco.source] if pair.coco else [])
    raise UnreadableImage(
        changed[0], f"it changed while being read, {_READ_ATTEMPTS} times: rerun once it is saved"
    )


def convert_pair(pair: Pair, folder: OwnedFolder | None, threshold: int, settings: str) -> Outcome:
    """Decode, check and write one pair (`folder` None: in a pool worker, its own view)."""
    folder = folder or _worker_folder
    try:
        image, bits, values, sources = _read_sources(pair)
    except UnreadableImage as err:
        return Outcome(exclusion=Exclusion(err.path, UNREADABLE, err.reason))
    if pair.coco is None and (
        turned := orientation_mismatch(pair.image, pair.mask, image.shape, values.shape)
    ):
        return Outcome(
            exclusion=Exclusion(pair.mask, ORIENTATION_MISMATCH, turned), image_bits=bits
        )
    if image.shape[:2] != values.shape:
        detail = f"image {image.shape[1]}x{image.shape[0]}, mask {values.shape[1]}x{values.shape[0]} (WxH)"
        return Outcome(exclusion=Exclusion(pair.mask, SIZE_MISMATCH, detail), image_bits=bits)
    mask, nonbinary = binarise(values, threshold)
    fg = int(mask.sum())
    if fg == 0:
        distinct = f" ({nonbinary} distinct values)" if nonbinary else ""
        exclusion = Exclusion(pair.mask, EMPTY_MASK, f"no pixel above {threshold}{distinct}")
        return Outcome(exclusion=exclusion, nonbinary_values=nonbinary, image_bits=bits)
    rel_image, rel_mask = output_paths(pair.key)
    try:
        _save_npy(folder, rel_image, image)
        _save_npy(folder, rel_mask, mask[..., None])
    except OSError as err:  # both outputs end in one name: the first write fails, nothing is left
        if err.errno != errno.ENAMETOOLONG:
            raise
        name = PurePosixPath(rel_image).name
        detail = f"{err.strerror}: {rel_image}, written as .{name}.<pid>.tmp first; shorten it"
        return Outcome(exclusion=Exclusion(pair.image, NAME_TOO_LONG, detail), image_bits=bits)
    record = Record(
        pair.group, pair.stem, rel_image, rel_mask, *mask.shape, fg / mask.size, *sources, settings
    )
    return Outcome(record=record, nonbinary_values=nonbinary, image_bits=bits)


def _init_worker(path: str) -> None:
    global _worker_folder
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to answer
    _worker_folder = OwnedFolder.attach(path)


def _convert_all(
    pairs: list[Pair], folder: OwnedFolder, threshold: int, settings: str, workers: int
) -> Iterator[Outcome]:
    """Outcomes as they complete."""
    if workers <= 1:
        for pair in pairs:
            yield convert_pair(pair, folder, threshold, settings)
        return
    waiting = iter(pairs)

    def submit(count: int) -> set[Future[Outcome]]:
        return {
            pool.submit(convert_pair, p, None, threshold, settings)
            for p in itertools.islice(waiting, count)
        }

    pool = ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(str(folder.path),))
    try:
        # a bounded window of pairs in flight: memory does not grow with the photo count
        with frozen_heap():  # the pool forks its processes at the first submit
            running = submit(IN_FLIGHT_PER_WORKER * workers)
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            yield from (future.result() for future in done)
            running |= submit(len(done))
    finally:
        pool.shutdown(cancel_futures=True)
        folder.journal = Journal(folder.path)  # with what the workers wrote


def convert(
    pairs: list[Pair], folder: OwnedFolder, threshold: int, workers: int | None
) -> list[Outcome]:
    """Void the pairs in the pair journal, then convert each in `workers` processes (None: one
    per core), journaling each pair written."""
    if not pairs:
        return []
    workers = workers if workers is not None else os.cpu_count() or 1
    recorded = conversion_settings(threshold)
    outcomes, fd = [], folder.open_append(JOURNAL_FILE)

    def journal(entry: dict) -> None:  # fsync'd before the next output is written
        os.write(fd, (json.dumps(entry) + "\n").encode())
        os.fsync(fd)

    try:
        if os.fstat(fd).st_size:
            os.write(fd, b"\n")  # ends a line a kill cut short: the next one parses again
        journal({"void": [pair.key for pair in pairs]})
        converted = _convert_all(pairs, folder, threshold, recorded, min(workers, len(pairs)))
        with progress("converting pairs", len(pairs)) as advance:
            for outcome in converted:
                if outcome.record is not None:
                    journal({"record": asdict(outcome.record)})
                outcomes.append(outcome)
                advance(1)
    finally:
        os.close(fd)
    return outcomes
