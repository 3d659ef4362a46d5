"""predict's progress bar, and where its main thread's time goes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

# where the main thread waits: for photos to be read, queueing the device's work (decode, resize,
# net, full-size maps, thresholds, copies to the host), for the masks to come back from the
# device, for the writing processes (`PredictSummary.stages`; bench_predict's columns)
STAGES = ("read_wait", "device_queue", "device_wait", "write_wait")


class _RateColumn(ProgressColumn):
    """Photos done per second since the bar started (Rich's own speed column measures from the
    first update, so chunks finished in a burst read as a far higher rate)."""

    def render(self, task: Task) -> Text:
        elapsed = task.finished_time if task.finished else task.elapsed
        if not elapsed or not task.completed:
            return Text("… img/s", style="progress.data.speed")
        return Text(f"{task.completed / elapsed:.1f} img/s", style="progress.data.speed")


@contextmanager
def progress_bar(console: Console, total: int) -> Iterator[Callable[[int], None]]:
    """A bar of `total` photos; yields what moves it on by a number of photos."""
    columns = (
        TextColumn("predicting"),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console) as progress:
        yield partial(progress.advance, progress.add_task("predicting", total=total))


class Stopwatch:
    """Seconds spent per named stage."""

    def __init__(self, *names: str) -> None:
        self.seconds = dict.fromkeys(names, 0.0)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
