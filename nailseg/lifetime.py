"""Worker processes that end with their parent, even one killed with `kill -9`: an idle pool
worker holds both ends of its task pipe and would otherwise wait forever.

On Linux a worker arms prctl(PR_SET_PDEATHSIG) first thing (`die_with_parent`, a pool's
initializer); a parent that died before that is caught by comparing os.getppid() with the process
that forked the worker, noted before every fork. Elsewhere nothing is armed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# the process that forked this one: noted before every fork; as imported, the parent then
_forked_by = os.getppid()


def _note_forker() -> None:
    global _forked_by
    _forked_by = os.getpid()


os.register_at_fork(before=_note_forker)


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel kill this process when its parent exits; if the parent is gone already,
    die now. `parent`: the pid it must have, when the caller knows it (a spawned process, which
    shares no memory with it, must be told); else the process that forked this one. Raises
    OSError when the kernel refuses."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != (_forked_by if parent is None else parent):  # reparented: it died first
        os.kill(os.getpid(), signal.SIGKILL)
