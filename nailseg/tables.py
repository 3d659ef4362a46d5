"""Results tables on the console, whole wherever they go."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

WIDEST = 1000  # characters: the most a table may take when measured for a log


def print_table(table: Table, console: Console | None = None) -> None:
    """Print `table` with every column whole: off a terminal (a log, CI) rich assumes 80
    characters and cuts columns, so there the console gets the width the table needs."""
    console = console or Console()
    if not console.is_terminal:
        needed = console.measure(table, options=console.options.update_width(WIDEST)).maximum
        console.width = max(console.width, needed)
    console.print(table)
