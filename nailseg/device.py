"""The one reading of a device setting: `auto`, `cpu`, `gpu`, `cuda` or `cuda:N`."""

from __future__ import annotations

import torch

NAMES = ("auto", "cpu", "gpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """`auto`: the current CUDA device when torch sees one, else the CPU; `gpu` and `cuda`: the
    current CUDA device; `cuda:N` that one; `cpu` the CPU."""
    if name == "auto":
        name = "gpu" if torch.cuda.is_available() else "cpu"
    if name in ("gpu", "cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cpu" or name.startswith("cuda:"):
        return torch.device(name)
    raise ValueError(f"device={name!r}: use one of {', '.join(NAMES)} or cuda:N")
