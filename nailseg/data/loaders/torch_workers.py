"""`loader=torch`: a torch DataLoader whose worker processes apply the AugSpec with numpy and OpenCV
(`loader=kornia` reads through it too).

Each op reproduces DALI's pixel for pixel, through augment.py's numbers; images are resized with
torch's antialiased bilinear filter on uint8, which is DALI's linear resize (OpenCV's aliases),
masks with DALI's half-pixel nearest rule. A sample's randomness is seeded by (seed, epoch, row,
draw), `draw` counting the row's earlier draws in the epoch's plan (`PlanSampler`): it does not
depend on the number of workers or ranks, and a repeated row gets fresh augmentation. The
DataLoader is owned by a `weakref.finalize`, never by the loader alone: Lightning keeps loaders in
reference cycles, and a DataLoader collected as cyclic garbage waits out its workers' timeout.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from nailseg.collector import frozen_heap
from nailseg.data.augment import (
    COLOUR,
    GEOMETRIC,
    OPS,
    PHOTOMETRIC,
    AugOp,
    AugSpec,
    blur_window,
    colour_matrices,
    colour_params,
    crop_windows,
    rotation_matrices,
    zoom_windows,
)
from nailseg.data.loaders.base import Batch, PlannedLoader, Records, read_npy

Rng = np.random.Generator


def _flip(op: AugOp, image: np.ndarray, mask: np.ndarray, _: Rng) -> tuple[np.ndarray, ...]:
    code = 1 if op.name == "hflip" else 0  # OpenCV: 1 mirrors columns, 0 mirrors rows
    return cv2.flip(image, code), cv2.flip(mask, code)


def _rotate(op: AugOp, image: np.ndarray, mask: np.ndarray, rng: Rng) -> tuple[np.ndarray, ...]:
    h, w = mask.shape
    degrees = np.array([rng.uniform(*op.ranges["degrees"])])
    matrix = rotation_matrices(degrees, np.array([[h, w]], dtype=np.float64), (h, w))[0]
    border = {"borderMode": cv2.BORDER_CONSTANT, "borderValue": 0}
    return (
        cv2.warpAffine(image, matrix, (w, h), flags=cv2.INTER_LINEAR, **border),
        cv2.warpAffine(mask, matrix, (w, h), flags=cv2.INTER_NEAREST, **border),
    )


def _window(op: AugOp, image: np.ndarray, mask: np.ndarray, rng: Rng) -> tuple[np.ndarray, ...]:
    """random_resized_crop (a window inside the image) and zoom_out (around it, 0 there)."""
    draws = [rng.uniform(*op.ranges[key]) for key in OPS[op.name].params]
    windows = crop_windows if op.name == "random_resized_crop" else zoom_windows
    canvas = np.array([mask.shape], dtype=np.float64)
    x0, y0, x1, y1 = windows(canvas, *np.array([*draws, rng.random(), rng.random()])[:, None])[0]
    if op.name == "random_resized_crop":
        return image[y0:y1, x0:x1], mask[y0:y1, x0:x1]
    pad = ((-y0, y1 - mask.shape[0]), (-x0, x1 - mask.shape[1]))
    return np.pad(image, (*pad, (0, 0))), np.pad(mask, pad)


def _colour_matrix(op: AugOp, image: np.ndarray, rng: Rng) -> np.ndarray:
    draw = rng.uniform(*next(iter(op.ranges.values()))) if op.ranges else 0.0
    matrix = colour_matrices(*(np.array([v]) for v in colour_params(op.name, draw)))[0]
    out = matrix @ image.reshape(3, -1).astype(np.float32)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8).reshape(image.shape)


def _gamma(op: AugOp, image: np.ndarray, rng: Rng) -> np.ndarray:
    gamma = rng.uniform(*op.ranges["gamma"])
    table = np.rint(255.0 * (np.arange(256) / 255.0) ** gamma).astype(np.uint8)
    return table[image]


def _jpeg(op: AugOp, image: np.ndarray, rng: Rng) -> np.ndarray:
    lo, hi = op.ranges["quality"]
    quality = int(rng.integers(round(lo), round(hi) + 1))
    bgr = np.ascontiguousarray(image[::-1].transpose(1, 2, 0))
    ok, encoded = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError(f"OpenCV could not JPEG-encode a {bgr.shape} image")
    return np.ascontiguousarray(cv2.imdecode(encoded, cv2.IMREAD_COLOR).transpose(2, 0, 1)[::-1])


def _gaussian_noise(op: AugOp, x: np.ndarray, rng: Rng) -> np.ndarray:
    sigma = rng.uniform(*op.ranges["sigma"])
    return x + sigma * rng.standard_normal(x.shape, dtype=np.float32)


def _gaussian_blur(op: AugOp, x: np.ndarray, rng: Rng) -> np.ndarray:
    sigma = rng.uniform(*op.ranges["sigma"])
    k = blur_window(sigma)
    return np.stack(
        [cv2.GaussianBlur(c, (k, k), sigma, borderType=cv2.BORDER_REFLECT_101) for c in x]
    )


def _brightness(op: AugOp, x: np.ndarray, rng: Rng) -> np.ndarray:
    return x * rng.uniform(*op.ranges["factor"])


def _contrast(op: AugOp, x: np.ndarray, rng: Rng) -> np.ndarray:
    mean = x.mean()
    return np.clip(mean + (x - mean) * rng.uniform(*op.ranges["factor"]), x.min(), x.max())


# each op of the spec (augment.OPS): geometric ones on the image and its mask, colour ones on the
# resized uint8 3xHxW image, photometric ones on the normalised image
_OPS: dict[str, Callable[..., Any]] = {
    "hflip": _flip,
    "vflip": _flip,
    "rotate": _rotate,
    "random_resized_crop": _window,
    "zoom_out": _window,
    "hue": _colour_matrix,
    "saturation": _colour_matrix,
    "grayscale": _colour_matrix,
    "gamma": _gamma,
    "jpeg": _jpeg,
    "gaussian_noise": _gaussian_noise,
    "gaussian_blur": _gaussian_blur,
    "brightness": _brightness,
    "contrast": _contrast,
}


def resize_image(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 HxWx3 -> uint8 3 x size: bilinear, antialiased when shrinking (DALI's filter)."""
    chw = torch.from_numpy(image).permute(2, 0, 1)[None]
    out = F.interpolate(chw, size=size, mode="bilinear", align_corners=False, antialias=True)
    return out[0].numpy()


