"""The project's commands (`python train.py ...`, `python -m nailseg ...`) run in this process as
the shell starts them: sys.argv, `__main__` and the working folder as a new process would have
them, without importing torch, Lightning and DALI again for each command. A test that kills the
command, signals it, runs DDP ranks or checks what a fresh process prints starts a process."""

from __future__ import annotations

import importlib.util
import os
import runpy
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from hydra.core.singleton import Singleton

# the schemas are in Hydra's store before any state is saved (a command run later restores it)
import nailseg.bench
import nailseg.compare
import nailseg.config  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
# the folders watched now, each with the files below it opened meanwhile (files_opened_below)
_WATCHES: list[tuple[str, set[str]]] = []
_open_hook_added = False


def quick_first(
    cases: Sequence[tuple], kind: Callable[[tuple], object] = lambda case: case[0][0]
) -> list:
    """`cases` as pytest params, each after the first of its `kind` (by default its command's first
    argument) marked slow: a case that starts a process costs about a second, so the inner loop
    (make test-quick) keeps one a kind and make test runs them all."""
    seen: set[object] = set()
    params = []
    for case in cases:
        params.append(pytest.param(*case, marks=[pytest.mark.slow] if kind(case) in seen else []))
        seen.add(kind(case))
    return params


def exit_status(done: SystemExit) -> int:
    """The status the interpreter exits with for `done`: a message's is 1 (the message goes to
    stderr, as the interpreter prints it)."""
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)
    return 1


def _print_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: object = None,
    line: str | None = None,
) -> None:
    """Python's own way to show a warning, to the stderr of the moment (the capture's)."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextmanager
def _warnings_as_in_a_new_process() -> Iterator[None]:
    """Warnings printed to stderr under the filters a new interpreter starts with (no -W, not a
    debug build), each once again, rather than recorded by pytest: a command's warnings are in
    its output, as they would be in a terminal."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                         ResourceWarning):  # fmt: skip
            warnings.filterwarnings("ignore", category=category, append=True)
        warnings.showwarning = _print_warning
        yield


def run_command(
    argv: Sequence[str], capture: pytest.CaptureFixture[str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python *argv` in this process, from `cwd` (the project root by default): a script path
    (relative to the project root) or `-m module`, then its arguments. Hydra's global state and
    the working folder are restored after it. Returns its exit status and what it printed, its
    warnings included (`capture`: capsys, or capfd for what worker processes print too)."""
    saved_argv, saved_cwd, state = sys.argv, Path.cwd(), Singleton.get_state()
    capture.readouterr()
    os.chdir(cwd or ROOT)
    try:
        with _warnings_as_in_a_new_process():
            if argv[0] == "-m":
                sys.argv = [argv[1], *argv[2:]]
                # as in a new process, the module is not imported before it runs as __main__
                spec = importlib.util.find_spec(argv[1])
                package = spec is not None and spec.submodule_search_locations is not None
                name = f"{argv[1]}.__main__" if package else argv[1]
                imported = sys.modules.pop(name, None)
                try:
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                finally:
                    if imported is not None:
                        sys.modules[name] = imported
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


def _record_open(event: str, args: tuple) -> None:
    if event == "open" and _WATCHES and isinstance(args[0], str | bytes | os.PathLike):
        path = os.path.abspath(os.fsdecode(args[0]))
        for folder, opened in _WATCHES:
            if path.startswith(folder):
                opened.add(path)


@contextmanager
def files_opened_below(folder: Path) -> Iterator[set[str]]:
    """The files below `folder` this process opens inside the block, through an audit hook (added
    once a process: Python has no way to remove one; it records nothing while no block runs)."""
    global _open_hook_added
    if not _open_hook_added:
        sys.addaudithook(_record_open)
        _open_hook_added = True
    watch = (str(folder), set())
    _WATCHES.append(watch)
    try:
        yield watch[1]
    finally:
        _WATCHES.remove(watch)
