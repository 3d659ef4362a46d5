"""Checkpoints under faults: a broken last.ckpt is skipped (and said so), and a `kill -9` in the
middle of a checkpoint save leaves the previous checkpoint whole, so the run resumes.
docs/FAULTS.md lists the cases."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.cli import run_command
from support.ddp import TIMEOUT_S
from support.train import small_overrides, train

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # trains in subprocesses, one of them killed

# train.py with `os.open` hooked (atomic writes create their temporary file with it): the second
# time a file named like last.ckpt is created (the second epoch's save), the process kills itself
# with SIGKILL, mid-save
KILL_IN_SECOND_SAVE = """
import os, runpy, signal, sys
real_open, saves = os.open, []
def open_and_maybe_die(path, flags, *args, **kwargs):
    fd = real_open(path, flags, *args, **kwargs)
    if flags & os.O_CREAT and "last.ckpt" in os.fspath(path):
        saves.append(path)
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
    return fd
os.open = open_and_maybe_die
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_last_skips_a_broken_checkpoint_and_says_so(prepared, tmp_path, caplog):
    runs = tmp_path / "runs"
    # a constant LR: a fit without a sized schedule may be extended on resume
    once = ("trainer.max_epochs=1", "logger=none", "test=false", "scheduler=none")
    train(prepared, runs / "a", *once)
    train(prepared, runs / "b", *once)
    broken = runs / "b" / "checkpoints" / "last.ckpt"
    broken.write_bytes(broken.read_bytes()[:1000])  # the newest, truncated as by a crash
    with caplog.at_level(logging.WARNING, logger="nailseg.training.resume"):
        train(prepared, runs / "c", "trainer.max_epochs=2", *once[1:], "ckpt_path=last")
    assert any(str(broken) in r.getMessage() for r in caplog.records)
    metrics = json.loads((runs / "a" / "metrics.json").read_text())  # continued run a
    assert metrics["resumed_from"] == str(runs / "a" / "checkpoints" / "last.ckpt")
    assert metrics["epochs"] == 2


def test_kill_during_a_checkpoint_save_then_resume(prepared, tmp_path):
    runs = tmp_path / "runs"
    args = small_overrides(prepared, "trainer.max_epochs=3", "logger=none", "test=false")
    env = {**os.environ, "TMPDIR": "/dev/shm" if Path("/dev/shm").is_dir() else str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", KILL_IN_SECOND_SAVE, *args, f"hydra.run.dir={runs / 'first'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    checkpoints = runs / "first" / "checkpoints"
    last = torch.load(checkpoints / "last.ckpt", weights_only=True)  # whole: epoch 0's
    assert (last["epoch"], last["global_step"]) == (0, 3)
    assert list(checkpoints.glob(".last.ckpt.*.tmp"))  # the save died in its own folder

    # resumed in this process: the subprocess above is what was killed
    train(prepared, runs / "second", "trainer.max_epochs=3", "logger=none", "test=false", "ckpt_path=last")  # fmt: skip
    metrics = json.loads((runs / "first" / "metrics.json").read_text())
    assert metrics["epochs"] == 3 and metrics["global_step"] == 9
    assert metrics["resumed_from"] == str(checkpoints / "last.ckpt")
    # here epoch 1 set a new best: saved, the old best removed, then the kill at last.ckpt; the
    # best that epoch 0's last.ckpt names is gone, so the resumed fit chooses its best anew
    assert Path(metrics["best"]["checkpoint"]).is_file()


def _weights_only(checkpoint: dict) -> None:
    for key in ("optimizer_states", "lr_schedulers", "loops", "callbacks"):
        del checkpoint[key]


def _damaged_loops(checkpoint: dict) -> None:
    checkpoint["loops"] = "damaged"


@pytest.mark.parametrize("damage", [_weights_only, _damaged_loops], ids=["weights-only", "loops"])  # fmt: skip
def test_a_checkpoint_a_fit_cannot_resume_from_is_refused_in_one_line(damage, prepared, tmp_path, capsys):  # fmt: skip
    """Lightning failed deep inside the fit with a trace (KeyError: 'Trying to restore optimizer
    state but checkpoint contains only the model', a TypeError on damaged loops)."""
    train(prepared, tmp_path / "a", "trainer.max_epochs=1", "logger=none", "test=false")
    checkpoint = torch.load(tmp_path / "a" / "checkpoints" / "last.ckpt", weights_only=True)
    damage(checkpoint)
    torch.save(checkpoint, tmp_path / "damaged.ckpt")
    args = small_overrides(prepared, "trainer.max_epochs=2", "logger=none", "test=false")
    done = run_command(["train.py", *args, f"ckpt_path={tmp_path / 'damaged.ckpt'}", f"hydra.run.dir={tmp_path / 'b'}"], capsys)  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"train.py: CheckpointError: {tmp_path / 'damaged.ckpt'}: ")
    )
