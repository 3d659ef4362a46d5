"""`loader=kornia`: workers only read and resize (uint8 out); the spec runs per batch on the device,
under a forked torch generator seeded from (seed, rank, epoch, step). Geometric ops, which act on
the canvas before the resize, are per-sample affine warps of the resized batch, each sample's
canvas size tracked through them (zoom_out shrinks without antialiasing, unlike DALI); jpeg is
Kornia's differentiable codec, a level or so off libjpeg.
"""

from __future__ import annotations

from collections.abc import Callable

import kornia.augmentation as K
import numpy as np
import torch
from kornia.enhance import jpeg_codec_differentiable
from kornia.geometry.transform import warp_affine

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
from nailseg.data.loaders.base import Batch
from nailseg.data.loaders.torch_workers import BatchTransform, OpenCVTransform, TorchLoader

Tensor = torch.Tensor
# The work of one op on the rows that got it: (images, masks, canvas sizes (k, 2): height, width
# before the final resize) -> the same. Photometric ops take and give the images only.
Warped = tuple[Tensor, Tensor, np.ndarray]
Geometric = Callable[[Tensor, Tensor, np.ndarray], Warped]
Photometric = Callable[[Tensor], Tensor]


def _fired(op: AugOp, n: int) -> np.ndarray:
    """The batch rows that get `op`: one coin per sample."""
    return np.flatnonzero((torch.rand(n, dtype=torch.float64) < op.p).numpy())


def _uniform(op: AugOp, key: str, k: int) -> np.ndarray:
    lo, hi = op.ranges[key]
    return lo + (hi - lo) * torch.rand(k, dtype=torch.float64).numpy()


def _to(values: np.ndarray, device: torch.device) -> Tensor:
    """Host values onto the device without waiting for the work queued there."""
    tensor = torch.from_numpy(values)
    if tensor.is_floating_point():
        tensor = tensor.float()
    return tensor.to(device, non_blocking=True)


def _warp(image: Tensor, mask: Tensor, matrices: np.ndarray, padding: str) -> tuple[Tensor, Tensor]:
    """Warp by source -> destination pixel maps: image bilinear, mask nearest."""
    m, size = _to(matrices, image.device), (image.shape[-2], image.shape[-1])
    return (
        warp_affine(image, m, size, mode="bilinear", padding_mode=padding),
        warp_affine(mask, m, size, mode="nearest", padding_mode=padding),
    )


