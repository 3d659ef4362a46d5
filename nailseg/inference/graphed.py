"""The net's forward pass replayed as a CUDA graph: one launch a batch instead of one per kernel,
each of which costs the host time the GPU waits for. A graph holds fixed addresses: each batch is
copied into the captured input, and the logits returned are a view of the captured output, valid
until the next call. Each input shape is captured once, at its batch size; a smaller batch is
padded (rows are independent in an eval-mode net).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class CaptureError(RuntimeError):
    """The net cannot be captured as a CUDA graph (host syncs, data-dependent shapes)."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor
    logits: torch.Tensor


class GraphedNet:
    """Calls `net` (eval mode, on a CUDA device) through CUDA graphs; see the module docstring.
    Call it where `net` would be called: under the same autocast, inside inference mode."""

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
        except RuntimeError as err:  # CUDA's message runs on with hints: its first line says it
            _release_generator(batch.device)
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CaptureError(f"the net cannot run as a CUDA graph: {reason}") from err
        return _Captured(graph, inputs, logits)


def _release_generator(device: torch.device) -> None:
    """A capture that fails ends before torch marks the device's random generator as no longer
    capturing, and every later random op on that device then fails ("Offset increment outside
    graph capture"): the generator gets a copy of its state (same seed and offset) that is not."""
    generator = torch.cuda.default_generators[device.index]
    generator.graphsafe_set_state(generator.clone_state())
