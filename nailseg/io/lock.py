"""One writer at a time per output folder: the lock files prepare, predict and train.py hold
while they write.

A POSIX record lock (`lockf`): forked workers never inherit it and it dies with the process, so
`kill -9` leaves no stale lock. Closing any descriptor of the file drops it, so each lock has its
own file. A link where the lock file would be is refused, never followed.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

_POLL_S = 0.2  # how often a waiting process tries the lock again


@contextmanager
def locked(
    root: Path, name: str, command: str, key: str, error: type[Exception], wait_s: float = 0.0
) -> Iterator[None]:
    """Hold `root`'s lock file `name` (the folder made if missing), waiting up to `wait_s` for
    another process holding it (0: fail at once) and then raising `error`, which names the
    `command` writing there and the config `key` that chose the folder."""
    root.mkdir(parents=True, exist_ok=True)
    lock = root / name
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.EISDIR):
            raise
        raise error(
            f"{lock} is a symbolic link or a folder, not a lock file {command} made: it is "
            f"neither followed nor replaced; remove it, or choose another {key}"
        ) from None
    try:
        if not _try_lock(fd):
            held = f"another {command} is writing {root} (it holds {lock})"
            _wait_for_lock(fd, held, wait_s, f"choose another {key}", error)
        yield
    finally:
        os.close(fd)


def _wait_for_lock(
    fd: int, held: str, wait_s: float, alternative: str, error: type[Exception]
) -> None:
    """Try the lock until it is free, up to `wait_s`; then (at once when 0) fail saying `held`."""
    if not wait_s:
        raise error(f"{held}: wait for it to finish, or {alternative}")
    log.info("%s: waiting for it, up to %g s", held, wait_s)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)
        if _try_lock(fd):
            return
    raise error(
        f"{held} and has not finished after {wait_s:g} s: if it is stuck, stop it, then rerun"
    )


def _try_lock(fd: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        return False
    return True
