"""Masks for photos of any size. `python -m nailseg.predict ckpt=RUN/checkpoints/last.ckpt
input=PHOTOS output=OUT [masks=TRUE_MASKS] [tta=true] [threshold=auto]`

Writes, for each photo with key `k` (its path relative to the input folder, without extension):
`OUT/masks/k.png` (0/255, the photo's size) and, unless `overlays=false`, `OUT/overlays/k.png`
(prediction in red over the photo); with `masks=`, `OUT/scores.csv` (per image Dice/IoU); and
`OUT/summary.json` (counts, timing, threshold, every skipped file, score totals, the config).
Every file is written under a temporary name and renamed.

The output folder must be new, empty or an earlier predict's (output.py: it may not overlap the
photos or the true masks, in either direction, ignoring case, through links, nor hold a link), and
every true mask is read before the first write: a prediction can never replace a file it is scored
against, nor a file of the user's. `summary.json` is written first, unfinished, and rewritten
finished at the end; `outputs.txt` lists the masks, overlays and scores, a rerun first removes
the ones the run before listed, and a file it did not list where it would write is refused.
Photos are read and written by worker processes (workers.py) while the net runs, a bounded number
ahead, so memory stays flat for any number of photos (true masks are kept bit-packed). On a GPU,
JPEGs are decoded there (decode.py), every photo is resized there, the net is replayed as a CUDA
graph (graphed.py; captured before the first write), each mask is brought back to full size and
thresholded there, and one batch's masks are copied back and written while the next batch runs. An
unreadable photo, or one whose output name the filesystem refuses, is reported and skipped; the run
fails only when no photo could be read.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text
from torch import nn

from nailseg.config import CONF_DIR, require_model_group, require_values
from nailseg.device import resolve_device
from nailseg.inference.decode import to_device
from nailseg.inference.graphed import CaptureError, GraphedNet
from nailseg.inference.output import (
    OUTPUT_FOLDERS,
    PREDICT_LOCK,
    SCORES,
    OutputError,
    check_output,
    claim,
    list_outputs,
    write_summary,
)
from nailseg.inference.photos import (
    MaskIndex,
    Photo,
    Skipped,
    TrueMask,
    list_inputs,
    read_true_masks,
)
from nailseg.inference.scoring import ImageScore, score_table, totals
from nailseg.inference.spec import (
    InferenceConfig,
    InferenceSpec,
    Net,
    full_size_probabilities,
    probabilities,
    resolve_spec,
    to_batch,
)
from nailseg.inference.threshold import ThresholdError, auto_threshold
from nailseg.inference.workers import (
    Loaded,
    NotWritten,
    PhotoWriter,
    Prediction,
    read_photos,
    start_worker,
)
from nailseg.io.atomic import write_atomic
from nailseg.io.lock import locked
from nailseg.io.permissions import unwritable_folder
from nailseg.model.checkpoint import CheckpointError, load_net
from nailseg.prep.imageio import UnreadableImage, check_mask_threshold
from nailseg.tables import print_table


@dataclass
class PredictConfig(InferenceConfig):
    """Types only: the values are in conf/predict.yaml."""

    input: Any = MISSING  # a folder (searched recursively), a file, or a list of either
    output: str = MISSING
    masks: str | None = None  # true masks, matched by key: writes scores.csv
    tta: bool = MISSING  # mean of identity, horizontal and vertical flip probabilities
    threshold: str | None = None  # None: the checkpoint's; a number; "auto": Dice-best on valid
    data_root: str | None = None  # prepared data for threshold=auto (None: the checkpoint's)
    batch_size: int = MISSING
    device: str = MISSING  # auto | cpu | cuda | cuda:N
    gpu_decode: bool = MISSING  # on a GPU: JPEGs decoded by nvJPEG (else by the worker processes)
    engine: str = MISSING  # torch | onnx (ONNX Runtime, CPU only)
    cuda_graphs: bool = MISSING  # on a GPU: the net's forward replayed as a CUDA graph
    overlays: bool = MISSING  # also write OUT/overlays/<key>.png
    num_workers: int | None = None  # processes reading and writing files (None: see _workers)
    mask_threshold: int = MISSING  # a true mask's value > this is nail (0/1 masks taken as is)


ConfigStore.instance().store(name="predict_schema", node=PredictConfig)


class PredictError(RuntimeError):
    """Nothing to predict, or nothing readable: the message says which."""


@dataclass
class PredictSummary:
    images: int = 0  # photos predicted and written
    seconds: float = 0.0  # reading, predicting and writing them
    threshold: float = 0.5
    threshold_source: str = "checkpoint"  # checkpoint | override | auto
    skipped: list[Skipped] = field(default_factory=list)
    unscored: list[Skipped] = field(default_factory=list)  # predicted, but with no usable mask
    scores: dict[str, Any] | None = None  # totals: `overall` and per group (`groups`)
    # where the main thread's time went (seconds): waiting for photos to be read, queueing the
    # device work (decode, resize, net, full-size maps, thresholds, copies to the host), waiting
    # for the masks to come back from the device, waiting for the writing processes
    stages: dict[str, float] = field(default_factory=dict)
    capture_seconds: float = 0.0  # capturing the net's CUDA graph, before `seconds` start
    workers_seconds: float = 0.0  # starting the worker processes, before `seconds` start
    # what ran, whatever was asked: nvJPEG and CUDA graphs exist on a GPU only, graphs for torch
    device: str = "cpu"
    gpu_decode: bool = False
    cuda_graphs: bool = False

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    """`items` in consecutive slices of `size` (the last may be shorter): the workers' tasks."""
    return (items[start : start + size] for start in range(0, len(items), size))


