"""Photos through the net in batches: read ahead by the worker processes, decoded onto the device
(JPEGs by nvJPEG on a GPU, their EXIF orientation applied there; a file it refuses by prepare's
decoder), run, and written by the workers while the next batch runs; a bounded number in flight.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text
from torchvision.io import ImageReadMode, decode_jpeg

from nailseg.inference.request import Photo, Request, Skipped
from nailseg.inference.segmenter import Segmenter
from nailseg.inference.views import image_tensors
from nailseg.inference.workers import (
    EncodedJpeg,
    ImageScore,
    Loaded,
    NotWritten,
    PhotoWriter,
    Prediction,
    read_photos,
)
from nailseg.prep.imageio import UnreadableImage, read_rgb

# where the main thread waits: for photos to be read, queueing the device's work (decode, resize,
# net, full-size maps, thresholds, copies to the host), for the masks to come back from the
# device, for the writing processes (`PredictSummary.stages`; bench_predict's columns)
STAGES = ("read_wait", "device_queue", "device_wait", "write_wait")


@dataclass(frozen=True)
class Outcome:
    """What became of the photos."""

    written: int
    skipped: list[Skipped]  # unreadable, or their output name refused by the filesystem
    scores: list[ImageScore]
    unscored: list[Skipped]  # written, with no usable true mask
    stages: dict[str, float]  # seconds per `STAGES` name
    rerun: dict[str, int]  # auto_scale: key -> the long side a photo ran at again


@dataclass(frozen=True)
class _OnDevice:
    """A photo's map queued on the device; `shown`: its overlay's photo (a tensor: to copy back)."""

    photo: Photo
    shown: np.ndarray | torch.Tensor | None
    prob: torch.Tensor


@dataclass(frozen=True)
class _Fetched:
    """A batch whose copies to the host are queued: its masks, and its GPU-decoded photos."""

    batch: list[_OnDevice]
    masks: Callable[[], list[np.ndarray]]  # `to_host`'s
    decoded: Callable[[], list[np.ndarray]] | None


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    """`items` in slices of `size` (the last may be shorter): the workers' tasks."""
    return (items[start : start + size] for start in range(0, len(items), size))


