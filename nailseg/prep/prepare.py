"""Turn a folder of photos and masks into training data: `.npy` arrays plus split CSVs.

Outputs under the output root (names in `nailseg.prep.format`): `images/<group>/<stem>.npy` (RGB
uint8 HxWx3), `masks/<group>/<stem>.npy` (uint8 HxWx1 in {0, 1}), `excluded.csv` (every file left
out and why), `manifest.csv` (every pair whose outputs nailseg wrote, with the source modification
times and settings they were made from) and, written last, `train.csv` / `valid.csv` / `test.csv`
(columns `CSV_COLUMNS`, paths relative to the root).

nailseg deletes or overwrites only what it provably created. The root carries a marker
(`prepare.json`); a folder that is neither new, empty nor marked is refused before anything is
written, and so is an output folder that overlaps the input. Files are deleted only when listed
in the manifest or journal as outputs of nailseg (or named like nailseg's temporary files, next to
such outputs); folders are never removed whole, so a user's file inside the root survives.

Safe to interrupt, to rerun and to run twice: every file is written under a temporary name and
renamed; each converted pair is journaled (flushed and fsync'd) as it completes, so a killed run,
even the first, resumes where it stopped; a lock file makes a second prepare on one root fail at
once. A pair is up to date when its outputs and its manifest row carry its sources' modification
times (taken before the sources were decoded, and unchanged after) and its row the current
settings, and no run claimed its outputs without recording them since (`_load_owned`); a rerun
converts only the rest. A rerun that finds no usable pair, or misses more than
`MAX_VANISHED_SHARE` of the pairs it prepared before (an unmounted share?), fails and changes
nothing; outputs of pairs that left the input are kept on disk (and dropped from the CSVs) unless
`prune=true`.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import DictConfig
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from nailseg.collector import frozen_heap
from nailseg.io.atomic import refuse_non_file, write_atomic, write_text
from nailseg.io.lock import locked
from nailseg.io.overlap import overlap
from nailseg.io.ownership import (
    ForeignFolderError,
    Proof,
    below,
    delete_listed,
    new_marker,
    open_append,
    read_marker,
    recorded,
    records_of,
    remove_file,
    remove_temp_files,
    replaceable,
    require_owned,
    stamped,
    truncate,
    write_marker,
)
from nailseg.io.permissions import may_write
from nailseg.lifetime import die_with_parent
from nailseg.prep.format import (
    BUILTIN_LOCK_FILE,
    CSV_COLUMNS,
    EXCLUDED_FILE,
    JOURNAL_FILE,
    LOCK_FILE,
    MANIFEST_FILE,
    MARKER_FILE,
    ROOT_FILES,
    SOURCE_FILE,
    SPLITS,
    read_table,
    split_file,
    write_table,
)
from nailseg.prep.imageio import (
    UnreadableImage,
    binarise,
    check_mask_threshold,
    decode_rgb,
    orientation_mismatch,
    read_mask_values,
)
from nailseg.prep.layout import (
    EMPTY_MASK,
    EXCLUSION_KINDS,
    NAME_TOO_LONG,
    ORIENTATION_MISMATCH,
    OUTPUT_CLASH,
    OUTPUT_TAKEN,
    SIZE_MISMATCH,
    UNREADABLE,
    Exclusion,
    Pair,
    display_path,
    find_pairs,
)
from nailseg.prep.splits import assign_splits, check_split_settings, holdout_names
from nailseg.tables import print_table

FORMAT_VERSION = 2  # bump when the outputs of one source change: every pair is then reconverted
MAX_VANISHED_SHARE = 0.10  # a rerun missing more of its prepared pairs fails (unless prune=true)
_READ_ATTEMPTS = 3  # reads of a pair whose sources keep changing while they are decoded
MARKER_KIND = "prepare"
_OURS_IN_NEW_ROOT = re.compile(
    rf"{re.escape(LOCK_FILE)}|{re.escape(BUILTIN_LOCK_FILE)}|\.{re.escape(MARKER_FILE)}\.\d+\.tmp"
)
_NO_SETTINGS = ""  # a record's settings when its outputs' are unknown: never up to date
_LEGACY_COLUMNS = {"settings": _NO_SETTINGS, "listed": 1}  # manifests of format 1 lack them
# check_request's share of prepare()'s options
_CHECKED = (
    "mask_threshold",
    "valid_fraction",
    "test_fraction",
    "group_regex",
    "folds",
    "fold",
    "holdout_groups",
)

log = logging.getLogger(__name__)


class PrepareError(RuntimeError):
    """A request refused or a run with nothing usable: the message says which and why."""


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


@dataclass(frozen=True)
class Outcome:
    """What converting one pair gave: a record or an exclusion, how non-binary its mask was and
    the bit depth its image was scaled from."""

    record: Record | None = None
    exclusion: Exclusion | None = None
    nonbinary_values: int = 0
    image_bits: int = 8


@dataclass
class Summary:
    """Counts for the final table; `excluded` lists every file left out."""

    written: int = 0
    up_to_date: int = 0
    excluded: list[Exclusion] = field(default_factory=list)
    nonbinary_masks: int = 0
    max_distinct_values: int = 0
    rescaled: Counter[int] = field(default_factory=Counter)  # source bit depth -> images
    kept_gone: int = 0  # pairs gone from the input whose outputs stay on disk
    users_files: list[Path] = field(default_factory=list)  # listed outputs a user changed: kept
    pruned: int = 0  # pairs gone from the input whose outputs were deleted (prune=true)
    split_sizes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, outcome: Outcome) -> None:
        if outcome.nonbinary_values:
            self.nonbinary_masks += 1
            self.max_distinct_values = max(self.max_distinct_values, outcome.nonbinary_values)
        if outcome.image_bits != 8:
            self.rescaled[outcome.image_bits] += 1
        if outcome.record is not None:
            self.written += 1
        else:
            self.excluded.append(outcome.exclusion)


@dataclass
class Owned:
    """What nailseg wrote into the root: the pairs it recorded and every output path it claimed."""

    records: dict[str, Record]
    paths: set[str]
    claims: set[str]  # claimed by a run since the last complete one: whatever it left is its own

    def proof(self, rel: str) -> Proof | None:
        """What shows that the file at output path `rel` is still the one prepare wrote: any plain
        file on a claimed path (a killed run wrote it), else its record's stamp (an output bears
        its source's modification time)."""
        if rel in self.claims:
            return lambda _: True
        stamp = self._stamps.get(rel)
        return None if stamp is None else stamped(stamp)

    @cached_property
    def _stamps(self) -> dict[str, int]:
        stamps = {r.images: r.image_mtime_ns for r in self.records.values()}
        return stamps | {r.masks: r.mask_mtime_ns for r in self.records.values()}


