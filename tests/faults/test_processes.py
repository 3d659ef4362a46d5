"""A prepare or predict killed with `kill -9` leaves no process behind: its worker processes (and
predict's forkserver) end with it, though it runs no cleanup. Each command runs in a session of
its own, so every process it started is found by the session's id."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from support.image_files import box_mask, photo, save_image
from support.inference import make_run
from support.prepared import write_prepared
from support.processes import session_processes

ROOT = Path(__file__).resolve().parents[2]
START_S = 180  # for the command to start its workers (predict imports torch, twice)
GONE_S = 5  # for every process of the session to be gone after the kill


def _kill_and_check(args: list[str], started: Callable[[int], bool]) -> None:
    """Run `args` in a session of its own; once `started` holds for the command's pid (its session),
    `kill -9` the command alone, then every process of the session must be gone within GONE_S."""
    command = subprocess.Popen(
        args,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_S
        while not started(command.pid):
            assert command.poll() is None, command.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the workers were never seen"
            time.sleep(0.02)
        os.kill(command.pid, signal.SIGKILL)
        command.wait()
        deadline = time.monotonic() + GONE_S
        while (left := session_processes(command.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert left == {}, f"left behind: {left}"
    finally:
        for pid in session_processes(command.pid):
            os.kill(pid, signal.SIGKILL)
        command.wait()


def _workers(session: int) -> int:
    """How many processes of the session are the command's workers: not the command, not
    multiprocessing's resource tracker."""
    processes = session_processes(session)
    return sum(pid != session and "resource_tracker" not in line for pid, line in processes.items())


@pytest.mark.slow
def test_prepare_killed_leaves_no_worker(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    for i in range(300):
        save_image(raw / "Images" / "g" / f"s{i:03d}.png", photo(96, 128, seed=i))
        save_image(raw / "Masks" / "g" / f"s{i:03d}.png", box_mask(96, 128, box=10))
    args = [sys.executable, "prepare.py", f"input_dir={raw}", f"output_dir={out}"]
    args += ["num_workers=2", f"hydra.run.dir={tmp_path / 'run'}"]

    _kill_and_check(args, lambda session: _workers(session) == 2)


@pytest.mark.slow
def test_predict_killed_leaves_no_worker_nor_forkserver(tmp_path):
    ckpt = make_run(write_prepared(tmp_path / "prepared"), tmp_path / "train")
    for i in range(1500):
        save_image(tmp_path / "photos" / f"p{i:04d}.png", np.full((20, 24, 3), i % 256, np.uint8))
    out = tmp_path / "out"
    args = [sys.executable, "-m", "nailseg.predict", f"ckpt={ckpt}", f"input={tmp_path / 'photos'}"]
    args += [f"output={out}", "num_workers=2", "device=cpu", "batch_size=1"]

    _kill_and_check(args, lambda session: any(out.glob("masks/*.png")))  # the workers at work
