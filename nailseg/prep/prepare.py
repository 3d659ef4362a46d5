"""Turn a folder of photos and masks into training data: `.npy` arrays, `excluded.csv`,
`manifest.csv` and, last, the split CSVs (names in `nailseg.prep.format`), and the run's report.

The root is nailseg's folder of kind `prepare` (`nailseg.io.folder`), claimed for the whole run:
its lock keeps out a second prepare, `make clean` and a training reading it. Every file goes
through the folder, a user's never replaced; outputs of pairs gone from the input stay unless
`prune`. A rerun converts only the pairs whose sources or settings changed, and re-splits.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

import pandas as pd
from omegaconf import DictConfig
from rich.console import Console
from rich.table import Table

from nailseg.io.atomic import NotOursError
from nailseg.io.folder import BusyError, ForeignFolderError, OwnedFolder
from nailseg.prep.convert import Outcome, convert
from nailseg.prep.format import (
    CSV_COLUMNS,
    EXCLUDED_FILE,
    JOURNAL_FILE,
    KIND,
    MANIFEST_FILE,
    ROOT_FILES,
    SPLITS,
    split_file,
    table_bytes,
)
from nailseg.prep.layout import EXCLUSION_KINDS, Exclusion, display_path
from nailseg.prep.ledger import (
    RECORD_COLUMNS,
    Record,
    conversion_settings,
    load_records,
    refuse_mass_vanishing,
    triage,
)
from nailseg.prep.request import (
    PrepareError,
    PrepareSettings,
    check_config,
    check_request,
    generates,
    nothing_usable,
    usable_pairs,
)
from nailseg.prep.splits import split_usable
from nailseg.tables import print_table


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


def claim_root(out_root: Path, wait_s: float = 0.0) -> OwnedFolder:
    """The prepared root, locked for this process; PrepareError (from BusyError when another
    process holds it) when it cannot be."""
    try:
        return OwnedFolder.claim(out_root, KIND, key="output_dir", wait_s=wait_s)
    except BusyError as err:
        raise PrepareError(
            f"output_dir={out_root} is in use: another prepare is writing it, or a training is "
            "reading it; nothing was changed: run this once it has finished"
        ) from err
    except ForeignFolderError as err:
        raise PrepareError(str(err)) from err


def prepare(
    input_dir: Path | str,
    output_dir: Path | str,
    settings: PrepareSettings,
    source: dict | None = None,
    wait_s: float = 0.0,
) -> Summary:
    """Prepare `input_dir` (Images/<group>/, Masks/<group>/) into `output_dir`.

    Args:
        input_dir: the photos and masks; never written.
        output_dir: a new or empty folder, or a root an earlier run prepared.
        settings: conversion, split and rerun settings (conf/prepare.yaml).
        source: the synthetic set the input is (its manifest), kept in the root's marker.
        wait_s: how long to wait for another command holding the root.

    Raises:
        PrepareError: a request refused before the first write (settings, folders, an input
            without a usable pair or missing many of the pairs prepared before, the root in use),
            or a run left with nothing usable, or `strict` and a file excluded.
    """
    start = time.perf_counter()
    input_dir, out_root = Path(input_dir), Path(output_dir)
    check_request(input_dir, out_root, settings)
    pairs, excluded = usable_pairs(input_dir, settings.split)
    recorded = conversion_settings(settings.mask_threshold)
    with claim_root(out_root, wait_s) as folder:
        folder.check_free(sorted(ROOT_FILES))
        records = load_records(folder)
        refuse_mass_vanishing(records, pairs, settings.prune, input_dir, out_root)
        current, stale, blocked = triage(pairs, folder, records, recorded)
        summary = Summary(up_to_date=len(current), excluded=excluded + blocked)
        complete, new = folder.marker.get("complete", False), not folder.journal.files
        had_journal = os.path.lexists(folder.path / JOURNAL_FILE)
        if stale:
            folder.update_marker(complete=False)
        for outcome in convert(stale, folder, settings):
            summary.add(outcome)
            current += [outcome.record] if outcome.record is not None else []
        if not current:  # nothing was written: no trace of this run is left
            folder.update_marker(complete=complete)
            if not had_journal:
                folder.remove(JOURNAL_FILE)
            made = f"{out_root} holds only nailseg's marker and journal" if new else None
            raise PrepareError(nothing_usable(input_dir, pairs, summary.excluded, made))
        current.sort(key=lambda r: (r.group, r.stem))
        try:
            splits = split_usable(
                [r.group for r in current], [r.stem for r in current], settings.split
            )
        except ValueError as err:
            raise PrepareError(str(err)) from err
        _finish(folder, records, current, splits, settings.prune, summary)
        folder.update_marker(
            complete=True, synthetic=source, mask_threshold=settings.mask_threshold
        )
    summary.seconds = time.perf_counter() - start
    if settings.strict and summary.excluded:
        raise PrepareError(
            f"strict=true and {len(summary.excluded)} file(s) were excluded, first: {summary.excluded[0]}"
        )
    return summary


def _finish(
    folder: OwnedFolder,
    before: dict[str, Record],
    records: list[Record],
    splits: list[str],
    prune: bool,
    summary: Summary,
) -> None:
    """The outputs of pairs gone from the input (recorded `before`, or journaled by the folder)
    kept or, with `prune`, deleted while they are nailseg's; then the manifest, excluded.csv and
    the split CSVs; the pair journal, now in the manifest, is spent."""
    keep = {rel for r in records for rel in r.outputs}
    known = {rel for r in before.values() for rel in r.outputs} | set(folder.journal.files)
    gone = sorted(rel for rel in known - keep if rel.endswith(".npy") and folder.file(rel).exists())
    keys = {PurePosixPath(*PurePosixPath(rel).parts[1:]).with_suffix("") for rel in gone}
    if prune:
        for rel in gone:
            folder.remove(rel)
        summary.pruned = len(keys)
    else:
        summary.kept_gone = len(keys)
    summary.users_files += folder.kept
    table = pd.DataFrame([asdict(r) for r in records], columns=RECORD_COLUMNS)
    folder.write(MANIFEST_FILE, table_bytes(table))
    folder.remove(JOURNAL_FILE)
    summary.excluded.sort(key=lambda e: (EXCLUSION_KINDS.index(e.kind), str(e.path)))
    excluded = [(display_path(e.path), e.kind, e.detail) for e in summary.excluded]
    folder.write(
        EXCLUDED_FILE, table_bytes(pd.DataFrame(excluded, columns=["path", "reason", "detail"]))
    )
    table["split"] = splits
    for split in SPLITS:
        chosen = table[table["split"] == split][CSV_COLUMNS]
        summary.split_sizes[split] = len(chosen)
        if split == "test" and chosen.empty:
            folder.remove(split_file(split))
        else:
            folder.write(split_file(split), table_bytes(chosen))


def run(cfg: DictConfig, wait_s: float = 0.0) -> Summary:
    """`prepare.py` body: check the request, make the synthetic photos when the dataset asks for
    them, then prepare; a root prepared from a synthetic set records which in its marker."""
    input_dir, output_dir = Path(cfg.input_dir), Path(cfg.output_dir)
    check_config(cfg)  # before the generator writes the input
    source = None
    if generates(cfg):
        from nailseg.synth.scene import generate, manifest

        n, seed = cfg.dataset.synthetic.n, cfg.dataset.synthetic.seed
        try:
            generate(input_dir, n, seed, cfg.num_workers or 0, "dataset.raw_dir", wait_s)
        except NotOursError as err:
            raise PrepareError(str(err)) from err
        source = manifest(n, seed)
    summary = prepare(input_dir, output_dir, PrepareSettings.from_config(cfg), source, wait_s)
    print_summary(summary)
    return summary