def _output_paths(pair: Pair) -> tuple[str, str]:
    return f"images/{pair.key}.npy", f"masks/{pair.key}.npy"


def save_npy_atomic(path: Path, array: np.ndarray, mtime_ns: int | None = None) -> None:
    write_atomic(
        path, lambda f: np.save(f, np.ascontiguousarray(array), allow_pickle=False), mtime_ns
    )


def _signature(path: Path) -> tuple[int, int, int, int]:
    """What changes when a file is saved: its identity, size and modification time."""
    try:
        stat = path.stat()
    except OSError as err:  # vanished since the scan, or a link to nothing
        raise UnreadableImage(path, f"cannot read it: {err.strerror or err}") from err
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _read_sources(pair: Pair) -> tuple[np.ndarray, int, np.ndarray, tuple[int, int]]:
    """The decoded image, its bit depth, the mask's values, and the sources' modification times
    of that content. Each source is stat'ed before it is decoded and again after; one saved in
    between is read again, so the outputs never carry a newer time than their content's."""
    for _ in range(_READ_ATTEMPTS):
        before = _signature(pair.image), _signature(pair.mask)
        image, bits = decode_rgb(pair.image)
        values = read_mask_values(pair.mask)
        after = _signature(pair.image), _signature(pair.mask)
        if before == after:
            return image, bits, values, (before[0][3], before[1][3])
    changed = pair.image if before[0] != after[0] else pair.mask
    raise UnreadableImage(
        changed, f"it changed while being read, {_READ_ATTEMPTS} times: rerun once it is saved"
    )


