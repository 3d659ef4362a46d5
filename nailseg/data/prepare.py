"""Turn a folder of photos and masks into training data: `.npy` arrays plus split CSVs.

Outputs under the output root: `images/<group>/<stem>.npy` (RGB uint8 HxWx3), `masks/<group>/<stem>.npy`
(uint8 HxWx1 in {0, 1}), `excluded.csv` (every file left out and why), `manifest.csv` (every pair
with the source modification times it was made from) and, written last, `train.csv` / `valid.csv`
/ `test.csv` (columns `CSV_COLUMNS`, paths relative to the root).

Safe to interrupt and to rerun: every file is written under a temporary name and renamed, so a
final name never holds a truncated file. A pair is up to date when both its outputs and its
manifest row carry its sources' modification times (set on the outputs before the rename) and the
conversion settings in `prepare.json` are unchanged; a rerun converts only what is not up to date,
so an interrupted run resumes where it stopped, and reads nothing but the manifest for the rest.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import pandas as pd
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from nailseg.atomic import write_atomic, write_text
from nailseg.data.imageio import UnreadableImage, binarise, read_mask_values, read_rgb
from nailseg.data.layout import (
    EMPTY_MASK,
    EXCLUSION_KINDS,
    SIZE_MISMATCH,
    UNREADABLE,
    Exclusion,
    Pair,
    find_pairs,
)
from nailseg.data.splits import assign_splits

CSV_COLUMNS = ["images", "masks", "group", "height", "width", "fg_fraction"]
SPLITS = ("train", "valid", "test")
SETTINGS_FILE = "prepare.json"
MANIFEST_FILE = "manifest.csv"
MTIME_COLUMNS = ["image_mtime_ns", "mask_mtime_ns"]
FORMAT_VERSION = 1


class PrepareError(RuntimeError):
    """Nothing usable, or an exclusion under `strict`: the message says which and why."""


@dataclass(frozen=True)
class Record:
    """One prepared pair: a CSV row plus the names it is sorted and split by."""

    group: str
    stem: str
    images: str
    masks: str
    height: int
    width: int
    fg_fraction: float
    image_mtime_ns: int  # of the source files: what the outputs were made from
    mask_mtime_ns: int


@dataclass(frozen=True)
class Outcome:
    """What converting one pair gave: a record or an exclusion, plus how non-binary its mask was."""

    record: Record | None = None
    exclusion: Exclusion | None = None
    nonbinary_values: int = 0


@dataclass
class Summary:
    """Counts for the final table; `excluded` lists every file left out."""

    written: int = 0
    up_to_date: int = 0
    excluded: list[Exclusion] = field(default_factory=list)
    nonbinary_masks: int = 0
    max_distinct_values: int = 0
    split_sizes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def _output_paths(pair: Pair) -> tuple[str, str]:
    return f"images/{pair.key}.npy", f"masks/{pair.key}.npy"


def save_npy_atomic(path: Path, array: np.ndarray, mtime_ns: int | None = None) -> None:
    write_atomic(
        path, lambda f: np.save(f, np.ascontiguousarray(array), allow_pickle=False), mtime_ns
    )


def convert_pair(pair: Pair, out_root: Path, threshold: int) -> Outcome:
    """Decode, check and write one pair (runs in a worker process)."""
    try:
        image = read_rgb(pair.image)
        values = read_mask_values(pair.mask)
    except UnreadableImage as err:
        return Outcome(exclusion=Exclusion(err.path, UNREADABLE, err.reason))
    if image.shape[:2] != values.shape:
        detail = f"image {image.shape[1]}x{image.shape[0]}, mask {values.shape[1]}x{values.shape[0]} (WxH)"
        return Outcome(exclusion=Exclusion(pair.mask, SIZE_MISMATCH, detail))
    mask, nonbinary = binarise(values, threshold)
    fg = int(mask.sum())
    if fg == 0:
        detail = f"no pixel above {threshold}" + (
            f" ({nonbinary} distinct values)" if nonbinary else ""
        )
        return Outcome(
            exclusion=Exclusion(pair.mask, EMPTY_MASK, detail), nonbinary_values=nonbinary
        )
    rel_image, rel_mask = _output_paths(pair)
    mtimes = pair.image.stat().st_mtime_ns, pair.mask.stat().st_mtime_ns
    save_npy_atomic(out_root / rel_image, image, mtimes[0])
    save_npy_atomic(out_root / rel_mask, mask[..., None], mtimes[1])
    record = Record(
        pair.group, pair.stem, rel_image, rel_mask, *mask.shape, fg / mask.size, *mtimes
    )
    return Outcome(record=record, nonbinary_values=nonbinary)


def _read_manifest(out_root: Path) -> dict[str, Record]:
    """The previous run's records by image output path (empty when there is none)."""
    try:
        rows = pd.read_csv(out_root / MANIFEST_FILE, dtype={"group": str, "stem": str})
    except FileNotFoundError:
        return {}
    return {row.images: Record(**row._asdict()) for row in rows.itertuples(index=False)}


