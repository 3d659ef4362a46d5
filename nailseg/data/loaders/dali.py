"""`loader=dali`: read, decode, augment and normalise the prepared .npy files in a DALI pipeline.

One batch-mode external source (`_Feeder`) hands over each planned batch's paths, groups and rows
together, so a batch cannot mix samples; each random op runs under a per-sample coin and a DALI
`if`, so only the samples that get it pay. An abandoned pass (limit_*_batches, sanity check, early
stop) ends when the next starts: the feeder stops, the batches in flight are drained, the pipeline
reset. The next pass starts as one ends, so its first batches are ready while the other split runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nailseg.data.augment import COLOUR, GEOMETRIC, PHOTOMETRIC, AugOp, AugSpec, colour_params
from nailseg.data.loaders.base import Batch, PlannedLoader, Records

try:  # a missing DALI fails when a loader is built, naming loader=dali (`_dali`)
    from nvidia.dali import fn, types
    from nvidia.dali import math as dmath
except ImportError:
    pass

if TYPE_CHECKING:
    from nvidia.dali.data_node import DataNode
    from nvidia.dali.pipeline import Pipeline


def _dali() -> Any:
    """Import DALI, or fail with a message that says which backend needs it."""
    try:
        import nvidia.dali
    except ImportError as err:
        raise ImportError(
            "loader=dali needs NVIDIA DALI (pip install nvidia-dali-cuda120); "
            "install it or pick another loader backend (loader=torch)"
        ) from err
    return nvidia.dali


class _Feeder:
    """The external source: one planned batch per call (paths, groups, rows), then stop. On the
    CPU it also draws the Gaussian noise of `noise_ops` with numpy, cheaper than DALI's CPU one."""

    def __init__(
        self,
        images: list[np.ndarray],
        masks: list[np.ndarray],
        groups: np.ndarray,
        noise_ops: tuple[AugOp, ...],
        image_size: tuple[int, int],
    ) -> None:
        self._images, self._masks, self._groups = images, masks, groups
        self.noise_ops, self._image_size = noise_ops, image_size
        self._batches: list[np.ndarray] = []
        self._next = 0
        self._rng = np.random.default_rng(0)

    def start(self, batches: list[np.ndarray], rng: np.random.Generator) -> None:
        self._batches, self._next, self._rng = batches, 0, rng

    def stop(self) -> None:
        """Make the next call raise StopIteration, ending the pass early."""
        self._next = len(self._batches)

    def _noise(self, op: AugOp, n: int) -> list[np.ndarray]:
        """Per sample: whether the op fires, and its noise (CHW, or empty when it does not)."""
        fires = self._rng.random(n) < op.p
        lo, hi = op.ranges["sigma"]
        shape = (3, *self._image_size)
        noise = [
            self._rng.standard_normal(shape, dtype=np.float32)
            * np.float32(self._rng.uniform(lo, hi))
            if fire
            else np.zeros((3, 0, 0), np.float32)
            for fire in fires
        ]
        return [fires, noise]

    def __call__(self) -> tuple:
        if self._next >= len(self._batches):
            raise StopIteration
        rows = self._batches[self._next]
        self._next += 1
        batch = [
            [self._images[r] for r in rows],
            [self._masks[r] for r in rows],
            self._groups[rows],
            rows,
        ]
        for op in self.noise_ops:
            batch += self._noise(op, len(rows))
        return tuple(batch)


def _coin(op: AugOp) -> Any:
    """The predicate of an op's `if`: a per-sample DALI coin, or a plain bool when p is 0 or 1."""
    if op.p in (0.0, 1.0):
        return op.p == 1.0
    return fn.random.coin_flip(probability=op.p, dtype=types.BOOL)


def _uniform(op: AugOp, key: str) -> DataNode | float:
    """A per-sample draw from the op's [lo, hi]; a plain float when lo == hi (DALI rejects that)."""
    lo, hi = op.ranges[key]
    return lo if lo == hi else fn.random.uniform(range=(lo, hi))


def _flip(op: AugOp, image: DataNode, mask: DataNode) -> tuple[DataNode, DataNode]:
    axes = {"horizontal": int(op.name == "hflip"), "vertical": int(op.name == "vflip")}
    return fn.flip(image, **axes), fn.flip(mask, **axes)


