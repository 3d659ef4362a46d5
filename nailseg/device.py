"""The one reading of a device setting: `auto`, `cpu`, `gpu`, `cuda` or `cuda:N`."""

from __future__ import annotations

import torch

NAMES = ("auto", "cpu", "gpu", "cuda")


def check_name(name: str) -> None:
    """Raise ValueError unless `name` is a device setting (whether it exists here aside)."""
    if name not in NAMES and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise ValueError(f"device={name!r}: use one of {', '.join(NAMES)} or cuda:N")


def resolve_device(name: str) -> torch.device:
    """`auto`: the current CUDA device when torch sees one, else the CPU; `gpu` and `cuda`: the
    current CUDA device; `cuda:N` that one; `cpu` the CPU. A CUDA device torch does not see is
    refused here, naming the setting, not at the first tensor moved there."""
    if name == "auto":
        name = "gpu" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device(name)
    check_name(name)
    if not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: torch sees no CUDA device here; use auto or cpu")
    if name in ("gpu", "cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    index, count = name.removeprefix("cuda:"), torch.cuda.device_count()
    if int(index) >= count:
        raise ValueError(
            f"device={name!r}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", int(index))
