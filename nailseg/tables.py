"""Results tables on the console, whole wherever they go."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

WIDEST = 1000  # characters: the most a table may take when measured for a log


def print_table(table: Table, console: Console | None = None) -> None:
    """Print `table` with every column whole. Piped into a log or CI output (not a terminal),
    rich assumes 80 characters and cut the columns to fit ("photos_per_s" became "p…", every
    value of bench_predict's table too); there the console gets the width the table needs."""
    console = console or Console()
    if not console.is_terminal:
        needed = console.measure(table, options=console.options.update_width(WIDEST)).maximum
        console.width = max(console.width, needed)
    console.print(table)