def _rotate(op: AugOp, image: DataNode, mask: DataNode) -> tuple[DataNode, DataNode]:
    angle = _uniform(op, "degrees")
    common = {"angle": angle, "keep_size": True, "fill_value": 0}
    return (
        fn.rotate(image, interp_type=types.INTERP_LINEAR, **common),
        fn.rotate(mask, interp_type=types.INTERP_NN, **common),
    )


def _window(op: AugOp, image: DataNode, mask: DataNode) -> tuple[DataNode, DataNode]:
    """random_resized_crop (area scale*H*W, width/height ratio, clamped to the image) and zoom_out
    (each side 1/scale times the image's, 0 around it): a window placed uniformly at random over
    the room between it and the image (negative for a window larger than the image)."""
    hwc = fn.cast(image.shape(), dtype=types.FLOAT)
    h, w = hwc[0], hwc[1]
    policy: dict[str, Any] = {"normalized_anchor": False, "normalized_shape": False}
    if op.name == "zoom_out":
        scale = _uniform(op, "scale")
        win_w, win_h = w / scale, h / scale
        policy |= {"out_of_bounds_policy": "pad", "fill_values": 0}
    else:
        area, ratio = h * w * _uniform(op, "scale"), _uniform(op, "ratio")
        win_w = dmath.clamp(dmath.sqrt(area * ratio), 1.0, w)
        win_h = dmath.clamp(dmath.sqrt(area / ratio), 1.0, h)
    x0 = fn.random.uniform(range=(0.0, 1.0)) * (w - win_w)
    y0 = fn.random.uniform(range=(0.0, 1.0)) * (h - win_h)
    anchor, shape = fn.stack(x0, y0), fn.stack(win_w, win_h)  # slice's default axes: W, H
    return fn.slice(image, anchor, shape, **policy), fn.slice(mask, anchor, shape, **policy)


def _hsv(op: AugOp, image: DataNode) -> DataNode:
    """hue, saturation and grayscale: DALI's colour matrix op."""
    key = next(iter(op.ranges), None)  # grayscale has none
    hue, saturation = colour_params(op.name, _uniform(op, key) if key else 0.0)
    return fn.hsv(image, hue=hue, saturation=saturation)


def _gamma(op: AugOp, image: DataNode) -> DataNode:
    """uint8 in and out; the cast rounds to the nearest level and saturates."""
    levels = fn.cast(image, dtype=types.FLOAT) * (1.0 / 255.0)
    return fn.cast(255.0 * dmath.pow(levels, _uniform(op, "gamma")), dtype=types.UINT8)


def _jpeg(op: AugOp, image: DataNode) -> DataNode:
    lo, hi = op.ranges["quality"]
    qualities = [float(q) for q in range(round(lo), round(hi) + 1)]
    quality = fn.cast(fn.random.uniform(values=qualities), dtype=types.INT32)
    return fn.jpeg_compression_distortion(image, quality=quality)


def _gaussian_noise(op: AugOp, image: DataNode) -> DataNode:
    return fn.noise.gaussian(image, stddev=_uniform(op, "sigma"))


def _gaussian_blur(op: AugOp, image: DataNode) -> DataNode:
    return fn.gaussian_blur(image, sigma=_uniform(op, "sigma"))


def _brightness(op: AugOp, image: DataNode) -> DataNode:
    return image * _uniform(op, "factor")


def _contrast(op: AugOp, image: DataNode) -> DataNode:
    mean = fn.reductions.mean(image)
    lo, hi = fn.reductions.min(image), fn.reductions.max(image)
    return dmath.clamp(mean + (image - mean) * _uniform(op, "factor"), lo, hi)


# each op of the spec (augment.OPS): geometric ones take and give (image, mask), the others an image
_OPS: dict[str, Callable[..., Any]] = {
    "hflip": _flip,
    "vflip": _flip,
    "rotate": _rotate,
    "random_resized_crop": _window,
    "zoom_out": _window,
    "hue": _hsv,
    "saturation": _hsv,
    "grayscale": _hsv,
    "gamma": _gamma,
    "jpeg": _jpeg,
    "gaussian_noise": _gaussian_noise,
    "gaussian_blur": _gaussian_blur,
    "brightness": _brightness,
    "contrast": _contrast,
}


