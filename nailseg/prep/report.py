"""What a prepare run did, counted as it goes, and the table printed at its end."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from nailseg.prep.format import EXCLUDED_FILE
from nailseg.prep.layout import EXCLUSION_KINDS, Exclusion
from nailseg.tables import print_table

if TYPE_CHECKING:
    from nailseg.prep.convert import Outcome


@dataclass
class Summary:
    """Counts for the final table; `excluded` lists every file left out."""

    written: int = 0
    up_to_date: int = 0
    excluded: list[Exclusion] = field(default_factory=list)
    nonbinary_masks: int = 0
    max_distinct_values: int = 0
    rescaled: Counter[int] = field(default_factory=Counter)  # source bit depth -> images
    kept_gone: int = 0  # pairs gone from the input whose outputs stay on disk
    users_files: list[Path] = field(default_factory=list)  # listed outputs a user changed: kept
    pruned: int = 0  # pairs gone from the input whose outputs were deleted (prune=true)
    split_sizes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, outcome: Outcome) -> None:
        if outcome.nonbinary_values:
            self.nonbinary_masks += 1
            self.max_distinct_values = max(self.max_distinct_values, outcome.nonbinary_values)
        if outcome.image_bits != 8:
            self.rescaled[outcome.image_bits] += 1
        if outcome.record is not None:
            self.written += 1
        else:
            self.excluded.append(outcome.exclusion)


def print_summary(summary: Summary, console: Console | None = None, max_listed: int = 50) -> None:
    """The end-of-run table: what was written, what was left out and why."""
    console = console or Console()
    table = Table(title="prepare summary", show_header=False)
    table.add_row("pairs written", str(summary.written))
    table.add_row("pairs up to date (skipped)", str(summary.up_to_date))
    for split, n in summary.split_sizes.items():
        table.add_row(f"{split}.csv rows", str(n))
    reasons = Counter(e.kind for e in summary.excluded)
    for kind in EXCLUSION_KINDS:
        if reasons[kind]:
            table.add_row(f"excluded: {kind}", str(reasons[kind]))
    depths = ", ".join(f"{n} from {bits}-bit" for bits, n in sorted(summary.rescaled.items()))
    nonbinary = f"{summary.nonbinary_masks} (up to {summary.max_distinct_values} distinct values)"
    shown_when_any = {
        "masks not binary (binarised)": summary.nonbinary_masks and nonbinary,
        "images rescaled to 8 bits": depths,
        "pairs gone from the input, outputs kept (prune=true deletes)": summary.kept_gone,
        "pairs gone from the input, outputs deleted (prune)": summary.pruned,
        "outputs changed since prepare wrote them (yours: kept)": len(summary.users_files),
    }
    for label, value in shown_when_any.items():
        if value:
            table.add_row(label, str(value))
    table.add_row("seconds", f"{summary.seconds:.2f}")
    print_table(table, console)
    for path in summary.users_files[:max_listed]:
        console.print(
            f"  kept, not prepare's any more: {path}", markup=False, highlight=False, soft_wrap=True
        )
    for exclusion in summary.excluded[:max_listed]:
        console.print(f"  excluded {exclusion}", markup=False, highlight=False)
    if len(summary.excluded) > max_listed:
        console.print(f"  ... {len(summary.excluded) - max_listed} more in {EXCLUDED_FILE}")