def read_ahead(
    photos: Sequence[Photo], pool: Executor, depth: int, chunk: int, gpu_jpeg: bool
) -> Iterator[tuple[Photo, Loaded | UnreadableImage]]:
    """Loaded photos in order, `chunk` a task, at most `depth` in flight (not `pool.map`: all)."""
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
    """On a GPU, Python's GIL switch interval at 0.5 ms (not 5) inside: the thread queueing the
    device's work gets the GIL back sooner from the threads that run Python."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0005 if device.type == "cuda" else before)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


class _Pipeline:
    """One run's photos, batch by batch (`predict_photos`)."""

    def __init__(
        self,
        model: Segmenter,
        request: Request,
        writer: PhotoWriter,
        pool: Executor,
        advance: Callable[[int], None],
    ) -> None:
        self.model, self.request, self.threshold = model, request, model.threshold
        self.writer, self.pool, self.advance = writer, pool, advance
        batch_size = model.batch_size
        self.depth = max(2 * batch_size, request.num_workers)  # photos in flight
        self.chunk = -(-batch_size // request.num_workers)  # a batch over every worker
        self.stages = dict.fromkeys(STAGES, 0.0)
        self.unreadable: list[Skipped] = []
        self.results: list[ImageScore | Skipped | None] = []
        self.writes: deque[tuple[int, Future]] = deque()  # (photos, their writing)
        self.pending: list[tuple[Photo, Loaded]] = []  # read, not yet on the device
        self.launched: list[_OnDevice] = []
        self.rerun: dict[str, int] = {}

    def run(self) -> Outcome:
        reads = read_ahead(
            self.request.photos, self.pool, self.depth, self.chunk, self.request.gpu_jpeg
        )
        while True:
            with self._timed("read_wait"):
                photo, item = next(reads, (None, None))
            if photo is None:
                break
            if isinstance(item, UnreadableImage):
                self._unreadable(photo, item)
                continue
            self.pending.append((photo, item))
            if len(self.pending) == self.model.batch_size:
                self._step(next_batch=True)
        self._step(next_batch=bool(self.pending))
        self._step(next_batch=False)
        with self._timed("write_wait"):
            self.results += [result for _, future in self.writes for result in future.result()]
        return self._outcome()

    def _unreadable(self, photo: Photo, err: UnreadableImage) -> None:
        self.unreadable.append(Skipped(photo.path, f"unreadable: {err.reason}"))
        self.advance(1)

    def _step(self, next_batch: bool) -> None:
        """The last batch's copies are queued before the next batch's work, so waiting for them
        does not wait for it: the device runs it while the host writes and reads."""
        with self._timed("device_queue"):
            fetched = self._fetch(self.launched)
            self.launched = self._launch() if next_batch else []
        if fetched is not None:
            self._finish(fetched)

    def _launch(self) -> list[_OnDevice]:
        """Queue the pending photos' work on the device: decode, views, net, full-size maps."""
        photos, loaded = zip(*self.pending, strict=True)
        self.pending = []
        images, kept = [], []
        for photo, item, image in zip(
            photos, loaded, to_device(photos, loaded, self.model.device), strict=True
        ):
            if isinstance(image, UnreadableImage):
                self._unreadable(photo, image)
                continue
            images.append(image)
            # the overlay's photo: as read on the CPU, or the GPU-decoded one (copied back)
            kept.append((photo, item if isinstance(item, np.ndarray) else image))
        if not images:
            return []
        probs, sides = self.model.scaled_maps(images)
        self.rerun |= {p.key: side for (p, _), side in zip(kept, sides, strict=True) if side}
        return [
            _OnDevice(photo, shown if self.request.overlays else None, prob)
            for (photo, shown), prob in zip(kept, probs, strict=True)
        ]

    def _fetch(self, batch: list[_OnDevice]) -> _Fetched | None:
        """Queue the copies of a batch's masks (thresholded) and GPU-decoded photos to the host."""
        if not batch:
            return None
        masks = to_host([item.prob for item in batch], lambda flat: flat > self.threshold)
        decoded = [item.shown for item in batch if isinstance(item.shown, torch.Tensor)]
        return _Fetched(batch, masks, to_host(decoded) if decoded else None)

    def _finish(self, fetched: _Fetched) -> None:
        """Wait for a fetched batch's copies (only them) and hand its masks to the writers."""
        with self._timed("device_wait"):
            preds = fetched.masks()
            hosted = iter(fetched.decoded() if fetched.decoded else [])
            shown = [  # C×H×W back to H×W×C (a view)
                next(hosted).transpose(1, 2, 0)
                if isinstance(item.shown, torch.Tensor)
                else item.shown
                for item in fetched.batch
            ]
        truths = self.request.truths
        predictions: list[Prediction] = [
            (item.photo, image, pred, None if truths is None else truths[item.photo.key])
            for item, image, pred in zip(fetched.batch, shown, preds, strict=True)
        ]
        for part in chunks(predictions, self.chunk):
            future, count = self.pool.submit(self.writer, part), len(part)
            future.add_done_callback(lambda _, n=count: self.advance(n))
            self.writes.append((count, future))
        with self._timed("write_wait"):
            while sum(n for n, _ in self.writes) > self.depth:
                self.results.extend(self.writes.popleft()[1].result())

    @contextmanager
    def _timed(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stages[stage] += time.perf_counter() - start

    def _outcome(self) -> Outcome:
        unwritten = [r for r in self.results if isinstance(r, NotWritten)]
        scores = [r for r in self.results if isinstance(r, ImageScore)]
        unscored = [r for r in self.results if type(r) is Skipped]  # written, not scored
        written = len(self.results) - len(unwritten)
        return Outcome(
            written, self.unreadable + unwritten, scores, unscored, self.stages, self.rerun
        )


def predict_photos(
    model: Segmenter, request: Request, writer: PhotoWriter, pool: Executor, console: Console
) -> Outcome:
    """Predict every photo of `request` with `model`, read and written by `pool`'s workers, under
    a bar of photos."""
    columns = (TextColumn("predicting"), BarColumn(), MofNCompleteColumn(), _RateColumn())
    columns += (TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar, fast_gil_handoff(model.device):
        advance = partial(bar.advance, bar.add_task("predicting", total=len(request.photos)))
        return _Pipeline(model, request, writer, pool, advance).run()


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """A C×H×W image turned upright by its EXIF orientation, as `imageio` turns a decoded one."""
    h, w = 1, 2
    turns = {
        2: lambda x: x.flip(w),
        3: lambda x: x.flip(h, w),
        4: lambda x: x.flip(h),
        5: lambda x: x.transpose(h, w),
        6: lambda x: x.rot90(-1, (h, w)),
        7: lambda x: x.transpose(h, w).flip(h, w),
        8: lambda x: x.rot90(1, (h, w)),
    }
    turn = turns.get(orientation)
    return turn(image).contiguous() if turn else image


def to_device(
    photos: Sequence[Photo], loaded: Sequence[Loaded], device: torch.device
) -> list[torch.Tensor | UnreadableImage]:
    """Each photo as an RGB uint8 C×H×W tensor on `device` (JPEGs: decoded there), or why not."""
    out: list[torch.Tensor | UnreadableImage | None] = [None] * len(loaded)
    decoded_here = [i for i, item in enumerate(loaded) if isinstance(item, np.ndarray)]
    uploaded = image_tensors([loaded[i] for i in decoded_here], device)
    for i, image in zip(decoded_here, uploaded, strict=True):
        out[i] = image
    jpegs = [i for i, item in enumerate(loaded) if isinstance(item, EncodedJpeg)]
    if not jpegs:
        return out
    data = [torch.from_numpy(loaded[i].data) for i in jpegs]
    # one bad file fails the batch: then they are decoded one by one
    decoded = _nvjpeg(data, device) or [_nvjpeg(item, device) for item in data]
    for i, image in zip(jpegs, decoded, strict=True):
        if image is None:  # nvJPEG refused it: the CPU decoder decodes it or says why not
            try:
                out[i] = image_tensors([read_rgb(photos[i].path)], device)[0]
            except UnreadableImage as err:
                out[i] = err
        else:
            out[i] = orient(image, loaded[i].orientation)
    return out


def _nvjpeg(data, device: torch.device):
    """`decode_jpeg` on `device` (a list: in one batch), None when it refuses. torchvision's
    decoders warn at every call that they are deprecated; they run nvJPEG here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            return None


def to_host(
    parts: list[torch.Tensor], on_device: Callable[[torch.Tensor], torch.Tensor] = lambda flat: flat
) -> Callable[[], list[np.ndarray]]:
    """Tensors (one device, one dtype) queued for the host in one copy (on a GPU asynchronous, to
    pinned memory), `on_device` applied to all first; returns what waits for it and gives arrays."""
    flat, shapes, done = (
        on_device(torch.cat([p.flatten() for p in parts])),
        [p.shape for p in parts],
        None,
    )
    if flat.is_cuda:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(flat.device))
        flat = host

    def arrays() -> list[np.ndarray]:
        if done is not None:
            done.synchronize()
        parts = np.split(flat.numpy(), np.cumsum([shape.numel() for shape in shapes])[:-1])
        return [part.reshape(shape) for part, shape in zip(parts, shapes, strict=True)]

    return arrays


class _RateColumn(ProgressColumn):
    """Photos a second since the bar started (Rich's speed column starts at the first update)."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        rate = f"{task.completed / elapsed:.1f}" if elapsed and task.completed else "…"
        return Text(f"{rate} img/s", style="progress.data.speed")