def _build_pipeline(
    feeder: _Feeder,
    spec: AugSpec,
    *,
    train: bool,
    image_size: tuple[int, int],
    device_id: int | None,
    batch_size: int,
    num_threads: int,
    prefetch: int,
    seed: int,
) -> Pipeline:
    """The pipeline: (image 3xHxW float, mask 1xHxW float, group, row) per sample; train applies
    the spec, eval only resizes and normalises. Files are read and decoded on the CPU; with a
    `device_id` everything after runs on that GPU."""
    dali = _dali()
    gpu = device_id is not None
    out_h, out_w = image_size
    host_noise = len(feeder.noise_ops)
    # the feeder's outputs: image and mask file bytes, group, row, then per noise op drawn on the
    # host a flag and a noise tensor
    noise_types = [types.BOOL, types.FLOAT] * host_noise
    fed = [types.UINT8, types.UINT8, types.INT64, types.INT64, *noise_types]
    mean, std = [255.0 * m for m in spec.mean], [255.0 * s for s in spec.std]

    @dali.pipeline_def(enable_conditionals=True)
    def pipeline() -> tuple[DataNode, ...]:
        image_path, mask_path, group, row, *noise_inputs = fn.external_source(
            source=feeder, num_outputs=len(fed), batch=True, dtype=fed
        )
        draws = 0  # host noise inputs used so far (one flag and one noise tensor per op)
        image = fn.reshape(fn.decoders.numpy(fn.io.file.read(image_path)), layout="HWC")
        mask = fn.reshape(fn.decoders.numpy(fn.io.file.read(mask_path)), layout="HWC")
        if gpu:
            image, mask, group, row = image.gpu(), mask.gpu(), group.gpu(), row.gpu()
        ops = spec if train else AugSpec((), spec.mean, spec.std)
        for op in ops.stage(GEOMETRIC):
            if _coin(op):
                image, mask = _OPS[op.name](op, image, mask)
        image = fn.resize(image, resize_x=out_w, resize_y=out_h, interp_type=types.INTERP_LINEAR)
        mask = fn.resize(mask, resize_x=out_w, resize_y=out_h, interp_type=types.INTERP_NN)
        for op in ops.stage(COLOUR):
            if _coin(op):
                image = _OPS[op.name](op, image)
        # HWC uint8 to CHW float, normalised
        image = fn.crop_mirror_normalize(
            image, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std
        )
        for op in ops.stage(PHOTOMETRIC):
            if host_noise and op.name == "gaussian_noise":
                fires, noise = noise_inputs[2 * draws], noise_inputs[2 * draws + 1]
                draws += 1
                if fires:
                    image = image + noise
            elif _coin(op):
                image = _OPS[op.name](op, image)
        mask = fn.transpose(fn.cast(mask, dtype=types.FLOAT), perm=[2, 0, 1], output_layout="CHW")
        return image, mask, group, row

    return pipeline(
        batch_size=batch_size,
        num_threads=num_threads,
        device_id=device_id,
        prefetch_queue_depth=prefetch,
        seed=seed,
    )


def _to_torch(outputs: Any, device: torch.device) -> torch.Tensor:
    """A DALI batch as a torch tensor, zero-copy through DLPack (DALI keeps an output buffer alive
    while a tensor references it; DLPack orders the GPU data before the consumer's stream)."""
    with device:
        return torch.from_dlpack(outputs.as_tensor())


_CUDA_STREAM_LEGACY = 1  # cudaStreamLegacy, the legacy default stream's explicit handle