def resize_mask(mask: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """HxW -> size, nearest: output pixel i takes input floor((i + 0.5) * in / out), as DALI."""
    rows, cols = (
        (2 * np.arange(o) + 1) * n // (2 * o) for n, o in zip(mask.shape, size, strict=True)
    )
    return mask[np.ix_(rows, cols)]


class OpenCVTransform:
    """One sample through the spec: geometric ops, resize, colour ops, normalise, photometric ops;
    with `normalise=False` it stops after the resize (uint8), for a backend that goes on on the
    device."""

    def __init__(
        self, spec: AugSpec, image_size: tuple[int, int], *, normalise: bool = True
    ) -> None:
        if not normalise and len(spec.stage(GEOMETRIC)) < len(spec.ops):
            raise ValueError("colour and photometric ops follow the resize: normalise=True needed")
        self.spec, self.image_size, self.normalise = spec, image_size, normalise
        self._mean = 255 * np.array(spec.mean, dtype=np.float32)[:, None, None]
        self._std = 255 * np.array(spec.std, dtype=np.float32)[:, None, None]

    @staticmethod
    def worker_init(_worker_id: int) -> None:
        """OpenCV on the worker's own thread (0, not 1, which can hang a forked worker)."""
        cv2.setNumThreads(0)

    def __call__(
        self, image: np.ndarray, mask: np.ndarray, rng: Rng
    ) -> tuple[np.ndarray, np.ndarray]:
        for op in self.spec.stage(GEOMETRIC):
            if rng.random() < op.p:
                image, mask = _OPS[op.name](op, image, mask, rng)
        image = resize_image(image, self.image_size)
        mask = resize_mask(mask, self.image_size)[None]
        if not self.normalise:
            return image, mask
        for op in self.spec.stage(COLOUR):
            if rng.random() < op.p:
                image = _OPS[op.name](op, image, rng)
        x = (image - self._mean) / self._std
        for op in self.spec.stage(PHOTOMETRIC):
            if rng.random() < op.p:
                x = _OPS[op.name](op, x, rng)
        return x, mask


Key = tuple[int, int, int]  # (CSV row, epoch, earlier draws of the row in the epoch's plan)


# The device-side step of a backend: (batch on the device, its CSV rows on the host, so no copy
# waits for the device; a seed for its draws) -> the batch, whose tensors it may modify.
BatchTransform = Callable[[Batch, np.ndarray, int], Batch]


class NpyDataset(Dataset):
    """Prepared samples indexed by (row, epoch, draw); the transform draws from a
    (seed, epoch, row, draw) rng."""

    def __init__(self, records: Records, transform: OpenCVTransform, seed: int) -> None:
        self.records, self.transform, self.seed = records, transform, seed

    def __len__(self) -> int:
        return len(self.records.images)

    def __getitem__(self, key: Key) -> dict[str, torch.Tensor | int]:
        row, epoch, draw = key
        image = read_npy(self.records.images[row], 3)
        mask = read_npy(self.records.masks[row], 1)[..., 0]
        rng = np.random.default_rng((self.seed, epoch, row, draw))
        image, mask = self.transform(image, mask, rng)
        return {
            "image": torch.from_numpy(image),
            "mask": torch.from_numpy(mask),
            "group": int(self.records.groups[row]),
            "index": row,
        }


class PlanSampler(Sampler[list[Key]]):
    """Batch sampler: the loader's plan for `epoch`, each row with the epoch and its earlier draws
    in the whole epoch's plan (one rank's counts would repeat a key on two ranks). It holds the
    plan, never the loader."""

    def __init__(self, plan: Callable[..., list[np.ndarray]], length: int) -> None:
        self._plan, self._len = plan, length
        self.epoch = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[list[Key]]:
        epoch = self.epoch
        for rows, draws in self._plan(epoch=epoch, draws=True):
            yield [
                (row, epoch, draw) for row, draw in zip(rows.tolist(), draws.tolist(), strict=True)
            ]


class _Workers:
    """The DataLoader and the running pass's iterator; the only owner, so dropping them here stops
    the workers (a non-persistent iterator's at once, persistent ones' with the DataLoader)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader: DataLoader | None = loader
        self.it: Iterator | None = None

    def release(self) -> None:
        """Stop the workers now: a failed pass's traceback may keep its iterator alive, and
        collecting it later would wait on the workers then (seconds, at any moment)."""
        for it in (self.it, getattr(self.loader, "_iterator", None)):
            if hasattr(it, "_shutdown_workers"):  # torch's multi-process iterator
                it._shutdown_workers()
        self.it = self.loader = None


class TorchLoader(PlannedLoader):
    """`loader=torch`: DataLoader workers run the whole spec; batches are only moved (a subclass
    may move work to the device: `_transforms`). `num_workers`, `pin_memory` (CUDA only) and
    `persistent_workers` are the DataLoader's; `prefetch` its batches in flight per worker."""

    def __init__(
        self,
        records: Records,
        spec: AugSpec,
        *,
        image_size: tuple[int, int],
        num_workers: int,
        pin_memory: bool,
        persistent_workers: bool,
        prefetch: int,
        **plan: Any,
    ) -> None:
        """`plan`: `PlannedLoader`'s keyword arguments."""
        super().__init__(records, **plan)
        size = (int(image_size[0]), int(image_size[1]))
        sample_transform, self._batch_transform = self._transforms(spec, size)
        self._sampler = PlanSampler(self.plan, len(self))
        workers = num_workers > 0
        self._workers = _Workers(
            DataLoader(
                NpyDataset(self.records, sample_transform, self.seed),
                batch_sampler=self._sampler,
                num_workers=num_workers,
                pin_memory=pin_memory and self.device.type == "cuda",
                persistent_workers=persistent_workers and workers,
                prefetch_factor=prefetch if workers else None,
                worker_init_fn=sample_transform.worker_init if workers else None,
            )
        )
        self._release = weakref.finalize(self, self._workers.release)

    def _transforms(
        self, spec: AugSpec, image_size: tuple[int, int]
    ) -> tuple[OpenCVTransform, BatchTransform | None]:
        """The per-sample work for the workers, and the per-batch work on the device (or None)."""
        return OpenCVTransform(spec, image_size), None

    def __iter__(self) -> Iterator[Batch]:
        """One full pass; it starts at the first `next()`, so an unused iterator costs nothing."""
        workers = self._workers
        if workers.loader is None:
            raise RuntimeError(f"this {type(self).__name__} was closed")
        pass_id, epoch = self._begin_pass()
        self._sampler.epoch = epoch
        # Replacing the old pass's iterator frees its workers (persistent ones are reset and
        # drained instead). Only `workers.it` holds it, never a local across a yield.
        with frozen_heap():  # workers forked here never collect (and finalize) our garbage
            workers.it = iter(workers.loader)
        step = 0
        while self._is_current(pass_id):
            try:
                batch = next(workers.it)
            except StopIteration:
                workers.it = None
                return
            yield self._finish(batch, epoch, step)
            step += 1

    def _free(self) -> None:
        self._release()

    def _finish(self, batch: dict[str, torch.Tensor], epoch: int, step: int) -> Batch:
        """Move to the device (masks travel as uint8: a quarter of the bytes), then the device step."""
        rows = batch["index"].numpy()
        batch = {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}
        batch["mask"] = batch["mask"].float()
        if self._batch_transform is None:
            return batch
        # seeded per rank, so ranks do not draw identical augmentations
        seed = np.random.SeedSequence((self.seed, self.rank, epoch, step)).generate_state(1)[0]
        return self._batch_transform(batch, rows, int(seed))
