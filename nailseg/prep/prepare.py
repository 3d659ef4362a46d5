"""Turn a folder of photos and masks into training data: `.npy` arrays plus split CSVs.

Outputs under the output root (names in `nailseg.prep.format`): `images/<group>/<stem>.npy` (RGB
uint8 HxWx3), `masks/<group>/<stem>.npy` (uint8 HxWx1 in {0, 1}), `excluded.csv` (every file left
out and why), `manifest.csv` (the ledger) and, written last, `train.csv` / `valid.csv` /
`test.csv` (columns `CSV_COLUMNS`, paths relative to the root).

prepare writes only into a root it marked (`prepare.json`), never overlapping the input, and
deletes only files its ledger lists as its own; folders are never removed whole. Every file is
written under a temporary name and renamed, each pair is journaled as it completes and a lock
keeps a second prepare out, so a run is safe to interrupt, resume and repeat: a rerun converts
only the pairs whose sources or settings changed, and re-splits from the current settings.
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from nailseg.io.lock import locked
from nailseg.io.ownership import ForeignFolderError, truncate
from nailseg.prep.convert import convert
from nailseg.prep.finish import finish
from nailseg.prep.format import JOURNAL_FILE, LOCK_FILE
from nailseg.prep.ledger import (
    claim_root,
    conversion_settings,
    load_owned,
    refuse_mass_vanishing,
    triage,
)
from nailseg.prep.report import Summary, print_summary
from nailseg.prep.request import (
    PrepareError,
    check_config,
    check_request,
    generates,
    nothing_usable,
    usable_pairs,
)
from nailseg.prep.settings import PrepareSettings
from nailseg.prep.splits import split_usable


def _journal_size(out_root: Path) -> int | None:
    try:
        return (out_root / JOURNAL_FILE).stat().st_size
    except FileNotFoundError:
        return None


def prepare(
    input_dir: Path | str,
    output_dir: Path | str,
    settings: PrepareSettings,
    source: str | None = None,
) -> Summary:
    """Prepare `input_dir` (Images/<group>/, Masks/<group>/) into `output_dir`.

    Args:
        input_dir: the photos and masks; never written.
        output_dir: a new or empty folder, or a root an earlier run prepared.
        settings: conversion, split and rerun settings (conf/prepare.yaml).
        source: the manifest of the synthetic set the input is, kept as `SOURCE_FILE`.

    Returns:
        What was written, kept, pruned and excluded, and the split sizes.

    Raises:
        PrepareError: a request refused before the first write (settings, folders, an input
            without a usable pair or missing many of the pairs prepared before), or a run left
            with nothing usable, or `strict` and a file excluded.
    """
    start = time.perf_counter()
    input_dir, out_root = Path(input_dir), Path(output_dir)
    check_request(input_dir, out_root, settings)
    pairs, excluded = usable_pairs(input_dir, settings.split)
    recorded = conversion_settings(settings.mask_threshold)
    with locked(out_root, LOCK_FILE, "prepare", "output_dir", PrepareError):
        marker, new_root = claim_root(out_root, recorded)
        owned = load_owned(out_root)
        refuse_mass_vanishing(owned, pairs, settings.prune, input_dir, out_root)
        records, stale, blocked = triage(pairs, out_root, owned, recorded)
        summary = Summary(up_to_date=len(records), excluded=excluded + blocked)
        journal_size = _journal_size(out_root)
        records += convert(stale, out_root, owned, settings, summary)
        if not records:
            truncate(out_root / JOURNAL_FILE, journal_size)  # nothing was written: no trace
            kept = f"{out_root} holds only its marker and lock file" if new_root else None
            raise PrepareError(nothing_usable(input_dir, pairs, summary.excluded, kept))
        records.sort(key=lambda r: (r.group, r.stem))
        try:
            splits = split_usable(
                [r.group for r in records], [r.stem for r in records], settings.split
            )
        except ValueError as err:
            raise PrepareError(str(err)) from err
        finish(out_root, owned, records, splits, settings, summary, marker, source)
    summary.seconds = time.perf_counter() - start
    if settings.strict and summary.excluded:
        raise PrepareError(
            f"strict=true and {len(summary.excluded)} file(s) were excluded, first: {summary.excluded[0]}"
        )
    return summary


def run(cfg: DictConfig) -> Summary:
    """`prepare.py` body: check the request, make the synthetic photos when the dataset asks for
    them, then prepare; a root prepared from a synthetic set records which (`SOURCE_FILE`)."""
    input_dir, output_dir = Path(cfg.input_dir), Path(cfg.output_dir)
    check_config(cfg)  # before the generator writes the input
    synthetic = cfg.dataset.synthetic if generates(cfg) else None
    if synthetic is not None:
        from nailseg.prep.synthetic import generate, manifest_text

        try:
            generate(input_dir, synthetic.n, synthetic.seed, num_workers=cfg.num_workers or 0)
        except ForeignFolderError as err:
            raise PrepareError(f"dataset.raw_dir: {err}") from err
    source = None if synthetic is None else manifest_text(synthetic.n, synthetic.seed)
    summary = prepare(input_dir, output_dir, PrepareSettings.from_config(cfg), source)
    print_summary(summary)
    return summary
