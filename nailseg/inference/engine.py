"""What runs the net: PyTorch, channels-last (on a GPU replayed as CUDA graphs: one launch a batch,
each input shape captured once, a smaller batch padded, the logits a view valid until the next
call), or ONNX Runtime on the CPU from a model made in memory by torch's TorchScript exporter,
checked against PyTorch within `TOLERANCE` of the logits' size.
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
import warnings
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from nailseg.inference.request import ExportError, PredictError
from nailseg.inference.views import InferenceSpec, Net, probabilities, to_batch

INPUT_NAME, OUTPUT_NAME = "image", "logits"
TOLERANCE = 1e-3  # max |onnx - torch| on logits / max(1, max |logit|)
VERIFY_BATCH_SIZES = (1, 3)


def build_engine(
    engine: str,
    net: nn.Module,
    spec: InferenceSpec,
    device: torch.device,
    cuda_graphs: bool,
    sizes: Sequence[tuple[int, int]] | None = None,
) -> Net:
    """`net` run by torch on `device` (channels-last; graphed on a GPU) or by ONNX Runtime."""
    if engine == "torch":
        net = net.to(device, memory_format=torch.channels_last)
        return GraphedNet(net) if cuda_graphs and device.type == "cuda" else net
    try:
        return OnnxNet(net, spec, sizes or [spec.image_size])
    except ExportError as err:
        raise PredictError(f"engine=onnx: {err}") from err


def capture(
    net: GraphedNet,
    spec: InferenceSpec,
    batch_size: int,
    tta: bool,
    sizes: Sequence[tuple[int, int]] | None = None,
) -> float:
    """Capture a full batch's graph at each size in `sizes` (None: the input size) now, so a net
    that cannot be captured fails (PredictError) before any write; returns the seconds it took."""
    start = time.perf_counter()
    device = next(net.net.parameters()).device
    blank = torch.zeros(3, *spec.image_size, dtype=torch.uint8, device=device)
    with torch.inference_mode():
        for size in sizes or [spec.image_size]:
            probabilities(net, to_batch([blank] * batch_size, spec, size), tta)
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor
    logits: torch.Tensor


class GraphedNet:
    """Calls `net` (eval mode, on a CUDA device, under autocast, in inference mode) as graphs."""

    def __init__(self, net: nn.Module, warmup: int = 3) -> None:
        self.net = net.eval()
        self.warmup = warmup  # eager passes before capturing: cuDNN autotuning, allocations
        self.captured: dict[torch.Size, _Captured] = {}

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        n, shape = len(batch), batch.shape[1:]
        with torch.cuda.device(batch.device):  # graphs run on the current device's stream
            captured = self.captured.get(shape)
            if captured is None or len(captured.inputs) < n:
                captured = self.captured[shape] = self._capture(batch)
            captured.inputs[:n].copy_(batch)
            captured.graph.replay()
        return captured.logits[:n]

    def _capture(self, batch: torch.Tensor) -> _Captured:
        inputs = batch.clone()  # keeps the batch's memory format (channels-last)
        # autocast's cache of cast weights lives outside the graph's memory and is freed when
        # the autocast region ends: capture with it off, so the casts are part of the graph
        autocast = torch.autocast(
            "cuda",
            dtype=torch.get_autocast_dtype("cuda"),
            enabled=torch.is_autocast_enabled("cuda"),
            cache_enabled=False,
        )
        side = torch.cuda.Stream(batch.device)
        side.wait_stream(torch.cuda.current_stream(batch.device))
        graph = torch.cuda.CUDAGraph()
        try:
            with autocast, torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.net(inputs)
            torch.cuda.current_stream(batch.device).wait_stream(side)
            with autocast, torch.cuda.graph(graph):
                logits = self.net(inputs)
        except RuntimeError as err:  # host syncs, data-dependent shapes
            # a failed capture leaves the device's random generator marked as capturing (every
            # later random op fails): it gets a copy of its state (seed, offset) that is not
            generator = torch.cuda.default_generators[batch.device.index]
            generator.graphsafe_set_state(generator.clone_state())
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise PredictError(
                f"the net cannot run as a CUDA graph: {reason}; cuda_graphs=false runs it eagerly"
            ) from err
        return _Captured(graph, inputs, logits)


def onnx_model(net: nn.Module, spec: InferenceSpec, *, opset: int | None) -> bytes:
    """`net` as a checked ONNX model with nailseg's metadata; `opset` None: the exporter's own."""
    import onnx

    buffer = io.BytesIO()
    example = torch.zeros(2, 3, *spec.image_size)
    with torch.inference_mode():
        out_shape = net.eval()(example).shape
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        try:
            torch.onnx.export(
                net,
                (example,),
                buffer,
                dynamo=False,
                opset_version=opset,
                input_names=[INPUT_NAME],
                output_names=[OUTPUT_NAME],
                dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
            )
        except (torch.onnx.OnnxExporterError, RuntimeError) as err:  # an opset it lacks, an op
            reason = str(err).splitlines()[0]
            raise ExportError(
                f"the ONNX exporter cannot write this net at opset={opset}: {reason}"
            ) from err
    model = onnx.load_from_string(buffer.getvalue())
    # the output's shape as the net gives it, where the exporter's own inference gets a UNet's wrong
    shape = model.graph.output[0].type.tensor_type.shape
    del shape.dim[:]
    shape.dim.add().dim_param = "batch"
    for size in out_shape[1:]:
        shape.dim.add().dim_value = int(size)
    h, w = spec.image_size
    metadata = {
        "input": f"{INPUT_NAME}: float32 Bx3x{h}x{w}, RGB (x/255 - mean) / std",
        "output": f"{OUTPUT_NAME}: float32 Bx1xHxW, foreground logits",
        "image_size": json.dumps([h, w]),
        "mean": json.dumps(list(spec.mean)),
        "std": json.dumps(list(spec.std)),
        "inference.threshold": json.dumps(spec.threshold),
        "model": json.dumps(dict(spec.model)),
        "checkpoint": spec.ckpt.name,
    }
    onnx.helper.set_model_props(model, {f"nailseg.{k}": v for k, v in metadata.items()})
    onnx.checker.check_model(model)
    return model.SerializeToString()


def checked_difference(model: bytes, net: nn.Module, spec: InferenceSpec) -> float:
    """`logits_difference` of `model` against `net`; ExportError when beyond `TOLERANCE`."""
    if (diff := logits_difference(model, net, spec.image_size)) > TOLERANCE:
        raise ExportError(
            f"ONNX Runtime and PyTorch disagree on {spec.ckpt}: max |logits difference| / "
            f"max(1, max |logit|) = {diff:.3g} > {TOLERANCE}"
        )
    return diff


class OnnxNet:
    """A net run by ONNX Runtime on the CPU, called as the PyTorch net is: a model per size (fixed
    in ONNX), each checked as `export` checks it; `difference`: the largest `logits_difference`."""

    def __init__(self, net: nn.Module, spec: InferenceSpec, sizes: Sequence[tuple[int, int]]):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # as many as PyTorch would use
        self.sessions, self.difference = {}, 0.0
        for size in sizes:
            sized = dataclasses.replace(spec, image_size=size)
            model = onnx_model(net, sized, opset=None)
            self.difference = max(self.difference, checked_difference(model, net, sized))
            self.sessions[size] = ort.InferenceSession(
                model, options, providers=["CPUExecutionProvider"]
            )

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        session = self.sessions[(batch.shape[2], batch.shape[3])]
        (logits,) = session.run([OUTPUT_NAME], {INPUT_NAME: batch.contiguous().numpy()})
        return torch.from_numpy(logits)


def logits_difference(
    model: bytes,
    net: nn.Module,
    image_size: tuple[int, int],
    batch_sizes: tuple[int, ...] = VERIFY_BATCH_SIZES,
) -> float:
    """Max |ONNX Runtime - PyTorch| over the logits of random batches of each size, divided by
    max(1, max |PyTorch logit|): absolute for logits up to 1, relative beyond."""
    import onnxruntime as ort

    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    generator, diffs = torch.Generator().manual_seed(0), []
    for n in batch_sizes:
        batch = torch.randn(n, 3, *image_size, generator=generator)
        with torch.inference_mode():
            expected = net(batch).numpy()
        (got,) = session.run([OUTPUT_NAME], {INPUT_NAME: batch.numpy()})
        if got.shape != expected.shape:
            raise ExportError(f"ONNX output {got.shape} for a batch of {n}, not {expected.shape}")
        diffs.append(float(np.abs(got - expected).max()) / max(1.0, float(np.abs(expected).max())))
    return max(diffs)