def _up_to_date(pair: Pair, out_root: Path, manifest: dict[str, Record]) -> Record | None:
    """The manifest's record of a pair whose outputs are current, else None."""
    rel_image, rel_mask = _output_paths(pair)
    record = manifest.get(rel_image)
    if record is None or record.masks != rel_mask:
        return None
    sources = (pair.image.stat().st_mtime_ns, pair.mask.stat().st_mtime_ns)
    try:
        outputs = (
            (out_root / rel_image).stat().st_mtime_ns,
            (out_root / rel_mask).stat().st_mtime_ns,
        )
    except FileNotFoundError:
        return None
    return record if sources == outputs == (record.image_mtime_ns, record.mask_mtime_ns) else None


def _reset_if_settings_changed(out_root: Path, settings: dict) -> None:
    """Outputs made under other settings are removed before the new settings are recorded."""
    path = out_root / SETTINGS_FILE
    try:
        current = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        current = None
    if current == settings:
        return
    for sub in ("images", "masks"):
        shutil.rmtree(out_root / sub, ignore_errors=True)
    (out_root / MANIFEST_FILE).unlink(missing_ok=True)
    out_root.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(settings, indent=2, sort_keys=True))


def _remove_leftovers(out_root: Path, keep: set[str]) -> None:
    """Temporary files of interrupted runs, and outputs of pairs no longer in the input."""
    for sub in ("images", "masks"):
        for top, _, files in os.walk(out_root / sub, topdown=False):
            folder = Path(top)
            for name in files:
                if (folder / name).relative_to(out_root).as_posix() not in keep:
                    (folder / name).unlink()
            if folder != out_root / sub and not any(folder.iterdir()):
                folder.rmdir()


def _convert_all(pairs: list[Pair], out_root: Path, threshold: int, workers: int) -> list[Outcome]:
    if not pairs:
        return []
    with Progress(transient=True) as progress:
        task = progress.add_task("preparing", total=len(pairs))
        if workers <= 1:
            outcomes = []
            for pair in pairs:
                outcomes.append(convert_pair(pair, out_root, threshold))
                progress.advance(task)
            return outcomes
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(convert_pair, p, out_root, threshold) for p in pairs]
            for _ in as_completed(futures):
                progress.advance(task)
            return [f.result() for f in futures]


def _write_csv(path: Path, rows: pd.DataFrame) -> None:
    text = rows.to_csv(index=False, float_format="%.6f", lineterminator="\n")
    write_text(path, text)


