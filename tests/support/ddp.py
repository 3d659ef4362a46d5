"""Run the real `train.py` in a subprocess (DDP ranks and sweeps), never leaving processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from support.train import small_overrides

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
# DDP needs every parameter in the loss; smp keeps unused encoder stages below encoder_depth 5
DDP_NET = [
    "model=unet",
    "model.encoder_name=tu-mobilenetv3_small_050",
    "+model.options.decoder_channels=[16,8,8,4,4]",
]


def ddp_overrides(root: Path, *extra: str, batch_size: int = 2) -> list[str]:
    """small_overrides with a net DDP accepts and the given batch size."""
    base = [
        o
        for o in small_overrides(root)
        if not o.lstrip("+").startswith("model") and not o.startswith("loader.batch_size")
    ]
    return [*base, *DDP_NET, f"loader.batch_size={batch_size}", *extra]


def run_train(*args: str, returncode: int = 0) -> str:
    """`python train.py *args`; must exit with `returncode` (succeed, by default). Returns its
    stderr. A hang (a DDP rank waiting for a peer) fails after TIMEOUT_S and kills the whole
    process group, DDP children included."""
    proc = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"train.py {' '.join(args)} hung for {TIMEOUT_S} s") from None
    assert proc.returncode == returncode, stderr[-4000:]
    return stderr


def job_dirs(sweep: Path) -> list[Path]:
    """A sweep's job dirs (named by job number), in job order."""
    return sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
