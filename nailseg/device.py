"""The one reading of a device setting (`auto`, `cpu`, `gpu`, `cuda`, `cuda:N`) and the one choice
`auto` makes, for the trainer and the loaders alike. torch is imported inside the functions: every
entry point imports this module (through `nailseg.config`) before anything heavy.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NAMES = ("auto", "cpu", "gpu", "cuda")
GPU_NAMES = ("gpu", "cuda")  # Lightning's accelerator names for a CUDA device


def check_name(name: str) -> None:
    """Raise ValueError unless `name` is a device setting (whether it exists here aside)."""
    if name not in NAMES and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise ValueError(f"device={name!r}: use one of {', '.join(NAMES)} or cuda:N")


def gpu_count() -> int:
    """The CUDA devices this process sees, asked of the driver without importing torch (0 without
    a driver), so a command refuses a GPU it lacks before the seconds torch takes."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    found = driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0
    return count.value if found else 0


def available(name: str) -> str:
    """Where the device setting `name` runs, "cuda" or "cpu", checked without torch; ValueError
    for a CUDA device this machine lacks."""
    check_name(name)
    if name == "cpu":
        return "cpu"
    count = gpu_count()
    if name == "auto":
        return "cuda" if count else "cpu"
    if count <= (int(name[5:]) if name.startswith("cuda:") else 0):
        seen = f"{count} CUDA device(s), cuda:0 to cuda:{count - 1}" if count else "no CUDA device"
        raise ValueError(f"device={name!r}: this machine has {seen}; use auto or cpu")
    return "cuda"


def auto_accelerator(cuda: bool | None = None) -> str:
    """What `auto` picks: `gpu` when CUDA is available (`cuda`; None asks torch), else `cpu`.
    One GPU, torch's current one: several train only when asked (trainer=ddp)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return "gpu" if cuda else "cpu"


def auto_precision(accelerator: str, bf16: bool | None = None) -> str:
    """`trainer=auto`'s precision on `accelerator`: bf16 autocast on a GPU with bf16 in hardware
    (`bf16`; None asks torch), fp16 autocast with loss scaling on an older GPU, where bf16 is
    only emulated, and full precision on the CPU."""
    if accelerator not in GPU_NAMES:
        return "32-true"
    if bf16 is None:
        import torch

        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    return "bf16-mixed" if bf16 else "16-mixed"


def resolve_device(name: str) -> torch.device:
    """`auto`: `auto_accelerator`'s choice; `gpu` and `cuda`: the current CUDA device; `cuda:N`
    that one; `cpu` the CPU. A CUDA device torch does not see is refused here, naming the
    setting, not at the first tensor moved there."""
    import torch

    if name == "auto":
        name = auto_accelerator()
    if name == "cpu":
        return torch.device(name)
    check_name(name)
    if not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: torch sees no CUDA device here; use auto or cpu")
    if name in GPU_NAMES:
        return torch.device("cuda", torch.cuda.current_device())
    index, count = name.removeprefix("cuda:"), torch.cuda.device_count()
    if int(index) >= count:
        raise ValueError(
            f"device={name!r}: torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", int(index))
