"""A training job ends within seconds of SIGTERM or Ctrl-C, its DDP ranks included, also while a
rank waits in a collective that never completes. `ends_on_signal`, around each job:

* raises `Terminated`, a KeyboardInterrupt, for SIGTERM (Lightning's own handler only sets a flag
  read at the epoch's end), so Lightning ends the fit as on Ctrl-C;
* starts a watcher thread woken by Python's signal wake-up fd, which the C-level handler writes
  even while the main thread is blocked: a job still running `GRACE_S` later exits 128 + signal;
* has the kernel kill a DDP rank this job's process launched when that process exits.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from nailseg.lifetime import die_with_parent

GRACE_S = 10.0  # how long an interrupted job may take to end by itself (a graceful end included)
# the job's process, as its DDP ranks inherit it: a rank that finds another pid here was launched
LAUNCHER_ENV = "NAILSEG_JOB_PID"
_ENDING = (signal.SIGINT, signal.SIGTERM)
_STOP = b"\0"  # no signal has number 0: the watcher's own wake-up at the job's end


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be, so it is handled alike."""


def _terminate_once() -> Callable[[int, FrameType | None], None]:
    """A SIGTERM handler raising `Terminated` once: a repeat would break off the shutdown."""
    raised = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise Terminated(f"received {signal.Signals(signum).name}")

    return handler


def _watch(wakeups: socket.socket, ended: threading.Event) -> None:
    """Wait for an ending signal's byte; then give the job `GRACE_S` to end by itself."""
    while (byte := wakeups.recv(1)) != _STOP:
        if byte and byte[0] in _ENDING:
            if ended.wait(GRACE_S):
                return
            name = signal.Signals(byte[0]).name
            os.write(2, f"still running {GRACE_S:g} s after {name}: ending it now\n".encode())
            os._exit(128 + byte[0])


def _tie_to_launcher() -> None:
    """In a DDP rank launched by a job's process: die when that process exits."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None or int(launcher) == os.getpid():
        return
    die_with_parent()
    if os.getppid() != int(launcher):  # it exited before the kernel was told
        os._exit(1)


@contextmanager
def ends_on_signal() -> Iterator[None]:
    """Run a job that SIGTERM and Ctrl-C end within `GRACE_S` (see the module docstring). Signal
    handlers belong to the main thread: elsewhere this changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _tie_to_launcher()
    launcher = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    wakeups, wakeup_fd = socket.socketpair()
    wakeup_fd.setblocking(False)  # the C-level handler must never block
    previous_fd = signal.set_wakeup_fd(wakeup_fd.fileno(), warn_on_full_buffer=False)
    previous_term = signal.signal(signal.SIGTERM, _terminate_once())
    ended = threading.Event()
    watcher = threading.Thread(target=_watch, args=(wakeups, ended), daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.set_wakeup_fd(previous_fd)
        if launcher is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = launcher
        ended.set()
        wakeup_fd.send(_STOP)
        watcher.join()
        wakeups.close()
        wakeup_fd.close()
