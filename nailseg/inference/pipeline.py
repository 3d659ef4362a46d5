"""Photos through the net in batches: read ahead by the worker processes, run on the device, and
written by the workers while the next batch runs. Memory stays flat for any number of photos: a
bounded number of them are in flight at once."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rich.console import Console

from nailseg.inference.decode import to_device
from nailseg.inference.host_copy import HostCopy, to_host
from nailseg.inference.photos import Photo, Skipped, TrueMask
from nailseg.inference.progress import STAGES, Stopwatch, progress_bar
from nailseg.inference.scoring import ImageScore
from nailseg.inference.spec import InferenceSpec, Net
from nailseg.inference.views import Views, photo_probabilities
from nailseg.inference.workers import Loaded, NotWritten, PhotoWriter, Prediction, read_photos
from nailseg.prep.imageio import UnreadableImage


@dataclass(frozen=True)
class BatchSettings:
    """How the photos are run: from the request."""

    threshold: float
    views: Views  # flips, scales, tiles
    device: torch.device
    batch_size: int
    num_workers: int
    gpu_jpeg: bool  # JPEGs decoded on the GPU (nvJPEG), not by the workers
    overlays: bool


@dataclass(frozen=True)
class Outcome:
    """What became of the photos."""

    written: int
    skipped: list[Skipped]  # unreadable, or their output name refused by the filesystem
    scores: list[ImageScore]
    unscored: list[Skipped]  # written, with no usable true mask
    stages: dict[str, float]  # seconds per `STAGES` name


@dataclass(frozen=True)
class _OnDevice:
    """A photo whose probability map is queued on the device; `shown` is the overlay's photo (None:
    no overlay; a tensor: decoded on the GPU, to be copied back)."""

    photo: Photo
    shown: np.ndarray | torch.Tensor | None
    prob: torch.Tensor


@dataclass(frozen=True)
class _Fetched:
    """A batch whose copies to the host are queued: its masks, and its GPU-decoded photos."""

    batch: list[_OnDevice]
    masks: HostCopy
    decoded: HostCopy | None


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    """`items` in consecutive slices of `size` (the last may be shorter): the workers' tasks."""
    return (items[start : start + size] for start in range(0, len(items), size))


def read_ahead(
    photos: Sequence[Photo], pool: Executor, depth: int, chunk: int, gpu_jpeg: bool
) -> Iterator[tuple[Photo, Loaded | UnreadableImage]]:
    """Loaded photos in order, read by the workers `chunk` at a time with at most `depth` photos
    in flight (`pool.map` would hold every decoded photo of a folder in memory)."""
    parts = chunks(photos, chunk)
    queue: deque[tuple[Sequence[Photo], Future]] = deque()
    for part in parts:
        queue.append((part, pool.submit(read_photos, part, gpu_jpeg)))
        if len(queue) * chunk >= depth:
            break
    while queue:
        part, future = queue.popleft()
        following = next(parts, None)
        if following is not None:
            queue.append((following, pool.submit(read_photos, following, gpu_jpeg)))
        yield from zip(part, future.result(), strict=True)