class DaliLoader(PlannedLoader):
    """`loader=dali`: on the GPU the pipeline runs DALI's GPU operators and batches stay there."""

    MIN_WORKERS = 1  # DALI's CPU threads

    def __init__(
        self,
        records: Records,
        spec: AugSpec,
        *,
        image_size: tuple[int, int],
        num_workers: int,
        prefetch: int,
        **plan: Any,
    ) -> None:
        """`plan`: `PlannedLoader`'s keyword arguments."""
        self._pipe: Pipeline | None = None
        self._in_flight = False  # a pass is scheduled in the pipeline and not yet drained
        self._started_epoch: int | None = None  # the epoch of a pass started before its iter()
        super().__init__(records, **plan)
        paths = [
            [np.frombuffer(path.encode(), dtype=np.uint8) for path in column]
            for column in (self.records.images, self.records.masks)
        ]
        device_id = self.device.index if self.device.type == "cuda" else None
        if device_id is not None:
            _release_unused_memory()  # checked now: a DALI without it fails here, not at close
        noise_ops = (
            tuple(op for op in spec.ops if op.name == "gaussian_noise") if self.train else ()
        )
        self._feeder = _Feeder(
            *paths, self.records.groups, noise_ops if device_id is None else (), image_size
        )
        # seeded per rank, so ranks do not draw identical augmentations
        pipe_seed = int(np.random.SeedSequence((self.seed, self.rank)).generate_state(1)[0] >> 1)
        self._pipe = _build_pipeline(
            self._feeder,
            spec,
            train=self.train,
            image_size=image_size,
            device_id=device_id,
            batch_size=self.batch_size,
            num_threads=num_workers,
            prefetch=prefetch,
            seed=pipe_seed,
        )
        self._pipe.build()

    def __iter__(self) -> Iterator[Batch]:
        """One full pass, started at the first `next()`: an unused iterator uses up no epoch."""
        self._require_pipe()
        pass_id, epoch = self._begin_pass()
        if self._started_epoch != epoch:  # nothing started, or another epoch's plan
            self._end_pass()
            self._start(epoch)
        self._started_epoch = None
        while self._is_current(pass_id):  # a pass started later (or close) supersedes this one
            pipe = self._require_pipe()  # no local reference survives a yield: close() frees it
            try:
                image, mask, group, row = pipe.outputs(cuda_stream=self._consumer_stream())
            except StopIteration:
                pipe.reset()
                self._in_flight = False
                self._start(self._epoch)  # the next pass, as the epoch it will shuffle as
                self._started_epoch = self._epoch
                return
            pipe.schedule_run()  # keeps `prefetch` batches in flight; a no-op past the plan
            del pipe
            yield {
                "image": _to_torch(image, self.device),
                "mask": _to_torch(mask, self.device),
                "group": _to_torch(group, self.device),
                "index": _to_torch(row, self.device),
            }

    def _consumer_stream(self) -> int | None:
        """torch's current CUDA stream (its default, handle 0, is `cudaStreamLegacy`), for DALI to
        order the batch before it on the device, rather than make the host wait."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.current_stream(self.device).cuda_stream or _CUDA_STREAM_LEGACY

    def _start(self, epoch: int) -> None:
        """Feed epoch `epoch`'s plan and schedule its first `prefetch` batches; nothing waits."""
        self._feeder.start(
            self.plan(epoch=epoch), np.random.default_rng((self.seed, self.rank, epoch))
        )
        self._require_pipe().schedule_run()
        self._in_flight = True

    def _end_pass(self) -> None:
        """End an unfinished or unused pass: stop feeding, drain the batches in flight, reset."""
        self._started_epoch = None
        if not self._in_flight:
            return
        pipe = self._require_pipe()
        self._feeder.stop()
        pipe.schedule_run()  # meets the stopped feeder: the pipeline marks its last iteration
        while True:
            try:
                pipe.outputs()
            except StopIteration:
                break
        pipe.reset()
        self._in_flight = False

    def _require_pipe(self) -> Pipeline:
        if self._pipe is None:
            raise RuntimeError("this DaliLoader was closed")
        return self._pipe

    def _free(self) -> None:
        """Release the pipeline; on the GPU, DALI's free pool goes back to the device too."""
        self._in_flight, self._started_epoch = False, None
        pipe, self._pipe = self._pipe, None
        if pipe is not None and self.device.type == "cuda":
            del pipe
            _release_unused_memory()()

    def __del__(self) -> None:
        self._pipe = None  # at garbage collection (maybe interpreter exit): no DALI calls


def _release_unused_memory() -> Any:
    """DALI's call that returns its pool's free GPU memory (not documented API: looked up here)."""
    release = getattr(_dali().backend, "ReleaseUnusedMemory", None)
    if release is None:
        raise RuntimeError(
            "this NVIDIA DALI has no backend.ReleaseUnusedMemory; nailseg's GPU loader was "
            "written for nvidia-dali-cuda120==2.4.0: install the pinned version"
        )
    return release
