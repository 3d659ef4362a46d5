"""What runs the net: PyTorch on the device, channels-last (on a GPU, replayed as CUDA graphs), or
ONNX Runtime on the CPU."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
from torch import nn

from nailseg.inference.graphed import CaptureError, GraphedNet
from nailseg.inference.request import PredictError
from nailseg.inference.spec import InferenceSpec, Net, probabilities, to_batch


def build_engine(
    engine: str,
    net: nn.Module,
    spec: InferenceSpec,
    device: torch.device,
    cuda_graphs: bool,
    sizes: Sequence[tuple[int, int]] | None = None,
) -> Net:
    """`net` run by `engine`: torch on `device`, channels-last (the layout a GPU's tensor cores
    and the CPU's oneDNN run convolutions fastest in), as CUDA graphs on a GPU with
    `cuda_graphs`; or onnx, ONNX Runtime on the CPU, one model per input size in `sizes` (None:
    the input size; an ONNX model's height and width are fixed)."""
    if engine == "torch":
        net = net.to(device, memory_format=torch.channels_last)
        if device.type != "cuda":
            return net
        return GraphedNet(net) if cuda_graphs else net
    from nailseg.inference.export import ExportError, OnnxNet  # onnx: only this engine needs it

    try:
        models = {
            size: OnnxNet(net, dataclasses.replace(spec, image_size=size))
            for size in sizes or [spec.image_size]
        }
    except ExportError as err:
        raise PredictError(f"engine=onnx: {err}") from err
    return next(iter(models.values())) if len(models) == 1 else _BySize(models)


class _BySize:
    """ONNX models of one net at several input sizes, called as one: each batch by its size."""

    def __init__(self, models: dict[tuple[int, int], Net]) -> None:
        self.models = models

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        return self.models[(batch.shape[2], batch.shape[3])](batch)


def capture(
    net: GraphedNet,
    spec: InferenceSpec,
    batch_size: int,
    tta: bool,
    sizes: Sequence[tuple[int, int]] | None = None,
) -> float:
    """Capture the graph of a full batch at each input size in `sizes` (None: the input size)
    now, through the path predicting takes, so a net that cannot be captured fails before
    anything is written; returns the seconds it took."""
    start = time.perf_counter()
    device = next(net.net.parameters()).device
    blank = torch.zeros(3, *spec.image_size, dtype=torch.uint8, device=device)
    try:
        with torch.inference_mode():
            for size in sizes or [spec.image_size]:
                probabilities(net, to_batch([blank] * batch_size, spec, size), tta)
    except CaptureError as err:
        raise PredictError(f"{err}; cuda_graphs=false runs it eagerly") from err
    torch.cuda.synchronize(device)
    return time.perf_counter() - start