def prepare(
    input_dir: Path,
    output_dir: Path,
    *,
    mask_threshold: int = 127,
    strict: bool = False,
    num_workers: int | None = None,
    valid_fraction: float = 0.2,
    test_fraction: float = 0.0,
    seed: int = 0,
    group_regex: str | None = None,
    folds: int = 1,
    fold: int = 0,
) -> Summary:
    """Prepare `input_dir` (Images/, Masks/) into `output_dir`; see the module docstring."""
    start = time.perf_counter()
    input_dir, out_root = Path(input_dir), Path(output_dir)
    if not input_dir.is_dir():
        raise PrepareError(f"input_dir {input_dir} does not exist")
    if out_root.resolve() == input_dir.resolve():
        raise PrepareError(f"output_dir must differ from input_dir ({input_dir})")
    try:
        pairs, excluded = find_pairs(input_dir)
    except FileNotFoundError as err:
        raise PrepareError(str(err)) from err
    _reset_if_settings_changed(
        out_root, {"format": FORMAT_VERSION, "mask_threshold": mask_threshold}
    )

    summary = Summary(excluded=excluded)
    records: list[Record] = []
    stale = []
    manifest = _read_manifest(out_root)
    for pair in pairs:
        record = _up_to_date(pair, out_root, manifest)
        if record is None:
            stale.append(pair)
        else:
            records.append(record)
    summary.up_to_date = len(records)
    workers = num_workers if num_workers is not None else os.cpu_count() or 1
    for outcome in _convert_all(stale, out_root, mask_threshold, min(workers, len(stale))):
        if outcome.nonbinary_values:
            summary.nonbinary_masks += 1
            summary.max_distinct_values = max(summary.max_distinct_values, outcome.nonbinary_values)
        if outcome.record is not None:
            records.append(outcome.record)
            summary.written += 1
        else:
            summary.excluded.append(outcome.exclusion)

    records.sort(key=lambda r: (r.group, r.stem))
    keep = {path for r in records for path in (r.images, r.masks)}
    _remove_leftovers(out_root, keep)
    summary.excluded.sort(key=lambda e: (EXCLUSION_KINDS.index(e.kind), str(e.path)))
    excluded_rows = pd.DataFrame(
        [(str(e.path), e.kind, e.detail) for e in summary.excluded],
        columns=["path", "reason", "detail"],
    )
    _write_csv(out_root / "excluded.csv", excluded_rows)
    table = pd.DataFrame(records, columns=[f.name for f in fields(Record)])
    _write_csv(out_root / MANIFEST_FILE, table)

    if not records:
        raise PrepareError(_nothing_usable(input_dir, pairs, summary))
    splits = assign_splits(
        [r.group for r in records],
        [r.stem for r in records],
        valid_fraction=valid_fraction,
        test_fraction=test_fraction,
        seed=seed,
        group_regex=group_regex,
        folds=folds,
        fold=fold,
    )
    table["split"] = splits
    for split in SPLITS:
        rows = table[table["split"] == split][CSV_COLUMNS]
        summary.split_sizes[split] = len(rows)
        if split == "test" and rows.empty:
            (out_root / "test.csv").unlink(missing_ok=True)
        else:
            _write_csv(out_root / f"{split}.csv", rows)
    summary.seconds = time.perf_counter() - start
    if summary.split_sizes["train"] == 0:
        raise PrepareError(f"no training samples left after the split of {len(records)} pairs")
    if strict and summary.excluded:
        raise PrepareError(
            f"strict=true and {len(summary.excluded)} file(s) were excluded, first: {summary.excluded[0]}"
        )
    return summary


def _nothing_usable(input_dir: Path, pairs: list[Pair], summary: Summary) -> str:
    if not pairs and not summary.excluded:
        return f"no image files found under {input_dir}/Images and {input_dir}/Masks"
    reasons = Counter(e.kind for e in summary.excluded)
    listed = ", ".join(f"{n} {kind}" for kind, n in reasons.most_common())
    return f"no usable image/mask pair in {input_dir}: {listed}; first: {summary.excluded[0]}"


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
    if summary.nonbinary_masks:
        table.add_row(
            "masks not binary (binarised)",
            f"{summary.nonbinary_masks} (up to {summary.max_distinct_values} distinct values)",
        )
    table.add_row("seconds", f"{summary.seconds:.2f}")
    console.print(table)
    for exclusion in summary.excluded[:max_listed]:
        console.print(f"  excluded {exclusion}", markup=False, highlight=False)
    if len(summary.excluded) > max_listed:
        console.print(f"  ... {len(summary.excluded) - max_listed} more in excluded.csv")


def run(cfg) -> Summary:
    """`prepare.py` body: make the synthetic photos when the dataset asks for them, then prepare."""
    dataset = cfg.dataset
    input_dir = Path(cfg.input_dir)
    if dataset.synthetic is not None and dataset.raw_dir and input_dir == Path(dataset.raw_dir):
        from nailseg.data.synthetic import generate

        generate(
            input_dir,
            n=dataset.synthetic.n,
            seed=dataset.synthetic.seed,
            num_workers=cfg.num_workers or 0,
        )
    summary = prepare(
        input_dir,
        Path(cfg.output_dir),
        mask_threshold=cfg.mask_threshold,
        strict=cfg.strict,
        num_workers=cfg.num_workers,
        valid_fraction=cfg.split.valid_fraction,
        test_fraction=cfg.split.test_fraction,
        seed=cfg.split.seed,
        group_regex=cfg.split.group_regex,
        folds=cfg.split.folds,
        fold=cfg.split.fold,
    )
    print_summary(summary)
    return summary
