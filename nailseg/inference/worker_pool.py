"""predict's worker processes (they run workers.py), forked from multiprocessing's forkserver:
forking the command itself, which holds CUDA's state and threads, is unsafe."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from multiprocessing import forkserver

from nailseg.inference.request import PredictError
from nailseg.inference.workers import start_worker


@contextmanager
def worker_processes(count: int, preload: str) -> Iterator[tuple[ProcessPoolExecutor, float]]:
    """`count` started worker processes and the seconds their start took. The forkserver imports
    `preload` (the command's module, torch and all) once, so each worker starts as a copy of it;
    a worker that dies fails the run with a PredictError."""
    start = time.perf_counter()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_preloaded(preload))
    with ProcessPoolExecutor(count, mp_context=context, initializer=start_worker) as pool:
        try:
            with _ctrl_c_held():
                for started in [pool.submit(os.getpid) for _ in range(count)]:
                    started.result()
            yield pool, time.perf_counter() - start
        except BrokenProcessPool as err:
            raise PredictError(
                "a worker process reading or writing the files died (killed by the system or a "
                "signal: out of memory?), so the run stopped; its summary.json says unfinished, "
                "and a rerun into the same output folder replaces what it wrote"
            ) from err


def _preloaded(preload: str) -> list[str]:
    """server_start first (the server dies with this process), then the main module when run as a
    file ("__main__"), then `preload`. A main module run with `python -m` is imported by each
    worker itself: preloaded by name too, runpy would warn in every worker that it ran twice."""
    return ["nailseg.inference.server_start", "__main__", preload]


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Ctrl-C kept from the workers' start (in the main thread: only it sets handlers). The
    forkserver ignores Ctrl-C only once it has imported its preload, so it starts with Ctrl-C
    ignored, which it inherits; one pressed after is held until every worker has started, then
    raised: taken at once, it cut the start short and a half-made worker printed a traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if held:
        raise KeyboardInterrupt
