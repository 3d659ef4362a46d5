"""Conversion: decode a pair, check it, write its `.npy` arrays; many pairs in worker processes."""

from __future__ import annotations

import errno
import itertools
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

import numpy as np
from rich.progress import Progress

from nailseg.collector import frozen_heap
from nailseg.io.atomic import write_atomic
from nailseg.lifetime import die_with_parent
from nailseg.prep.format import JOURNAL_FILE, output_paths
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
    SIZE_MISMATCH,
    UNREADABLE,
    Exclusion,
    Pair,
)
from nailseg.prep.ledger import Journal, Owned, Record, conversion_settings
from nailseg.prep.report import Summary
from nailseg.prep.settings import PrepareSettings

IN_FLIGHT_PER_WORKER = 4  # pairs queued per worker: enough to keep each busy, few to hold
_READ_ATTEMPTS = 3  # reads of a pair whose sources keep changing while they are decoded


@dataclass(frozen=True)
class Outcome:
    """What converting one pair gave: a record or an exclusion, how many distinct values its
    mask had when it was not binary, and the bit depth its image was scaled from."""

    record: Record | None = None
    exclusion: Exclusion | None = None
    nonbinary_values: int = 0
    image_bits: int = 8


def _save_npy(path: Path, array: np.ndarray, mtime_ns: int) -> None:
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
    of that content: a source saved while it was decoded is read again, so the outputs never
    carry a newer time than their content's."""
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
    rel_image, rel_mask = output_paths(pair.key)
    try:
        _save_npy(out_root / rel_image, image, mtimes[0])
        _save_npy(out_root / rel_mask, mask[..., None], mtimes[1])
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
        waiting = iter(pairs)

        def submit(count: int) -> set[Future[Outcome]]:
            return {
                pool.submit(convert_pair, p, out_root, threshold, settings)
                for p in itertools.islice(waiting, count)
            }

        with ProcessPoolExecutor(max_workers=workers, initializer=die_with_parent) as pool:
            # a bounded window of pairs in flight: memory does not grow with the photo count
            with frozen_heap():  # the pool forks its processes at the first submit
                running = submit(IN_FLIGHT_PER_WORKER * workers)
            while running:
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    yield future.result()
                    progress.advance(task)
                running |= submit(len(done))


def convert(
    pairs: list[Pair], out_root: Path, owned: Owned, settings: PrepareSettings, summary: Summary
) -> list[Record]:
    """Claim the pairs' output paths in the journal, then convert and journal each pair."""
    if not pairs:
        return []
    claim = [p for pair in pairs for p in output_paths(pair.key)]
    owned.paths.update(claim)
    owned.claims.update(claim)
    workers = settings.num_workers if settings.num_workers is not None else os.cpu_count() or 1
    threshold, recorded = settings.mask_threshold, conversion_settings(settings.mask_threshold)
    records = []
    journal = Journal(out_root / JOURNAL_FILE)
    try:
        journal.append({"claim": claim})
        for outcome in _convert_all(pairs, out_root, threshold, recorded, min(workers, len(pairs))):
            summary.add(outcome)
            if outcome.record is not None:
                journal.append({"record": asdict(outcome.record)})
                records.append(outcome.record)
    finally:
        journal.close()
    return records
