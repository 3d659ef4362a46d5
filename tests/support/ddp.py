"""Run the real `train.py` in a subprocess (DDP ranks and sweeps), never leaving processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import lightning as L
import torch

from support.train import small_overrides

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
# DDP needs every parameter in the loss; smp keeps unused encoder stages below encoder_depth 5
DDP_NET = [
    "model=unet",
    "model.encoder_name=tu-mobilenetv3_small_050",
    "+model.options.decoder_channels=[16,8,8,4,4]",
]
# what small_overrides sets that a DDP test leaves at the defaults: the progress bar on
_NOT_DEFAULT = (
    "model",
    "loader.batch_size",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "~callbacks.progress_bar",
)


def ddp_overrides(root: Path, *extra: str, batch_size: int = 2) -> list[str]:
    """small_overrides with a net DDP accepts, the given batch size and the default callbacks
    (the progress bar included: its hooks are where rank 0 alone once ran collectives)."""
    base = [o for o in small_overrides(root) if not o.lstrip("+").startswith(_NOT_DEFAULT)]
    return [*base, *DDP_NET, f"loader.batch_size={batch_size}", *extra]


def start_train(*args: str, output: IO[str] | None = None) -> subprocess.Popen:
    """`python train.py *args` in a session of its own (its pid is the session's id), with tests/
    importable (a config may name a callback from `support`); stdout and stderr are captured, or
    both written to `output`."""
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        stdout=output or subprocess.PIPE,
        stderr=subprocess.STDOUT if output else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_train(*args: str, returncode: int = 0) -> str:
    """`python train.py *args`; must exit with `returncode` (succeed, by default). Returns its
    stderr."""
    return finish(start_train(*args), returncode)[1]


def finish(proc: subprocess.Popen, returncode: int = 0) -> tuple[str, str]:
    """Wait for a `start_train` process, which must exit with `returncode`; its stdout and
    stderr. A hang (a DDP rank waiting for a peer) fails after TIMEOUT_S and kills the whole
    session, DDP children included."""
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{' '.join(proc.args)} hung for {TIMEOUT_S} s") from None
    assert proc.returncode == returncode, stderr[-4000:]
    return stdout, stderr


class Deadlock(L.Callback):
    """At the first training batch each rank writes `<dirpath>/rank<R>.pid` and then waits to
    receive from the other, which waits alike: both block inside torch.distributed for good
    (`+callbacks.deadlock._target_=support.ddp.Deadlock`), as ranks whose collectives differ do,
    where no Python signal handler runs."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int
    ) -> None:
        rank = trainer.global_rank
        (self.dirpath / f"rank{rank}.pid").write_text(str(os.getpid()))
        torch.distributed.recv(torch.zeros(1), src=1 - rank)


def job_dirs(sweep: Path) -> list[Path]:
    """A sweep's job dirs (named by job number), in job order."""
    return sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))


def processes_naming(marker: str) -> list[int]:
    """The live processes whose command line holds `marker` (a test's own folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # ended meanwhile
            continue
    return pids


def processes_left(marker: str, grace_s: float = 30.0) -> list[int]:
    """The processes naming `marker` that are still running `grace_s` after the command that
    started them ended (a DDP rank re-running the sweep outlives it); killed, and returned."""
    deadline = time.monotonic() + grace_s
    while (left := processes_naming(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


class FailOnRank(L.Callback):
    """Rank `rank` fails at its first training batch, as a rank out of memory or data would
    (`+callbacks.fail._target_=support.ddp.FailOnRank`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, batch_idx: int
    ) -> None:
        if trainer.global_rank == self.rank:
            raise RuntimeError(f"rank {self.rank}'s own error")
