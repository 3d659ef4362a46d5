"""A checkpoint loaded once and run as predict runs it: the card's input size and normalisation,
the threshold, scales, tiles and flips, the engine, on the GPU or the CPU. The Python API
(`nailseg.load`, predict.py) gives masks and probabilities of photos in memory, each at its own
size; predict's pipeline runs its batches through `maps`, the same preprocessing and merge.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig
from PIL import Image
from rich.console import Console

from nailseg.device import resolve_device
from nailseg.inference.engine import GraphedNet, build_engine, capture
from nailseg.inference.spec import InferenceSpec, PredictError, resolve_spec
from nailseg.inference.threshold import choose_threshold
from nailseg.inference.views import Views, image_tensors, input_sizes, photo_probabilities, views_of
from nailseg.model.checkpoint import load_net
from nailseg.prep.imageio import read_rgb

# a file (read as predict reads it: EXIF orientation applied), or a uint8 array or PIL image,
# taken as it is; a list or tuple of them gives a list back
Photo = str | os.PathLike | np.ndarray | Image.Image


def how_to_run(cfg: DictConfig) -> tuple[InferenceSpec, torch.device, Views]:
    """`cfg`'s checkpoint (its card, `cfg`'s overrides applied), device and views, checked; a
    PredictError or CheckpointError naming the first bad key."""
    if cfg.batch_size < 1:
        raise PredictError(f"batch_size={cfg.batch_size}: must be at least 1")
    device = _engine_device(cfg.engine, str(cfg.device))
    spec = resolve_spec(cfg)
    return spec, device, views_of(cfg, spec)


def _engine_device(engine: str, device: str) -> torch.device:
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


class Segmenter:
    """The net of `spec` on `device`, run by `cfg.engine` (a CUDA graph captured now, so a net
    that cannot be fails before any work), its threshold chosen as `cfg.threshold` asks."""

    def __init__(
        self,
        cfg: DictConfig,
        spec: InferenceSpec,
        device: torch.device,
        views: Views,
        console: Console | None = None,
    ) -> None:
        sizes, batch_size = input_sizes(views, spec), cfg.batch_size
        loaded = load_net(spec.ckpt, spec.model)
        self.net = build_engine(cfg.engine, loaded, spec, device, cfg.cuda_graphs, sizes)
        self.graphed = isinstance(self.net, GraphedNet)
        self.capture_seconds = (
            capture(self.net, spec, batch_size, views.tta, sizes) if self.graphed else 0.0
        )
        self.spec, self.device, self.views, self.batch_size = spec, device, views, batch_size
        self.threshold, self.threshold_source = choose_threshold(
            cfg, self, console or Console(stderr=True)
        )

    def maps(self, images: Sequence[torch.Tensor], tta: bool | None = None) -> list[torch.Tensor]:
        """One H×W probability map per RGB uint8 C×H×W photo on the device, at its size, in
        order; `tta` None: as loaded."""
        views = self.views if tta is None else replace(self.views, tta=tta)
        return photo_probabilities(self.net, images, self.spec, views, self.batch_size)

    def probabilities(
        self, photos: Photo | Sequence[Photo], tta: bool | None = None
    ) -> np.ndarray | list[np.ndarray]:
        """Each pixel's nail probability, float32 H×W in [0, 1], at the photo's size."""
        return self._run(photos, tta, None)

    def predict(
        self,
        photos: Photo | Sequence[Photo],
        tta: bool | None = None,
        threshold: float | None = None,
    ) -> np.ndarray | list[np.ndarray]:
        """The mask, uint8 H×W at the photo's size: 1 (nail) where the probability is above
        `threshold` (None: the loaded one), as predict writes it (there 255)."""
        return self._run(photos, tta, self.threshold if threshold is None else threshold)

    @torch.inference_mode()
    def _run(self, photos, tta: bool | None, threshold: float | None):
        """Photos `batch_size` at a time, as predict batches them: a list gives what predict
        writes for the same files in the same order."""
        many = isinstance(photos, list | tuple)
        arrays = [_rgb(photo) for photo in (photos if many else [photos])]
        out: list[np.ndarray] = []
        for start in range(0, len(arrays), self.batch_size):
            images = image_tensors(arrays[start : start + self.batch_size], self.device)
            for prob in self.maps(images, tta):
                kept = prob if threshold is None else (prob > threshold).to(torch.uint8)
                out.append(kept.cpu().numpy())
        return out if many else out[0]


def _rgb(photo: Photo) -> np.ndarray:
    """RGB uint8 H×W×3: a file decoded by predict's decoder, an array or PIL image converted as
    PIL converts (grey repeated, alpha dropped; a shape PIL cannot take is a TypeError)."""
    if isinstance(photo, str | os.PathLike):
        return read_rgb(Path(photo))
    if isinstance(photo, np.ndarray):
        if photo.dtype != np.uint8:  # PIL would clip a float photo in [0, 1] to black
            raise TypeError(f"a photo array must be uint8 (RGB, grey or RGBA), not {photo.dtype}")
        photo = Image.fromarray(photo)
    if isinstance(photo, Image.Image):
        return np.asarray(photo.convert("RGB"))
    raise TypeError(f"a photo is a path, a uint8 array or a PIL image, not {type(photo).__name__}")
