"""What runs the net: PyTorch on the device, channels-last (on a GPU, replayed as CUDA graphs), or
ONNX Runtime on the CPU."""

from __future__ import annotations

import time

import torch
from torch import nn

from nailseg.inference.graphed import CaptureError, GraphedNet
from nailseg.inference.request import PredictError
from nailseg.inference.spec import InferenceSpec, Net, probabilities, to_batch


def build_engine(
    engine: str, net: nn.Module, spec: InferenceSpec, device: torch.device, cuda_graphs: bool
) -> Net:
    """`net` run by `engine`: torch on `device`, channels-last (the layout a GPU's tensor cores
    and the CPU's oneDNN run convolutions fastest in), as CUDA graphs on a GPU with
    `cuda_graphs`; or onnx, ONNX Runtime on the CPU."""
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


def capture(net: GraphedNet, spec: InferenceSpec, batch_size: int, tta: bool) -> float:
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