def convert_pair(pair: Pair, out_root: Path, threshold: int, settings: str) -> Outcome:
    """Decode, check and write one pair (runs in a worker process)."""
    try:
        image, bits, values, mtimes = _read_sources(pair)
    except UnreadableImage as err:
        return Outcome(exclusion=Exclusion(err.path, UNREADABLE, err.reason))
    turned = orientation_mismatch(pair.image, pair.mask, image.shape, values.shape)
    if turned is not None:
        exclusion = Exclusion(pair.mask, ORIENTATION_MISMATCH, turned)
        return Outcome(exclusion=exclusion, image_bits=bits)
    if image.shape[:2] != values.shape:
        detail = f"image {image.shape[1]}x{image.shape[0]}, mask {values.shape[1]}x{values.shape[0]} (WxH)"
        return Outcome(exclusion=Exclusion(pair.mask, SIZE_MISMATCH, detail), image_bits=bits)
    mask, nonbinary = binarise(values, threshold)
    fg = int(mask.sum())
    if fg == 0:
        detail = f"no pixel above {threshold}" + (
            f" ({nonbinary} distinct values)" if nonbinary else ""
        )
        exclusion = Exclusion(pair.mask, EMPTY_MASK, detail)
        return Outcome(exclusion=exclusion, nonbinary_values=nonbinary, image_bits=bits)
    rel_image, rel_mask = _output_paths(pair)
    try:
        save_npy_atomic(out_root / rel_image, image, mtimes[0])
        save_npy_atomic(out_root / rel_mask, mask[..., None], mtimes[1])
    except OSError as err:  # both outputs end in one name: the first write fails, nothing is left
        if err.errno != errno.ENAMETOOLONG:
            raise
        name = PurePosixPath(rel_image).name
        detail = f"{err.strerror}: {rel_image}, written as .{name}.<pid>.tmp first; shorten it"
        return Outcome(exclusion=Exclusion(pair.image, NAME_TOO_LONG, detail), image_bits=bits)
    record = Record(
        pair.group, pair.stem, rel_image, rel_mask, *mask.shape, fg / mask.size, *mtimes, settings
    )
    return Outcome(record=record, nonbinary_values=nonbinary, image_bits=bits)


def check_request(
    input_dir: Path,
    out_root: Path,
    *,
    mask_threshold: int,
    valid_fraction: float,
    test_fraction: float,
    group_regex: str | None,
    folds: int,
    fold: int,
    holdout_groups: Iterable[str | int],
) -> list[str]:
    """Refuse, before the first write, a request that cannot end well; returns the held-out
    group names. Needs nothing of the input but its path, so `run` checks before it generates
    the input: what depends on the input's files is checked by `prepare`, still before a write."""
    try:
        held = holdout_names(holdout_groups)
        check_split_settings(valid_fraction, test_fraction, folds, fold, group_regex=group_regex)
    except ValueError as err:
        raise PrepareError(str(err)) from err
    if folds == 1 and valid_fraction == 0:
        raise PrepareError(
            "split.valid_fraction=0 leaves no validation split, and training needs one (it "
            "validates every epoch and keeps the best checkpoint by val/dice): set e.g. 0.2"
        )
    try:
        check_mask_threshold(mask_threshold)
    except ValueError as err:
        raise PrepareError(str(err)) from err
    if overlap(input_dir, out_root):
        raise PrepareError(
            f"input_dir={input_dir} and output_dir={out_root} overlap (one is, or is inside, the "
            "other, comparing names without case): choose an output_dir outside the input"
        )
    _check_creatable(out_root)
    try:
        require_owned(out_root, MARKER_FILE, MARKER_KIND, _OURS_IN_NEW_ROOT)
    except ForeignFolderError as err:
        raise PrepareError(f"output_dir: {err}") from err
    return held