@contextmanager
def fast_gil_handoff(device: torch.device) -> Iterator[None]:
    """On a GPU, Python's GIL switch interval at 0.5 ms (its default: 5 ms) inside, then back. The
    main thread queues the device's work while the pool's and the progress bar's threads run
    Python too; a thread waiting for the GIL takes it only after the interval."""
    if device.type != "cuda":
        yield
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class _Pipeline:
    """One run's photos, batch by batch (`predict_photos`)."""

    def __init__(
        self,
        net: Net,
        spec: InferenceSpec,
        settings: BatchSettings,
        writer: PhotoWriter,
        truths: Mapping[str, TrueMask | str] | None,
        pool: Executor,
        advance: Callable[[int], None],
    ) -> None:
        self.net, self.spec, self.settings = net, spec, settings
        self.writer, self.truths, self.pool, self.advance = writer, truths, pool, advance
        self.depth = max(2 * settings.batch_size, settings.num_workers)  # photos in flight
        self.chunk = -(-settings.batch_size // settings.num_workers)  # a batch over every worker
        self.clock = Stopwatch(*STAGES)
        self.unreadable: list[Skipped] = []
        self.results: list[ImageScore | Skipped | None] = []
        self.writes: deque[tuple[int, Future]] = deque()  # (photos, their writing)
        self.pending: list[tuple[Photo, Loaded]] = []  # read, not yet on the device
        self.launched: list[_OnDevice] = []

    def run(self, photos: Sequence[Photo]) -> Outcome:
        reads = read_ahead(photos, self.pool, self.depth, self.chunk, self.settings.gpu_jpeg)
        while True:
            with self.clock("read_wait"):
                photo, item = next(reads, (None, None))
            if photo is None:
                break
            if isinstance(item, UnreadableImage):
                self._unreadable(photo, item)
                continue
            self.pending.append((photo, item))
            if len(self.pending) == self.settings.batch_size:
                self._step(next_batch=True)
        self._step(next_batch=bool(self.pending))
        self._step(next_batch=False)
        with self.clock("write_wait"):
            self.results += [result for _, future in self.writes for result in future.result()]
        return self._outcome()

    def _unreadable(self, photo: Photo, err: UnreadableImage) -> None:
        self.unreadable.append(Skipped(photo.path, f"unreadable: {err.reason}"))
        self.advance(1)

    def _step(self, next_batch: bool) -> None:
        """The last launched batch's copies are queued before the next batch's work, so waiting
        for them does not wait for that work: the device runs it while the host writes the last
        batch and reads the next."""
        with self.clock("device_queue"):
            fetched = self._fetch(self.launched)
            self.launched = self._launch() if next_batch else []
        if fetched is not None:
            self._finish(fetched)

    def _launch(self) -> list[_OnDevice]:
        """Queue the pending photos' work on the device: decode, resize (or tile), net,
        full-size maps."""
        photos = [photo for photo, _ in self.pending]
        loaded = [item for _, item in self.pending]
        self.pending = []
        images, kept = [], []
        for photo, item, image in zip(
            photos, loaded, to_device(photos, loaded, self.settings.device), strict=True
        ):
            if isinstance(image, UnreadableImage):
                self._unreadable(photo, image)
                continue
            images.append(image)
            # the overlay's photo: as read on the CPU, or the GPU-decoded one (copied back)
            kept.append((photo, item if isinstance(item, np.ndarray) else image))
        if not images:
            return []
        probs = photo_probabilities(
            self.net, images, self.spec, self.settings.views, self.settings.batch_size
        )
        return [
            _OnDevice(photo, shown if self.settings.overlays else None, prob)
            for (photo, shown), prob in zip(kept, probs, strict=True)
        ]

    def _fetch(self, batch: list[_OnDevice]) -> _Fetched | None:
        """Queue the copies of a launched batch's masks to the host (thresholded in one call) and
        of the GPU-decoded photos its overlays need."""
        if not batch:
            return None
        threshold = self.settings.threshold
        masks = to_host([item.prob for item in batch], lambda flat: flat > threshold)
        decoded = [item.shown for item in batch if isinstance(item.shown, torch.Tensor)]
        return _Fetched(batch, masks, to_host(decoded) if decoded else None)

    def _finish(self, fetched: _Fetched) -> None:
        """Wait for a fetched batch's copies (only them) and hand its masks to the writers."""
        with self.clock("device_wait"):
            preds = fetched.masks.arrays()
            hosted = iter(fetched.decoded.arrays() if fetched.decoded else [])
            shown = [  # C×H×W back to H×W×C (a view)
                next(hosted).transpose(1, 2, 0)
                if isinstance(item.shown, torch.Tensor)
                else item.shown
                for item in fetched.batch
            ]
        predictions: list[Prediction] = [
            (item.photo, image, pred, None if self.truths is None else self.truths[item.photo.key])
            for item, image, pred in zip(fetched.batch, shown, preds, strict=True)
        ]
        for part in chunks(predictions, self.chunk):
            future = self.pool.submit(self.writer, part)
            future.add_done_callback(self._moves_bar(len(part)))
            self.writes.append((len(part), future))
        with self.clock("write_wait"):
            while sum(n for n, _ in self.writes) > self.depth:
                self.results.extend(self.writes.popleft()[1].result())

    def _moves_bar(self, photos: int) -> Callable[[Future], None]:
        """A written chunk's callback: the progress bar moves on by its photos."""
        return lambda _: self.advance(photos)

    def _outcome(self) -> Outcome:
        unwritten = [r for r in self.results if isinstance(r, NotWritten)]
        return Outcome(
            written=len(self.results) - len(unwritten),
            skipped=self.unreadable + unwritten,
            scores=[r for r in self.results if isinstance(r, ImageScore)],
            unscored=[
                r for r in self.results if isinstance(r, Skipped) and not isinstance(r, NotWritten)
            ],
            stages=self.clock.seconds,
        )


def predict_photos(
    net: Net,
    spec: InferenceSpec,
    photos: Sequence[Photo],
    settings: BatchSettings,
    writer: PhotoWriter,
    truths: Mapping[str, TrueMask | str] | None,
    pool: Executor,
    console: Console,
) -> Outcome:
    """Predict every photo, read and written by `pool`'s worker processes; `truths`: every
    photo's true mask or why it has none (None: not scoring)."""
    with progress_bar(console, len(photos)) as advance, fast_gil_handoff(settings.device):
        return _Pipeline(net, spec, settings, writer, truths, pool, advance).run(photos)