def _read_ahead(
    photos: Sequence[Photo], pool: Executor, depth: int, chunk: int, gpu_jpeg: bool
) -> Iterator[tuple[Photo, Loaded | UnreadableImage]]:
    """Loaded photos in order, read by the workers `chunk` at a time with at most `depth` photos
    in flight (not all at once, as `pool.map` would: that holds every decoded photo of a large
    folder in memory)."""
    chunks = _chunks(photos, chunk)
    queue: deque[tuple[Sequence[Photo], Future]] = deque()
    for part in chunks:
        queue.append((part, pool.submit(read_photos, part, gpu_jpeg)))
        if len(queue) * chunk >= depth:
            break
    while queue:
        part, future = queue.popleft()
        following = next(chunks, None)
        if following is not None:
            queue.append((following, pool.submit(read_photos, following, gpu_jpeg)))
        yield from zip(part, future.result(), strict=True)


class _RateColumn(ProgressColumn):
    """Photos done per second since the bar started. Rich's own speed divides the photos of all
    but the first update by the time from the first update to the last, so chunks written in a
    burst at the end showed rates thousands of times too high."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        if not elapsed or not task.completed:
            return Text("… img/s", style="progress.data.speed")
        return Text(f"{task.completed / elapsed:.1f} img/s", style="progress.data.speed")


def _advance(progress: Progress, task: TaskID, photos: int) -> Callable[[Future], None]:
    """A written chunk's callback: the progress bar moves by its photos."""
    return lambda _: progress.advance(task, photos)


# the names of `PredictSummary.stages` (bench_predict reports them as columns)
STAGES = ("read_wait", "device_queue", "device_wait", "write_wait")


class _Stopwatch:
    """Seconds spent per named stage."""

    def __init__(self, *names: str) -> None:
        self.seconds = dict.fromkeys(names, 0.0)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


