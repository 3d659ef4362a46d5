"""Conversion: decode a pair, check it, write its `.npy` arrays; many pairs in worker processes."""

from __future__ import annotations

import errno
import itertools
import os
import signal
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path, PurePosixPath

import numpy as np
from rich.progress import Progress

from nailseg.collector import frozen_heap
from nailseg.io.folder import Journal, OwnedFolder
from nailseg.lifetime import die_with_parent
from nailseg.prep.format import output_paths
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
from nailseg.prep.ledger import PairJournal, Record, Source, conversion_settings, digest
from nailseg.prep.request import PrepareSettings

IN_FLIGHT_PER_WORKER = 4  # pairs queued per worker: enough to keep each busy, few to hold
_READ_ATTEMPTS = 3  # reads of a pair whose sources keep changing while they are decoded
_worker_folder: OwnedFolder | None = None  # a pool worker's view of the root


@dataclass(frozen=True)
class Outcome:
    """What converting one pair gave: a record or an exclusion, how many distinct values its
    mask had when it was not binary, and the bit depth its image was scaled from."""

    record: Record | None = None
    exclusion: Exclusion | None = None
    nonbinary_values: int = 0
    image_bits: int = 8


def _save_npy(folder: OwnedFolder, rel: str, array: np.ndarray) -> None:
    folder.write(rel, lambda f: np.save(f, np.ascontiguousarray(array), allow_pickle=False))


def _source(path: Path, with_digest: bool = False) -> Source:
    """The file's identity (its reading changes none of it, unlike its access time)."""
    try:
        return Source.of(os.stat(path), digest(path) if with_digest else "")
    except OSError as err:  # vanished since the scan, or a link to nothing
        raise UnreadableImage(path, f"cannot read it: {err.strerror or err}") from err


def _read_sources(pair: Pair) -> tuple[np.ndarray, int, np.ndarray, tuple[Source, Source]]:
    """The decoded image, its bit depth, the mask's values, and the sources' identities of that
    content: a source saved while it was read is read again."""
    for _ in range(_READ_ATTEMPTS):
        before = _source(pair.image), _source(pair.mask_file)
        image, bits = decode_rgb(pair.image)
        values = pair.coco.decode(image.shape) if pair.coco else read_mask_values(pair.mask)
        after = _source(pair.image, with_digest=True), _source(pair.mask_file, with_digest=True)
        if [replace(s, digest="") for s in after] == list(before):
            return image, bits, values, after
    changed = pair.image if before[0] != replace(after[0], digest="") else pair.mask
    raise UnreadableImage(
        changed, f"it changed while being read, {_READ_ATTEMPTS} times: rerun once it is saved"
    )


def convert_pair(pair: Pair, folder: OwnedFolder | None, threshold: int, settings: str) -> Outcome:
    """Decode, check and write one pair (`folder` None: in a pool worker, its own view)."""
    folder = folder or _worker_folder
    try:
        image, bits, values, sources = _read_sources(pair)
    except UnreadableImage as err:
        return Outcome(exclusion=Exclusion(err.path, UNREADABLE, err.reason))
    turned = orientation_mismatch(pair.image, pair.mask_file, image.shape, values.shape)
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
        _save_npy(folder, rel_image, image)
        _save_npy(folder, rel_mask, mask[..., None])
    except OSError as err:  # both outputs end in one name: the first write fails, nothing is left
        if err.errno != errno.ENAMETOOLONG:
            raise
        name = PurePosixPath(rel_image).name
        detail = f"{err.strerror}: {rel_image}, written as .{name}.<pid>.tmp first; shorten it"
        return Outcome(exclusion=Exclusion(pair.image, NAME_TOO_LONG, detail), image_bits=bits)
    shape, identities = mask.shape, (str(source) for source in sources)
    record = Record(
        pair.group, pair.stem, rel_image, rel_mask, *shape, fg / mask.size, *identities, settings
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
    """Outcomes as they complete, with a progress bar."""
    with Progress(transient=True) as progress:
        task = progress.add_task("preparing", total=len(pairs))
        if workers <= 1:
            for pair in pairs:
                yield convert_pair(pair, folder, threshold, settings)
                progress.advance(task)
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
                for future in done:
                    yield future.result()
                    progress.advance(task)
                running |= submit(len(done))
        finally:
            pool.shutdown(cancel_futures=True)
            folder.journal = Journal(folder.path)  # with what the workers wrote


def convert(pairs: list[Pair], folder: OwnedFolder, settings: PrepareSettings) -> list[Outcome]:
    """Void the pairs in the pair journal, then convert each, journaling each pair written."""
    if not pairs:
        return []
    workers = settings.num_workers if settings.num_workers is not None else os.cpu_count() or 1
    threshold, recorded = settings.mask_threshold, conversion_settings(settings.mask_threshold)
    outcomes = []
    journal = PairJournal(folder)
    try:
        journal.append({"void": [pair.key for pair in pairs]})
        for outcome in _convert_all(pairs, folder, threshold, recorded, min(workers, len(pairs))):
            if outcome.record is not None:
                journal.append({"record": asdict(outcome.record)})
            outcomes.append(outcome)
    finally:
        journal.close()
    return outcomes
