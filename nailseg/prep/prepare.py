"""Turn a folder of photos and masks into training data: `.npy` arrays plus split CSVs.

Outputs under the output root (names in `nailseg.prep.format`): `images/<group>/<stem>.npy` (RGB
uint8 HxWx3), `masks/<group>/<stem>.npy` (uint8 HxWx1 in {0, 1}), `excluded.csv` (every file left
out and why), `manifest.csv` (the ledger) and, written last, `train.csv` / `valid.csv` /
`test.csv` (columns `CSV_COLUMNS`, paths relative to the root).

The root is nailseg's folder of kind `prepare` (`nailseg.io.folder`), claimed for the whole run:
its lock keeps out a second prepare, `make clean` and a training reading it (a training holds a
reader's lock). Every file goes through the folder: atomic, journaled, a user's file never
replaced; outputs of pairs gone from the input stay (unlisted) unless `prune`. A run is safe to
interrupt, resume and repeat: a rerun converts only the pairs whose sources or settings changed,
and re-splits from the current settings.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path, PurePosixPath

import pandas as pd
from omegaconf import DictConfig

from nailseg.io.atomic import NotOursError
from nailseg.io.folder import BusyError, ForeignFolderError, OwnedFolder
from nailseg.prep.convert import convert
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
from nailseg.prep.layout import EXCLUSION_KINDS, display_path
from nailseg.prep.ledger import (
    RECORD_COLUMNS,
    Record,
    conversion_settings,
    load_records,
    refuse_mass_vanishing,
    triage,
)
from nailseg.prep.report import Summary, print_summary
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
        current += convert(stale, folder, settings, summary)
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
