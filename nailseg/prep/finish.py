"""The end of a run: delete what is no longer ours to keep, then write the manifest, excluded.csv,
the split CSVs, the synthetic source and last the marker, with the records of its files."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pandas as pd

from nailseg.io.atomic import write_text
from nailseg.io.ownership import (
    delete_listed,
    records_of,
    remove_file,
    remove_temp_files,
    write_marker,
)
from nailseg.prep.format import (
    CSV_COLUMNS,
    EXCLUDED_FILE,
    JOURNAL_FILE,
    MANIFEST_FILE,
    MARKER_FILE,
    ROOT_FILES,
    SOURCE_FILE,
    SPLITS,
    split_file,
    write_table,
)
from nailseg.prep.layout import EXCLUSION_KINDS, display_path
from nailseg.prep.ledger import RECORD_COLUMNS, Owned, Record, conversion_settings
from nailseg.prep.report import Summary
from nailseg.prep.settings import PrepareSettings


def _write_manifest(
    out_root: Path, owned: Owned, records: list[Record], prune: bool, summary: Summary
) -> None:
    """The manifest of this run; outputs of pairs gone from the input are kept (unlisted) or,
    with `prune`, deleted while they are as prepare wrote them. The journal is then spent."""
    usable = {r.key for r in records}
    gone = [r for key, r in owned.records.items() if key not in usable]
    kept = [] if prune else [replace(r, listed=False) for r in gone]
    summary.kept_gone, summary.pruned = len(kept), len(gone) - len(kept)
    manifest = sorted(records + kept, key=lambda r: (r.group, r.stem))
    keep_paths = {p for r in manifest for p in r.outputs}
    gone_paths = sorted(owned.paths - keep_paths)
    summary.users_files += delete_listed(out_root, {rel: owned.proof(rel) for rel in gone_paths})
    remove_temp_files(out_root, owned.paths | ROOT_FILES)
    table = pd.DataFrame([asdict(r) for r in manifest], columns=RECORD_COLUMNS)
    write_table(out_root / MANIFEST_FILE, table.astype({"listed": int}))
    remove_file(out_root / JOURNAL_FILE, lambda _: True)  # the lock holder's own, now recorded


def _write_splits(out_root: Path, records: list[Record], splits: list[str], summary: Summary):
    rows = pd.DataFrame([asdict(r) for r in records], columns=RECORD_COLUMNS)
    rows["split"] = splits
    for split in SPLITS:
        chosen = rows[rows["split"] == split][CSV_COLUMNS]
        summary.split_sizes[split] = len(chosen)
        if split == "test" and chosen.empty:
            remove_file(out_root / split_file(split), lambda _: True)  # checked by claim_root
        else:
            write_table(out_root / split_file(split), chosen)


def finish(
    out_root: Path,
    owned: Owned,
    records: list[Record],
    splits: list[str],
    settings: PrepareSettings,
    summary: Summary,
    marker: dict,
    source: str | None,
) -> None:
    """Write the run's files, the marker last; `source`: the synthetic set's manifest, if any."""
    _write_manifest(out_root, owned, records, settings.prune, summary)
    summary.excluded.sort(key=lambda e: (EXCLUSION_KINDS.index(e.kind), str(e.path)))
    excluded = [(display_path(e.path), e.kind, e.detail) for e in summary.excluded]
    write_table(
        out_root / EXCLUDED_FILE, pd.DataFrame(excluded, columns=["path", "reason", "detail"])
    )
    _write_splits(out_root, records, splits, summary)
    if source is not None:
        write_text(out_root / SOURCE_FILE, source)
    files = records_of(out_root, sorted(ROOT_FILES - {MARKER_FILE, JOURNAL_FILE}))
    recorded = json.loads(conversion_settings(settings.mask_threshold))
    write_marker(out_root, MARKER_FILE, marker | recorded | {"files": files})
