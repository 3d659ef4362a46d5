"""The project's commands (`python train.py ...`, `python -m nailseg ...`) run in this process as
the shell starts them: sys.argv, `__main__` and the working folder as a new process would have
them, without importing torch, Lightning and DALI again for each command. A test that kills the
command, signals it, runs DDP ranks or checks what a fresh process prints starts a process."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hydra.core.singleton import Singleton

import nailseg.config  # noqa: F401  (its schemas are in Hydra's store before any state is saved)

ROOT = Path(__file__).resolve().parents[2]


def exit_status(done: SystemExit) -> int:
    """The status the interpreter exits with for `done`: a message's is 1 (the message goes to
    stderr, as the interpreter prints it)."""
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)
    return 1


def run_command(
    argv: Sequence[str], capture: pytest.CaptureFixture[str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python *argv` in this process, from `cwd` (the project root by default): a script path
    (relative to the project root) or `-m module`, then its arguments. Hydra's global state and
    the working folder are restored after it. Returns its exit status and what it printed
    (`capture`: capsys, or capfd for what worker processes print too)."""
    saved_argv, saved_cwd, state = sys.argv, Path.cwd(), Singleton.get_state()
    capture.readouterr()
    os.chdir(cwd or ROOT)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [str(ROOT / argv[0]), *argv[1:]]
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
        code = 0
    except SystemExit as done:
        code = exit_status(done)
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        Singleton.set_state(state)
    printed = capture.readouterr()
    return subprocess.CompletedProcess(list(argv), code, printed.out, printed.err)