def _check_creatable(out_root: Path) -> None:
    """Refuse an output_dir that is, or lies below, a link to nothing or a file: it could not be
    made a folder; or whose nearest existing folder this user may not write in. One stat a path:
    another process (a DDP rank preparing the built-in set) may make the folder meanwhile, and a
    path seen missing, then present, is no file."""
    for path in (out_root, *out_root.parents):
        try:
            if stat.S_ISDIR(os.stat(path).st_mode):
                if not may_write(path):
                    raise PrepareError(
                        f"output_dir={out_root}: {path} is not writable by this user: change its "
                        "permissions, or choose another output_dir"
                    )
                return
        except (FileNotFoundError, NotADirectoryError):  # missing, or below a file
            if os.path.islink(path):
                raise PrepareError(
                    f"output_dir={out_root}: {path} is a symlink to {os.readlink(path)}, which "
                    "does not exist: create that folder, or choose another output_dir"
                ) from None
            continue
        raise PrepareError(f"output_dir={out_root}: {path} is a file, not a folder")


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
    names = [f.name for f in fields(Record)]
    rows = read_table(path, required=[n for n in names if n not in _LEGACY_COLUMNS])
    records = {}
    for row in rows.to_dict("records"):
        values = {name: row.get(name, _LEGACY_COLUMNS.get(name)) for name in names}
        values["listed"] = bool(values["listed"])
        record = Record(**values)
        records[record.key] = record
    return records


def _load_owned(out_root: Path) -> Owned:
    """The manifest of the last complete run, updated by the journal of any run since.

    A run journals its claim on the outputs of the pairs it converts before it writes any of
    them, and a pair's record only once both its outputs are written (each line fsync'd before
    the next step). So outputs written since a pair's last record always follow a claim on them:
    a claim voids the settings of the records it names, and only a later record makes the pair
    up to date again. Outputs a killed run rewrote (under other settings, from newer sources)
    are thus never taken as current, whatever their modification times say.
    """
    records = _read_records(out_root / MANIFEST_FILE)
    claims: set[str] = set()
    for entry in _journal_entries(out_root / JOURNAL_FILE):
        if "claim" in entry:
            claimed = set(entry["claim"])
            claims |= claimed
            for key, record in records.items():
                if claimed.intersection(record.outputs):
                    records[key] = replace(record, settings=_NO_SETTINGS)
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


class _Journal:
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


