"""Tensors copied to the host in one copy, without waiting for device work queued after it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


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


def to_host(
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