def _crop_matrices(windows: np.ndarray, canvas: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """Maps from the resized canvas to its crop window resized to `out_hw` (half-pixel centres)."""

    def axis(
        start: np.ndarray, end: np.ndarray, side: np.ndarray, out: int
    ) -> tuple[np.ndarray, ...]:
        zoom = (end - start) / side  # source pixels per destination pixel
        first = start * out / side + 0.5 * zoom - 0.5  # source position of destination pixel 0
        return 1 / zoom, -first / zoom

    sx, tx = axis(windows[:, 0], windows[:, 2], canvas[:, 1], out_hw[1])
    sy, ty = axis(windows[:, 1], windows[:, 3], canvas[:, 0], out_hw[0])
    zero = np.zeros_like(sx)
    return np.stack([np.stack([sx, zero, tx], -1), np.stack([zero, sy, ty], -1)], 1)


def _flip(op: AugOp, _: torch.Generator) -> Geometric:
    dims = [-1] if op.name == "hflip" else [-2]
    return lambda image, mask, canvas: (image.flip(dims), mask.flip(dims), canvas)


def _rotate(op: AugOp, _: torch.Generator) -> Geometric:
    def transform(image: Tensor, mask: Tensor, canvas: np.ndarray) -> Warped:
        degrees = _uniform(op, "degrees", len(canvas))
        matrices = rotation_matrices(degrees, canvas, (image.shape[-2], image.shape[-1]))
        return (*_warp(image, mask, matrices, padding="zeros"), canvas)

    return transform


def _window(op: AugOp, _: torch.Generator) -> Geometric:
    """random_resized_crop and zoom_out: a window of each canvas resized to the output; the
    canvas becomes the window."""
    crop = op.name == "random_resized_crop"

    def transform(image: Tensor, mask: Tensor, canvas: np.ndarray) -> Warped:
        places = torch.rand(2, len(canvas), dtype=torch.float64).numpy()
        draws = [_uniform(op, key, len(canvas)) for key in OPS[op.name].params]
        windows = (crop_windows if crop else zoom_windows)(canvas, *draws, *places)
        matrices = _crop_matrices(windows, canvas, (image.shape[-2], image.shape[-1]))
        # a crop's "border": samples just past its edge clamp, as a resize of the crop does;
        # around a zoomed-out photo: 0, as the spec pads
        image, mask = _warp(image, mask, matrices, padding="border" if crop else "zeros")
        return image, mask, (windows[:, [3, 2]] - windows[:, [1, 0]]).astype(np.float64)

    return transform


def _levels(x: Tensor) -> Tensor:
    """Rounded to the nearest pixel level within 0..255, as after every colour op."""
    return x.round_().clamp_(0.0, 255.0)


def _colour_matrix(op: AugOp, _: torch.Generator) -> Photometric:
    def transform(image: Tensor) -> Tensor:
        k = len(image)
        draws = _uniform(op, next(iter(op.ranges)), k) if op.ranges else np.zeros(k)
        hue, saturation = np.array([colour_params(op.name, d) for d in draws]).T
        matrices = _to(colour_matrices(hue, saturation), image.device)
        return _levels(torch.einsum("kij,kjhw->kihw", matrices, image))

    return transform


def _jpeg(op: AugOp, _: torch.Generator) -> Photometric:
    lo, hi = (round(v) for v in op.ranges["quality"])

    def transform(image: Tensor) -> Tensor:
        quality = torch.randint(lo, hi + 1, (len(image),)).to(image.device, torch.float32)
        return _levels(255.0 * jpeg_codec_differentiable(image / 255.0, quality))

    return transform


def _gaussian_blur(op: AugOp, _: torch.Generator) -> Photometric:
    """Kornia's blur; its one window (DALI's for the largest sigma) cuts smaller sigmas later."""
    lo, hi = op.ranges["sigma"]
    return K.RandomGaussianBlur(blur_window(hi), (lo, hi), border_type="reflect", p=1.0)


def _per_sample(apply: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Photometric]:
    """An op `apply(images, values)` with one draw of its parameter per image (k x 1 x 1 x 1)."""

    def build(op: AugOp, _: torch.Generator) -> Photometric:
        def transform(image: Tensor) -> Tensor:
            values = _to(_uniform(op, next(iter(op.ranges)), len(image)), image.device)
            return apply(image, values.view(-1, 1, 1, 1))

        return transform

    return build


def _gaussian_noise(op: AugOp, noise: torch.Generator) -> Photometric:
    def add(x: Tensor, sigma: Tensor) -> Tensor:
        return x + sigma * torch.randn(x.shape, generator=noise, device=x.device, dtype=x.dtype)

    return _per_sample(add)(op, noise)


def _contrast(x: Tensor, factor: Tensor) -> Tensor:
    dims = (1, 2, 3)
    mean = x.mean(dims, keepdim=True)
    lo, hi = x.amin(dims, keepdim=True), x.amax(dims, keepdim=True)
    return torch.clamp(mean + (x - mean) * factor, lo, hi)


# each op of the spec (augment.OPS), built for a batch's rows that got it: geometric ones on images,
# masks and canvas sizes, the others on images (colour ops on their 0..255 levels)
_OPS: dict[str, Callable[[AugOp, torch.Generator], Callable]] = {
    "hflip": _flip,
    "vflip": _flip,
    "rotate": _rotate,
    "random_resized_crop": _window,
    "zoom_out": _window,
    "hue": _colour_matrix,
    "saturation": _colour_matrix,
    "grayscale": _colour_matrix,
    "gamma": _per_sample(lambda x, gamma: _levels(255.0 * (x / 255.0) ** gamma)),
    "jpeg": _jpeg,
    "gaussian_noise": _gaussian_noise,
    "gaussian_blur": _gaussian_blur,
    "brightness": _per_sample(torch.mul),
    "contrast": _per_sample(_contrast),
}


class KorniaAugment:
    """The spec on a batch of resized uint8 images on their device: every op tosses one coin per
    sample, and only the rows that got it are computed, as DALI's conditionals do."""

    def __init__(self, spec: AugSpec, canvas_sizes: np.ndarray, device: torch.device) -> None:
        self._canvas = canvas_sizes.astype(np.float64)  # per CSV row: height, width
        self._noise = torch.Generator(device)
        self._geometric, self._colour, self._photometric = (
            [(op, _OPS[op.name](op, self._noise)) for op in spec.stage(stage)]
            for stage in (GEOMETRIC, COLOUR, PHOTOMETRIC)
        )
        std = 255 * torch.tensor(spec.std, device=device).view(1, 3, 1, 1)
        self._scale = 1 / std  # normalising as x * scale + shift: one pass over the batch
        self._shift = -255 * torch.tensor(spec.mean, device=device).view(1, 3, 1, 1) / std

    def __call__(self, batch: Batch, rows: np.ndarray, seed: int) -> Batch:
        """Augment in place: the batch's tensors were made for this call (uint8 -> float)."""
        image, mask, canvas = batch["image"].float(), batch["mask"], self._canvas[rows]
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            self._noise.manual_seed(seed)
            for op, geometric in self._geometric:
                fired = _fired(op, len(image))
                if fired.size:
                    index = _to(fired, image.device)
                    part_image, part_mask, canvas[fired] = geometric(
                        image[index], mask[index], canvas[fired]
                    )
                    image.index_copy_(0, index, part_image)
                    mask.index_copy_(0, index, part_mask)
            self._apply(self._colour, image)
            image = torch.addcmul(self._shift, image, self._scale)
            self._apply(self._photometric, image)
        return {**batch, "image": image, "mask": mask}

    @staticmethod
    def _apply(ops: list[tuple[AugOp, Photometric]], image: Tensor) -> None:
        """Image-only ops in order, each on the rows that got it, in place."""
        for op, transform in ops:
            fired = _fired(op, len(image))
            if fired.size:
                index = _to(fired, image.device)
                image.index_copy_(0, index, transform(image[index]))


class KorniaLoader(TorchLoader):
    """`loader=kornia`: DataLoader workers read and resize; Kornia augments on the device."""

    def _transforms(
        self, spec: AugSpec, image_size: tuple[int, int]
    ) -> tuple[OpenCVTransform, BatchTransform | None]:
        plain = AugSpec(ops=(), mean=spec.mean, std=spec.std)
        read = OpenCVTransform(plain, image_size, normalise=False)
        return read, KorniaAugment(spec, self.records.sizes, self.device)