def _refuse_mass_vanishing(
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


def _claimable(pairs: list[Pair], out_root: Path, owned: Owned, summary: Summary) -> list[Pair]:
    """The pairs whose output paths are free or ours; the rest are excluded, never overwritten."""
    free = []
    for pair in pairs:
        blocked = next(
            filter(None, (_blocker(out_root, p, owned) for p in _output_paths(pair))), None
        )
        if blocked is None:
            free.append(pair)
        else:
            summary.excluded.append(blocked)
    return free


def _blocker(out_root: Path, rel: str, owned: Owned) -> Exclusion | None:
    """Why output `rel` cannot be written: a file nailseg did not write on its path, or a file
    (even one nailseg kept for a pair gone from the input) where one of its folders must be."""
    path = out_root / rel
    if not replaceable(path, owned.proof(rel)):  # a user's file, or one put in prepare's place
        return Exclusion(path, OUTPUT_TAKEN, "move it away to prepare this")
    for parent in PurePosixPath(rel).parents:
        folder = out_root / parent
        if folder.is_dir():
            return None
        if os.path.lexists(folder):
            detail = (
                f"a file where {rel} needs a folder: move it away, or prune=true if nailseg "
                "kept it for a pair gone from the input"
            )
            return Exclusion(folder, OUTPUT_CLASH, detail)
    return None


def _output_clashes(pairs: list[Pair], input_dir: Path) -> tuple[list[Pair], list[Exclusion]]:
    """Pairs whose output would be a folder of another pair's output (`g/x.png` and
    `g/x.npy/y.png`, names compared without case) are both excluded, each naming the other; the
    other pairs are returned."""
    outputs = {_output_paths(pair)[0].casefold(): pair for pair in pairs}
    clashes: dict[str, str] = {}  # pair key -> detail
    for pair in pairs:
        for parent in PurePosixPath(_output_paths(pair)[0]).parents:
            other = outputs.get(parent.as_posix().casefold())
            if other is not None:
                names = " and ".join(
                    p.image.relative_to(input_dir).as_posix() for p in (other, pair)
                )
                detail = f"{names} would write {parent}, as a file and as a folder"
                clashes[pair.key] = clashes[other.key] = detail
    excluded = [
        Exclusion(path, OUTPUT_CLASH, clashes[pair.key])
        for pair in pairs
        if pair.key in clashes
        for path in (pair.image, pair.mask)
    ]
    return [pair for pair in pairs if pair.key not in clashes], excluded


def _convert_all(
    pairs: list[Pair], out_root: Path, threshold: int, settings: str, workers: int
) -> Iterator[Outcome]:
    """Outcomes as they complete, with a progress bar."""
    with Progress(transient=True) as progress:
        task = progress.add_task("preparing", total=len(pairs))
        if workers <= 1:
            for pair in pairs:
                yield convert_pair(pair, out_root, threshold, settings)
                progress.advance(task)
            return
        with ProcessPoolExecutor(max_workers=workers, initializer=die_with_parent) as pool:
            with frozen_heap():  # the pool forks its processes at the first submit
                futures = [
                    pool.submit(convert_pair, p, out_root, threshold, settings) for p in pairs
                ]
            for future in as_completed(futures):
                yield future.result()
                progress.advance(task)


def _convert(
    pairs: list[Pair],
    out_root: Path,
    owned: Owned,
    threshold: int,
    settings: str,
    num_workers: int | None,
    summary: Summary,
) -> list[Record]:
    """Claim the pairs' output paths in the journal, then convert and journal each pair."""
    if not pairs:
        return []
    claim = [p for pair in pairs for p in _output_paths(pair)]
    owned.paths.update(claim)
    owned.claims.update(claim)
    workers = min(num_workers if num_workers is not None else os.cpu_count() or 1, len(pairs))
    records = []
    journal = _Journal(out_root / JOURNAL_FILE)
    try:
        journal.append({"claim": claim})
        for outcome in _convert_all(pairs, out_root, threshold, settings, workers):
            summary.add(outcome)
            if outcome.record is not None:
                journal.append({"record": asdict(outcome.record)})
                records.append(outcome.record)
    finally:
        journal.close()
    return records


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _split(records: list[Record], split_settings: dict) -> list[str]:
    """Each record's split; an empty validation or training split, or a held-out group left with
    no usable pair, is an error."""
    present = {r.group for r in records}
    lost = [g for g in split_settings["holdout_groups"] if g not in present]
    if lost:
        raise PrepareError(
            f"split.holdout_groups: group(s) {lost} have no usable pair left (every one of their "
            "files was excluded, see the summary): the test split would not hold them"
        )
    try:
        names = assign_splits(
            [r.group for r in records], [r.stem for r in records], **split_settings
        )
    except ValueError as err:  # every usable pair in a held-out group
        raise PrepareError(f"{err} (of the {len(records)} usable pairs)") from err
    subjects = "subject" if split_settings["group_regex"] else "photo"
    for split, need in (("valid", "to validate"), ("train", "to train on")):
        if split not in names:
            raise PrepareError(
                f"the {split} split of the {len(records)} usable pairs is empty, and training "
                f"needs one {need}: prepare more than one {subjects}, or change split.*"
            )
    return names


def _finish(
    out_root: Path,
    owned: Owned,
    records: list[Record],
    splits: list[str],
    prune: bool,
    settings: str,
    summary: Summary,
    marker: dict,
    source: str | None,
) -> None:
    """Delete what is no longer ours to keep, then write the manifest, excluded.csv, the CSVs,
    the synthetic `source` it was made of (if any), and last the marker, with their records."""
    usable = {r.key for r in records}
    gone = [r for key, r in owned.records.items() if key not in usable]
    kept = [] if prune else [replace(r, listed=False) for r in gone]
    summary.kept_gone, summary.pruned = len(kept), len(gone) - len(kept)
    manifest = sorted(records + kept, key=lambda r: (r.group, r.stem))
    keep_paths = {p for r in manifest for p in r.outputs}
    gone_paths = sorted(owned.paths - keep_paths)
    summary.users_files += delete_listed(out_root, {rel: owned.proof(rel) for rel in gone_paths})
    remove_temp_files(out_root, owned.paths | ROOT_FILES)
    columns = [f.name for f in fields(Record)]
    table = pd.DataFrame([asdict(r) for r in manifest], columns=columns).astype({"listed": int})
    write_table(out_root / MANIFEST_FILE, table)
    remove_file(out_root / JOURNAL_FILE, lambda _: True)  # the lock holder's own, now recorded

    summary.excluded.sort(key=lambda e: (EXCLUSION_KINDS.index(e.kind), str(e.path)))
    excluded = [(display_path(e.path), e.kind, e.detail) for e in summary.excluded]
    write_table(
        out_root / EXCLUDED_FILE, pd.DataFrame(excluded, columns=["path", "reason", "detail"])
    )
    rows = pd.DataFrame([asdict(r) for r in records], columns=columns)
    rows["split"] = splits
    for split in SPLITS:
        chosen = rows[rows["split"] == split][CSV_COLUMNS]
        summary.split_sizes[split] = len(chosen)
        if split == "test" and chosen.empty:
            remove_file(out_root / split_file(split), lambda _: True)  # checked by _claim_root
        else:
            write_table(out_root / split_file(split), chosen)
    if source is not None:
        write_text(out_root / SOURCE_FILE, source)
    files = records_of(out_root, sorted(ROOT_FILES - {MARKER_FILE, JOURNAL_FILE}))
    write_marker(out_root, MARKER_FILE, marker | json.loads(settings) | {"files": files})


def _claim_root(out_root: Path, settings: str) -> tuple[dict, bool]:
    """The root's marker and whether the root is new (its marker then written: the first write).
    Raises PrepareError, before any write, when a file of the root's names is not the one prepare
    recorded writing there (a user's, or edited since): it is not replaced."""
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


def prepare(
    input_dir: Path,
    output_dir: Path,
    *,
    mask_threshold: int = 127,
    strict: bool = False,
    prune: bool = False,
    num_workers: int | None = None,
    valid_fraction: float = 0.2,
    test_fraction: float = 0.0,
    seed: int = 0,
    group_regex: str | None = None,
    folds: int = 1,
    fold: int = 0,
    holdout_groups: Iterable[str | int] = (),
    source: str | None = None,
) -> Summary:
    """Prepare `input_dir` (Images/, Masks/) into `output_dir`; see the module docstring.

    Every pair of a group named in `holdout_groups` goes to test.csv; the other groups are split
    by the fractions and folds as if those groups were absent (`assign_splits`). The split is
    recomputed from the current settings on every run, so a rerun with other split settings
    re-splits without converting anything again. `source`: the manifest of the synthetic set
    the input is, kept as `SOURCE_FILE`.
    """
    start = time.perf_counter()
    input_dir, out_root = Path(input_dir), Path(output_dir)
    holdout_groups = check_request(
        input_dir,
        out_root,
        mask_threshold=mask_threshold,
        valid_fraction=valid_fraction,
        test_fraction=test_fraction,
        group_regex=group_regex,
        folds=folds,
        fold=fold,
        holdout_groups=holdout_groups,
    )
    _require_input(input_dir)
    try:
        pairs, excluded = find_pairs(input_dir)
    except FileNotFoundError as err:
        raise PrepareError(str(err)) from err
    pairs, clashing = _output_clashes(pairs, input_dir)
    excluded += clashing
    if not pairs:
        raise PrepareError(_nothing_usable(input_dir, pairs, excluded))
    try:  # held-out groups against the input's groups: still before the first write
        check_split_settings(
            valid_fraction, test_fraction, folds, fold, holdout_groups, {p.group for p in pairs}
        )
    except ValueError as err:
        raise PrepareError(str(err)) from err
    settings = json.dumps({"format": FORMAT_VERSION, "mask_threshold": mask_threshold})  # marker

    with locked(out_root, LOCK_FILE, "prepare", "output_dir", PrepareError):
        marker, new_root = _claim_root(out_root, settings)
        owned = _load_owned(out_root)
        _refuse_mass_vanishing(owned, pairs, prune, input_dir, out_root)
        summary = Summary(excluded=excluded)
        records, stale = [], []
        for pair in pairs:
            record = _up_to_date(pair, out_root, owned.records.get(pair.key), settings)
            if record is None:
                stale.append(pair)
            else:
                records.append(record)
        summary.up_to_date = len(records)
        stale = _claimable(stale, out_root, owned, summary)
        journal_size = _size(out_root / JOURNAL_FILE)
        records += _convert(stale, out_root, owned, mask_threshold, settings, num_workers, summary)
        if not records:
            truncate(out_root / JOURNAL_FILE, journal_size)  # nothing was written: no trace
            kept = f"{out_root} holds only its marker and lock file" if new_root else None
            raise PrepareError(_nothing_usable(input_dir, pairs, summary.excluded, kept))
        records.sort(key=lambda r: (r.group, r.stem))
        split_settings = dict(
            valid_fraction=valid_fraction,
            test_fraction=test_fraction,
            seed=seed,
            group_regex=group_regex,
            folds=folds,
            fold=fold,
            holdout_groups=holdout_groups,
        )
        splits = _split(records, split_settings)
        _finish(out_root, owned, records, splits, prune, settings, summary, marker, source)
    summary.seconds = time.perf_counter() - start
    if strict and summary.excluded:
        raise PrepareError(
            f"strict=true and {len(summary.excluded)} file(s) were excluded, first: {summary.excluded[0]}"
        )
    return summary


def _nothing_usable(
    input_dir: Path, pairs: list[Pair], excluded: list[Exclusion], made: str | None = None
) -> str:
    """The error of a run without a usable pair; `made`: what it created, if anything."""
    if not pairs and not excluded:
        return f"no image files found under {input_dir}/Images and {input_dir}/Masks"
    reasons = Counter(e.kind for e in excluded)
    listed = ", ".join(f"{n} {kind}" for kind, n in reasons.most_common())
    outcome = f"Nothing was converted: {made}" if made else "Nothing was changed"
    return f"no usable image/mask pair in {input_dir}: {listed}; first: {excluded[0]}. {outcome}"


def print_summary(summary: Summary, console: Console | None = None, max_listed: int = 50) -> None:
    """The end-of-run table: what was written, what was left out and why."""
    console = console or Console()
    table = Table(title="prepare summary", show_header=False)
    table.add_row("pairs written", str(summary.written))
    table.add_row("pairs up to date (skipped)", str(summary.up_to_date))
    for split, n in summary.split_sizes.items():
        table.add_row(f"{split}.csv rows", str(n))
    reasons = Counter(e.kind for e in summary.excluded)
    for kind in EXCLUSION_KINDS:
        if reasons[kind]:
            table.add_row(f"excluded: {kind}", str(reasons[kind]))
    if summary.nonbinary_masks:
        table.add_row(
            "masks not binary (binarised)",
            f"{summary.nonbinary_masks} (up to {summary.max_distinct_values} distinct values)",
        )
    if summary.rescaled:
        depths = ", ".join(f"{n} from {bits}-bit" for bits, n in sorted(summary.rescaled.items()))
        table.add_row("images rescaled to 8 bits", depths)
    if summary.kept_gone:
        table.add_row(
            "pairs gone from the input, outputs kept (prune=true deletes)", str(summary.kept_gone)
        )
    if summary.pruned:
        table.add_row("pairs gone from the input, outputs deleted (prune)", str(summary.pruned))
    if summary.users_files:
        table.add_row(
            "outputs changed since prepare wrote them (yours: kept)", str(len(summary.users_files))
        )
    table.add_row("seconds", f"{summary.seconds:.2f}")
    print_table(table, console)
    for path in summary.users_files[:max_listed]:
        console.print(
            f"  kept, not prepare's any more: {path}", markup=False, highlight=False, soft_wrap=True
        )
    for exclusion in summary.excluded[:max_listed]:
        console.print(f"  excluded {exclusion}", markup=False, highlight=False)
    if len(summary.excluded) > max_listed:
        console.print(f"  ... {len(summary.excluded) - max_listed} more in {EXCLUDED_FILE}")


def _options(cfg: DictConfig) -> dict[str, Any]:
    """prepare()'s keyword arguments from a composed conf/prepare.yaml."""
    split = cfg.split
    return dict(
        mask_threshold=cfg.mask_threshold,
        strict=cfg.strict,
        prune=cfg.prune,
        num_workers=cfg.num_workers,
        valid_fraction=split.valid_fraction,
        test_fraction=split.test_fraction,
        seed=split.seed,
        group_regex=split.group_regex,
        folds=split.folds,
        fold=split.fold,
        holdout_groups=list(split.holdout_groups),
    )


def check_config(cfg: DictConfig) -> None:
    """Everything `run` can check before its first write, on a composed conf/prepare.yaml:
    `check_request`; that the input exists, or for a synthetic set it will generate, the set's
    size and the held-out groups against the groups the set will have (known before it is
    made)."""
    options = _options(cfg)
    check_request(Path(cfg.input_dir), Path(cfg.output_dir), **{k: options[k] for k in _CHECKED})
    if not _generates(cfg):
        _require_input(Path(cfg.input_dir))
        return
    from nailseg.prep.synthetic import groups_of

    synthetic = cfg.dataset.synthetic
    if synthetic.n < 1:
        raise PrepareError(f"dataset.synthetic.n={synthetic.n}: must be at least 1")
    try:
        check_split_settings(
            **{k: options[k] for k in ("valid_fraction", "test_fraction", "folds", "fold")},
            holdout_groups=options["holdout_groups"],
            groups=groups_of(synthetic.n),
        )
    except ValueError as err:
        raise PrepareError(str(err)) from err


def _require_input(input_dir: Path) -> None:
    if not input_dir.is_dir():
        raise PrepareError(f"input_dir={input_dir} does not exist")


def _generates(cfg: DictConfig) -> bool:
    """Whether `run` makes its input: a synthetic dataset read from its own raw_dir."""
    dataset = cfg.dataset
    return (
        dataset.synthetic is not None
        and bool(dataset.raw_dir)
        and Path(cfg.input_dir) == Path(dataset.raw_dir)
    )


def run(cfg: DictConfig) -> Summary:
    """`prepare.py` body: check the request, make the synthetic photos when the dataset asks for
    them, then prepare; a root prepared from a synthetic set records which (`SOURCE_FILE`)."""
    input_dir, output_dir = Path(cfg.input_dir), Path(cfg.output_dir)
    check_config(cfg)  # before the generator writes the input
    synthetic = cfg.dataset.synthetic if _generates(cfg) else None
    if synthetic is not None:
        from nailseg.prep.synthetic import generate, manifest_text

        try:
            generate(input_dir, synthetic.n, synthetic.seed, num_workers=cfg.num_workers or 0)
        except ForeignFolderError as err:
            raise PrepareError(f"dataset.raw_dir: {err}") from err
    source = None if synthetic is None else manifest_text(synthetic.n, synthetic.seed)
    summary = prepare(input_dir, output_dir, **_options(cfg), source=source)
    print_summary(summary)
    return summary