def _predict_all(
    net: Net,
    spec: InferenceSpec,
    photos: Sequence[Photo],
    writer: PhotoWriter,
    truths: Mapping[str, TrueMask | str] | None,
    pool: Executor,
    *,
    threshold: float,
    tta: bool,
    device: torch.device,
    batch_size: int,
    num_workers: int,
    gpu_jpeg: bool,
    overlays: bool,
    console: Console,
) -> tuple[int, list[Skipped], list[ImageScore], list[Skipped], dict[str, float]]:
    """Predict every photo, read and written by the `num_workers` processes of `pool` (JPEGs
    decoded by nvJPEG with `gpu_jpeg`); `truths`: every photo's true mask or why it has none (None:
    not scoring). Returns (written, unreadable, scores, unscored, stages). Files left out are
    listed by `print_summary` once the progress bar is done."""
    unreadable: list[Skipped] = []
    results: list[ImageScore | Skipped | None] = []
    depth = max(2 * batch_size, num_workers)
    chunk = -(-batch_size // num_workers)  # a batch spread over every worker
    clock = _Stopwatch(*STAGES)
    columns = (
        TextColumn("predicting"),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    Launched = list[tuple[Photo, np.ndarray | torch.Tensor | None, torch.Tensor]]
    Fetched = tuple[Launched, HostCopy, HostCopy | None]
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("predicting", total=len(photos))
        writes: deque[tuple[int, Future]] = deque()  # (photos, their writing)
        batch: list[tuple[Photo, Loaded]] = []
        launched: Launched = []

        def launch() -> Launched:
            """Queue the batch's work on the device: decode, resize, net, full-size probability maps."""
            photos_, loaded = [p for p, _ in batch], [item for _, item in batch]
            images, kept = [], []
            for photo, item, image in zip(
                photos_, loaded, to_device(photos_, loaded, device), strict=True
            ):
                if isinstance(image, UnreadableImage):
                    unreadable.append(Skipped(photo.path, f"unreadable: {image.reason}"))
                    progress.advance(task)
                    continue
                images.append(image)
                # the overlay's photo: as read on the CPU, or the GPU-decoded one (copied back)
                kept.append((photo, item if isinstance(item, np.ndarray) else image))
            batch.clear()
            if not images:
                return []
            probs = full_size_probabilities(net, images, spec, tta)
            return [
                (photo, shown if overlays else None, prob)
                for (photo, shown), prob in zip(kept, probs, strict=True)
            ]

        def fetch(work: Launched) -> Fetched | None:
            """Queue the copy of a launched batch's masks to the host (one copy, thresholded in
            one call; the GPU-decoded photos its overlays need, another)."""
            if not work:
                return None
            masks = _to_host([prob for _, _, prob in work], lambda flat: flat > threshold)
            decoded = [s for _, s, _ in work if isinstance(s, torch.Tensor)]
            return work, masks, _to_host(decoded) if decoded else None

        def finish(fetched: Fetched | None) -> None:
            """Wait for a fetched batch's copies (only them) and hand its masks to the writers."""
            if fetched is None:
                return
            work, masks, decoded = fetched
            with clock("device_wait"):
                preds = masks.arrays()
                hosted = iter(decoded.arrays() if decoded else [])
                shown = [  # C×H×W back to H×W×C (a view)
                    next(hosted).transpose(1, 2, 0) if isinstance(s, torch.Tensor) else s
                    for _, s, _ in work
                ]
            predictions: list[Prediction] = [
                (photo, image, pred, None if truths is None else truths[photo.key])
                for (photo, _, _), image, pred in zip(work, shown, preds, strict=True)
            ]
            for part in _chunks(predictions, chunk):
                future = pool.submit(writer, part)
                future.add_done_callback(_advance(progress, task, len(part)))
                writes.append((len(part), future))
            with clock("write_wait"):
                while sum(n for n, _ in writes) > depth:
                    results.extend(writes.popleft()[1].result())

        def advance(next_batch: bool) -> None:
            """The last launched batch's copies are queued before the next batch's work, so
            waiting for them does not wait for that work: the device runs it while the host
            writes the last batch and reads the next."""
            nonlocal launched
            with clock("device_queue"):
                fetched = fetch(launched)
                launched = launch() if next_batch else []
            finish(fetched)

        reads = _read_ahead(photos, pool, depth, chunk, gpu_jpeg)
        while True:
            with clock("read_wait"):
                photo, item = next(reads, (None, None))
            if photo is None:
                break
            if isinstance(item, UnreadableImage):
                unreadable.append(Skipped(photo.path, f"unreadable: {item.reason}"))
                progress.advance(task)
                continue
            batch.append((photo, item))
            if len(batch) == batch_size:
                advance(next_batch=True)
        advance(next_batch=bool(batch))
        advance(next_batch=False)
        with clock("write_wait"):
            results += [result for _, future in writes for result in future.result()]
    scores = [r for r in results if isinstance(r, ImageScore)]
    unwritten = [r for r in results if isinstance(r, NotWritten)]
    unscored = [r for r in results if isinstance(r, Skipped) and not isinstance(r, NotWritten)]
    return len(results) - len(unwritten), unreadable + unwritten, scores, unscored, clock.seconds


@dataclass(frozen=True)
class HostCopy:
    """Tensors on their way to the host as one flat buffer: on a GPU a pinned one, filled by an
    asynchronous copy that completes at `done`."""

    flat: torch.Tensor
    shapes: list[torch.Size]
    done: torch.cuda.Event | None

    def arrays(self) -> list[np.ndarray]:
        """The tensors as host arrays of their shapes, once the copy is done (only it)."""
        if self.done is not None:
            self.done.synchronize()
        ends = np.cumsum([shape.numel() for shape in self.shapes])[:-1]
        parts = np.split(self.flat.numpy(), ends)
        return [part.reshape(shape) for part, shape in zip(parts, self.shapes, strict=True)]


def _to_host(
    parts: list[torch.Tensor],
    on_device: Callable[[torch.Tensor], torch.Tensor] = lambda flat: flat,
) -> HostCopy:
    """Tensors of any shapes (one device, one dtype) queued for the host in one copy;
    `on_device` is applied to all of them at once, flattened together, first (masks: one
    threshold call a batch). Waiting for the copy (`arrays()`) waits for no work queued after it."""
    flat = on_device(torch.cat([p.flatten() for p in parts]))
    shapes = [p.shape for p in parts]
    if flat.device.type != "cuda":
        return HostCopy(flat, shapes, None)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(flat.device))
    return HostCopy(host, shapes, done)


def _threshold(
    cfg: DictConfig,
    spec: InferenceSpec,
    net: Net,
    device: torch.device,
    console: Console,
) -> tuple[float, str]:
    """(threshold, where it came from): the checkpoint's, the one given, or the Dice-best on
    validation."""
    if cfg.threshold is None:
        return spec.threshold, "checkpoint"
    if str(cfg.threshold) == "auto":
        choice = auto_threshold(
            net,
            spec,
            tta=cfg.tta,
            device=device,
            batch_size=cfg.batch_size,
            data_root=Path(cfg.data_root) if cfg.data_root else None,
            console=console,
        )
        console.print(
            f"threshold=auto: {choice.threshold:.2f} (validation Dice {choice.dice:.4f} over "
            f"{choice.samples} samples"
            + (
                f"; {choice.dice_at_run_threshold:.4f} at the run's {spec.threshold:g})"
                if choice.dice_at_run_threshold is not None
                else ")"
            ),
            highlight=False,
            soft_wrap=True,
        )
        return choice.threshold, "auto"
    try:
        value = float(cfg.threshold)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise PredictError(f"threshold={cfg.threshold}: use a number in [0, 1), auto or null")
    return value, "override"


def _workers(cfg: DictConfig, device: torch.device) -> int:
    """Worker processes reading and writing files: `num_workers`, or when null one per core,
    except on a GPU writing masks only: half the cores, at most 8, leaving cores to the main
    thread that drives the GPU. (The rule was set for threads, when each thread more took
    Python's GIL from that thread; with processes, 8 and 15 measured within each other's spread on
    the H200: 1,591-2,473 and 1,604-1,804 photos/s.) With overlays the writers are the limit."""
    if cfg.num_workers is not None:
        return cfg.num_workers
    cores = os.cpu_count() or 1
    return cores if device.type == "cpu" or cfg.overlays else max(1, min(8, cores // 2))


@contextmanager
def _worker_processes(count: int) -> Iterator[tuple[ProcessPoolExecutor, float]]:
    """`count` processes that read the photos and write the outputs (workers.py), and the seconds
    their start took (they are started before predicting's clock starts). They fork from
    multiprocessing's forkserver: forking this process, which holds CUDA's state and threads, is
    unsafe. The server imports predict once (`_preloaded`), so a worker starts as a copy of it
    instead of importing torch and the rest again."""
    start = time.perf_counter()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_preloaded())
    with ProcessPoolExecutor(count, mp_context=context, initializer=start_worker) as pool:
        try:
            with _workers_starting():
                for started in [pool.submit(os.getpid) for _ in range(count)]:
                    started.result()
            yield pool, time.perf_counter() - start
        except BrokenProcessPool as err:
            raise PredictError(
                "a worker process reading or writing the files died (killed by the system or a "
                "signal: out of memory?), so the run stopped; its summary.json says unfinished, "
                "and a rerun into the same output folder replaces what it wrote"
            ) from err


@contextmanager
def _workers_starting() -> Iterator[None]:
    """Ctrl-C kept from the worker processes' start (in the main thread: only it sets handlers).
    multiprocessing's forkserver, their parent, ignores Ctrl-C only once it has imported its
    preload (torch: seconds), and one before made it print a traceback of its own beside the
    command's: it is started with Ctrl-C ignored, which it inherits (one in the milliseconds of
    that spawn is lost). A Ctrl-C after it is held until the workers have started, then raised:
    taken at once, it cut the start short, and a worker still being made printed a traceback (the
    pool's semaphore was gone with the command)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if held:
        raise KeyboardInterrupt


def _preloaded() -> list[str]:
    """What the forkserver imports once: server_start (it dies with this process), the main
    module when run as a file ("__main__"), and predict with all it imports (torch included). A
    worker imports a main module run with `python -m` itself: preloading that module by name too
    would make runpy warn in every worker that it was imported twice (as predict and as
    bench_predict did on the H200)."""
    return ["nailseg.inference.server_start", "__main__", __name__]


@contextmanager
def _gil_handoff(device: torch.device) -> Iterator[None]:
    """On a GPU, Python's GIL switch interval at 0.5 ms (its default 5 ms) while predicting, then
    back. The main thread queues the device's work while other threads of this process run Python
    too (the process pool's, passing work to the workers and back, and the progress bar's); a
    thread waiting for the GIL asks for it only after the interval, so the main thread lost up to
    5 ms each time it needed it back (measured when the files were read and written by 8 threads:
    H200, 2,660 photos, runs alternated in one call: 913 and 906 photos/s at 5 ms, 1,006 and 1,009
    at 0.5 ms; docs/BENCHMARKS.md)."""
    if device.type != "cuda":
        yield
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _device(engine: str, device: str) -> torch.device:
    """`device`, resolved; ONNX Runtime runs on the CPU, so with `engine=onnx` auto means the CPU
    and a GPU is refused."""
    if engine not in ("torch", "onnx"):
        raise PredictError(f"engine={engine}: use torch or onnx")
    if engine == "onnx" and device not in ("auto", "cpu"):
        raise PredictError(
            f"engine=onnx runs on the CPU (ONNX Runtime's CPU provider), not device={device}: "
            "pass device=cpu, or engine=torch"
        )
    try:
        return resolve_device("cpu" if engine == "onnx" else device)
    except ValueError as err:
        raise PredictError(str(err)) from err


def build_engine(
    engine: str, net: nn.Module, spec: InferenceSpec, device: torch.device, cuda_graphs: bool
) -> Net:
    """What runs the net: PyTorch on `device`, channels-last (the layout a GPU's tensor cores and
    the CPU's oneDNN run convolutions fastest in: on 2 cores, UNet-r18 at 128², predict went from
    37.6-41.4 to 42.3-48.4 photos/s), on a GPU with `cuda_graphs` replayed as CUDA graphs; or
    ONNX Runtime on the CPU."""
    if engine == "torch":
        net = net.to(device, memory_format=torch.channels_last)
        if device.type != "cuda":
            return net
        return GraphedNet(net) if cuda_graphs else net
    from nailseg.inference.export import ExportError, OnnxNet  # onnx: only this engine needs it

    try:
        return OnnxNet(net, spec)
    except ExportError as err:
        raise PredictError(f"engine=onnx: {err}") from err


def _capture(net: GraphedNet, spec: InferenceSpec, batch_size: int, tta: bool) -> float:
    """Capture the graph of a full batch now, through the path predicting takes, so a net that
    cannot be captured fails before anything is written; returns the seconds it took."""
    start = time.perf_counter()
    device = next(net.net.parameters()).device
    blank = torch.zeros(3, *spec.image_size, dtype=torch.uint8, device=device)
    try:
        with torch.inference_mode():
            probabilities(net, to_batch([blank] * batch_size, spec), tta)
    except CaptureError as err:
        raise PredictError(f"{err}; cuda_graphs=false runs it eagerly") from err
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def run(cfg: DictConfig, console: Console | None = None) -> PredictSummary:
    """Predict `cfg.input` into `cfg.output` (see the module docstring)."""
    console = console or Console()
    output = Path(cfg.output)
    if cfg.batch_size < 1:
        raise PredictError(f"batch_size={cfg.batch_size}: must be at least 1")
    if cfg.num_workers is not None and cfg.num_workers < 1:
        raise PredictError(
            f"num_workers={cfg.num_workers}: must be at least 1 (null: see the help)"
        )
    try:
        check_mask_threshold(cfg.mask_threshold)
    except ValueError as err:
        raise PredictError(str(err)) from err
    device = _device(cfg.engine, str(cfg.device))  # engine and device checked before any work
    spec = resolve_spec(cfg)  # the checkpoint and the overrides of its card
    inputs = OmegaConf.to_object(cfg.input) if OmegaConf.is_list(cfg.input) else [cfg.input]
    try:
        check_output(output, [Path(p) for p in inputs], Path(cfg.masks) if cfg.masks else None)
    except OutputError as err:
        raise PredictError(str(err)) from err
    if (folder := unwritable_folder(output)) is not None:
        raise PredictError(
            f"output={output}: {folder} is not writable by this user: change its permissions, "
            "or choose another output"
        )
    num_workers = _workers(cfg, device)
    try:
        photos, skipped = list_inputs(inputs)
        mask_index = MaskIndex(cfg.masks) if cfg.masks else None
    except FileNotFoundError as err:
        raise PredictError(str(err)) from err
    if not photos and not skipped:
        raise PredictError(f"no image files in input={cfg.input}")
    truths = None
    if mask_index is not None:
        with ThreadPoolExecutor(num_workers) as pool:
            truths = read_true_masks(photos, mask_index, cfg.mask_threshold, pool)
        if photos and not any(isinstance(t, TrueMask) for t in truths.values()):
            raise PredictError(  # asked to score, it would score nothing: refused before a write
                f"masks={cfg.masks}: no true mask for any of the {len(photos)} photos (first: "
                f"{next(iter(truths.values()))}); a photo's mask has its path below the photo's "
                "input folder and any extension: input=Images masks=Masks pairs "
                "Images/<group>/x.jpg with Masks/<group>/x.png, and a photo given as a file "
                "pairs with <masks>/x.*"
            )
    net = build_engine(cfg.engine, load_net(spec.ckpt, spec.model), spec, device, cfg.cuda_graphs)
    capture_seconds = (
        _capture(net, spec, cfg.batch_size, cfg.tta) if isinstance(net, GraphedNet) else 0.0
    )
    threshold, source = _threshold(cfg, spec, net, device, console)
    config = OmegaConf.to_container(cfg, resolve=True)
    folders = OUTPUT_FOLDERS if cfg.overlays else OUTPUT_FOLDERS[:1]
    outputs = [f"{folder}/{photo.key}.png" for photo in photos for folder in folders]
    outputs += [SCORES] if truths is not None else []
    with locked(output, PREDICT_LOCK, "predict", "output", PredictError):  # till the last write
        try:
            stamp = claim(
                output,
                {
                    "images": 0,
                    "checkpoint": str(spec.ckpt),
                    "threshold": threshold,
                    "config": config,
                },
                outputs,
            )
        except OutputError as err:
            raise PredictError(str(err)) from err

        gpu_jpeg = cfg.gpu_decode and device.type == "cuda"
        with _worker_processes(num_workers) as (pool, workers_seconds), _gil_handoff(device):
            start = time.perf_counter()
            written, unreadable, scores, unscored, stages = _predict_all(
                net,
                spec,
                photos,
                PhotoWriter(output, stamp),
                truths,
                pool,
                threshold=threshold,
                tta=cfg.tta,
                device=device,
                batch_size=cfg.batch_size,
                num_workers=num_workers,
                gpu_jpeg=gpu_jpeg,
                overlays=cfg.overlays,
                console=console,
            )
            seconds = time.perf_counter() - start
        summary = PredictSummary(
            images=written,
            seconds=seconds,
            threshold=threshold,
            threshold_source=source,
            skipped=skipped + unreadable,
            unscored=unscored,
            stages={name: round(spent, 3) for name, spent in stages.items()},
            capture_seconds=round(capture_seconds, 3),
            workers_seconds=round(workers_seconds, 3),
            device=str(device),
            gpu_decode=gpu_jpeg,
            cuda_graphs=isinstance(net, GraphedNet),
        )
        if scores:
            table = score_table(scores)
            # a file name that is not UTF-8 (its bytes kept by Python as surrogates) is written
            # escaped, as summary.json's JSON writes it: the table stays UTF-8, nothing is lost
            text = table.to_csv(index=False, lineterminator="\n")
            data = text.encode("utf-8", "backslashreplace")
            write_atomic(output / SCORES, lambda f: f.write(data), stamp)
            summary.scores = totals(table)
        report = _summary_json(summary, spec, tta=cfg.tta, device=device)
        list_outputs(output, dict.fromkeys(outputs, stamp))  # the earlier run's are gone
        write_summary(output, report | {"config": config}, finished=True)
        print_summary(summary, output, console)
        if not written:
            raise PredictError(f"none of the {len(summary.skipped)} input files could be read")
        return summary


def _summary_json(
    summary: PredictSummary, spec: InferenceSpec, *, tta: bool, device: torch.device
) -> dict[str, Any]:
    return {
        "images": summary.images,
        "seconds": round(summary.seconds, 3),
        "images_per_s": round(summary.images_per_s, 3),
        "stages_s": summary.stages,
        "capture_s": summary.capture_seconds,
        "workers_start_s": summary.workers_seconds,
        "checkpoint": str(spec.ckpt),
        "image_size": list(spec.image_size),
        "tta": tta,
        "threshold": summary.threshold,
        "threshold_source": summary.threshold_source,
        "device": str(device),
        "skipped": [{"path": str(s.path), "reason": s.reason} for s in summary.skipped],
        "unscored": [{"path": str(s.path), "reason": s.reason} for s in summary.unscored],
        "scores": summary.scores,
    }


def print_summary(summary: PredictSummary, output: Path, console: Console) -> None:
    """Skipped files, the score table (with masks) and the one-line summary."""
    for skipped in summary.skipped:
        console.print(f"  skipped {skipped}", markup=False, highlight=False, soft_wrap=True)
    for unscored in summary.unscored:
        console.print(f"  not scored {unscored}", markup=False, highlight=False, soft_wrap=True)
    if summary.scores:
        table = Table(title=f"scores (threshold {summary.threshold:g})")
        for name in ("group", "images", "dice", "iou", "mean image dice", "mean image iou"):
            table.add_column(name, justify="left" if name == "group" else "right")
        groups = summary.scores["groups"]
        rows = [
            *(groups.items() if len(groups) > 1 else ()),
            ("all images", summary.scores["overall"]),
        ]
        for name, s in rows:
            table.add_row(
                name,
                str(s["images"]),
                *(f"{s[k]:.4f}" for k in ("dice", "iou", "mean_image_dice", "mean_image_iou")),
            )
        print_table(table, console)
    console.print(
        f"predicted {summary.images} images in {summary.seconds:.2f} s "
        f"({summary.images_per_s:.1f} images/s), {len(summary.skipped)} skipped, "
        f"threshold {summary.threshold:g} ({summary.threshold_source}) → {output}",
        highlight=False,
        soft_wrap=True,
    )


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="predict")
def _main(cfg: DictConfig) -> None:
    require_values(cfg, "nailseg.predict")
    try:
        run(cfg)
    except (PredictError, CheckpointError, ThresholdError) as err:
        sys.exit(f"predict failed: {err}")


def main() -> None:
    """The command: its model-key check runs before Hydra composes the config."""
    require_model_group("nailseg.predict", sys.argv[1:])
    _main()


if __name__ == "__main__":
    main()
