"""A long step's progress wherever the console goes: a bar on a terminal; off one (a pipe, a log
file, SLURM), where a bar shows nothing until it ends, a line when the step starts, one at most
every `every_s` seconds, and one when it ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import Progress

EVERY_S = 10.0  # seconds between two lines off a terminal


@contextmanager
def progress(
    description: str, total: int, console: Console | None = None, every_s: float = EVERY_S
) -> Iterator[Callable[[int], None]]:
    """Yields what moves the step on by a number of items (of `total`)."""
    console = console or Console()
    if console.is_terminal:
        with Progress(console=console) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)
        return
    start = last = time.monotonic()
    done, shown = 0, -1

    def line(now: float) -> None:
        nonlocal shown
        shown = done
        console.print(
            f"{description}: {done}/{total} ({done / max(total, 1):.0%}), {now - start:.0f} s",
            markup=False,
            highlight=False,
        )

    def advance(n: int = 1) -> None:
        nonlocal done, last
        done += n
        if (now := time.monotonic()) - last >= every_s:
            line(now)
            last = now

    line(start)
    yield advance
    if shown != done:
        line(time.monotonic())
