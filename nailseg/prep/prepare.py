"""`prepare.py`'s job: photos and masks into training data (`.npy` arrays, `excluded.csv`,
`manifest.csv` and, last, the split CSVs) in a root claimed for the whole run, its lock keeping
out a second prepare, `make clean` and a training reading it. Every check that can refuse a
request runs before the first write; outputs of pairs gone from the input stay unless `prune`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

import pandas as pd
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from nailseg.config import CONF_DIR
from nailseg.errors import PrepareError
from nailseg.io.atomic import NotOursError
from nailseg.io.folder import BusyError, OwnedFolder, refuse_foreign
from nailseg.io.overlap import overlap
from nailseg.io.permissions import unwritable_folder
from nailseg.prep.convert import (
    RECORD_COLUMNS,
    Outcome,
    Record,
    conversion_settings,
    convert,
    load_records,
    refuse_mass_vanishing,
    triage,
)
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
from nailseg.prep.imageio import check_mask_threshold
from nailseg.prep.layout import (
    EXCLUSION_KINDS,
    Exclusion,
    display_path,
    find_pairs,
    nothing_usable,
)
from nailseg.prep.splits import SplitSettings, check_split_settings, split_usable
from nailseg.tables import print_table


@dataclass(frozen=True)
class PrepareSettings:
    """How prepare converts, checks and splits (conf/prepare.yaml's keys of the same names)."""

    mask_threshold: int  # a mask value above it is nail; {0, 1} masks are taken as they are
    strict: bool  # any excluded file fails the run
    prune: bool  # delete the outputs of pairs gone from the input (else kept, unlisted)
    num_workers: int | None  # processes; None: one per CPU core
    split: SplitSettings

    @classmethod
    def from_config(cls, cfg: DictConfig) -> PrepareSettings:
        """The settings of a composed conf/prepare.yaml."""
        split = SplitSettings(**OmegaConf.to_container(cfg.split, resolve=True))
        return cls(cfg.mask_threshold, cfg.strict, cfg.prune, cfg.num_workers, split)


def compose_prepare(overrides: Sequence[str] = ()) -> DictConfig:
    """conf/prepare.yaml with Hydra `overrides`, composed inside a Hydra app or outside one."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose("prepare", overrides=list(overrides))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("prepare", overrides=list(overrides))


def check_request(input_dir: Path, out_root: Path, settings: PrepareSettings) -> None:
    """Refuse a request that cannot end well, from the input's path alone (before generation)."""
    check_split_settings(settings.split)
    if settings.split.folds == 1 and settings.split.valid_fraction == 0:
        raise PrepareError(
            "split.valid_fraction=0 leaves no validation split, and training needs one (it "
            "validates every epoch and keeps the best checkpoint by val/dice): set e.g. 0.2"
        )
    check_mask_threshold(settings.mask_threshold)
    if overlap(input_dir, out_root):
        raise PrepareError(
            f"input_dir={input_dir} and output_dir={out_root} overlap (one is, or is inside, the "
            "other, comparing names without case): choose an output_dir outside the input"
        )
    for path in (out_root, *out_root.parents):  # a link to nothing, or a file, on the way
        if os.path.islink(path) and not path.exists():
            raise PrepareError(
                f"output_dir={out_root}: {path} is a symlink to {os.readlink(path)}, which "
                "does not exist: create that folder, or choose another output_dir"
            )
        if path.exists() and not path.is_dir():
            raise PrepareError(f"output_dir={out_root}: {path} is a file, not a folder")
    if (folder := unwritable_folder(out_root)) is not None:
        raise PrepareError(
            f"output_dir={out_root}: {folder} is not writable by this user: change its "
            "permissions, or choose another output_dir"
        )
    refuse_foreign(out_root, KIND, "output_dir")


def generates(cfg: DictConfig) -> bool:
    """Whether `run` makes its input: a synthetic dataset read from its own raw_dir."""
    raw_dir = cfg.dataset.raw_dir
    return (
        cfg.dataset.synthetic is not None and bool(raw_dir) and Path(cfg.input_dir) == Path(raw_dir)
    )


def check_config(cfg: DictConfig) -> None:
    """Everything `run` can check before its first write (the Hydra callback's check): the
    request, and the input, or the synthetic set it will generate and its groups."""
    settings = PrepareSettings.from_config(cfg)
    check_request(Path(cfg.input_dir), Path(cfg.output_dir), settings)
    if not generates(cfg):
        if not Path(cfg.input_dir).is_dir():
            raise PrepareError(f"input_dir={cfg.input_dir} does not exist")
        return
    from nailseg.synth.scene import FRAMINGS, groups_of
    from nailseg.synth.scene import KIND as SYNTHETIC

    synthetic = cfg.dataset.synthetic
    if synthetic.n < 1:
        raise PrepareError(f"dataset.synthetic.n={synthetic.n}: must be at least 1")
    if synthetic.framing not in FRAMINGS:
        raise PrepareError(
            f"dataset.synthetic.framing={synthetic.framing}: one of {list(FRAMINGS)}"
        )
    refuse_foreign(Path(cfg.input_dir), SYNTHETIC, "dataset.raw_dir")
    check_split_settings(settings.split, groups_of(synthetic.n))


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
    megabytes: float = 0.0  # what the prepared root holds of prepare's files
    seconds: float = 0.0

    def add(self, outcome: Outcome) -> None:
        if outcome.nonbinary_values:
            self.nonbinary_masks += 1
            self.max_distinct_values = max(self.max_distinct_values, outcome.nonbinary_values)
        if outcome.image_bits != 8:
            self.rescaled[outcome.image_bits] += 1
        self.written += outcome.record is not None
        self.excluded += [outcome.exclusion] if outcome.exclusion else []


def print_summary(summary: Summary, console: Console | None = None, max_listed: int = 50) -> None:
    """The end-of-run table: what was written, what was left out and why."""
    console = console or Console()
    reasons = Counter(e.kind for e in summary.excluded)
    depths = ", ".join(f"{n} from {bits}-bit" for bits, n in sorted(summary.rescaled.items()))
    nonbinary = f"{summary.nonbinary_masks} (up to {summary.max_distinct_values} distinct values)"
    shown_when_any = {
        **{f"excluded: {kind}": reasons[kind] for kind in EXCLUSION_KINDS},
        "masks not binary (binarised)": summary.nonbinary_masks and nonbinary,
        "images rescaled to 8 bits": depths,
        "pairs gone from the input, outputs kept (prune=true deletes)": summary.kept_gone,
        "pairs gone from the input, outputs deleted (prune)": summary.pruned,
        "outputs changed since prepare wrote them (yours: kept)": len(summary.users_files),
    }
    table = Table(title="prepare summary", show_header=False)
    for label, value in {
        "pairs written": summary.written,
        "pairs up to date (skipped)": summary.up_to_date,
        **{f"{split}.csv rows": n for split, n in summary.split_sizes.items()},
        **{label: value for label, value in shown_when_any.items() if value},
        "size on disk": f"{summary.megabytes:.0f} MB",
        "seconds": f"{summary.seconds:.2f}",
    }.items():
        table.add_row(label, str(value))
    print_table(table, console)
    lines = [f"  kept, not prepare's any more: {path}" for path in summary.users_files[:max_listed]]
    lines += [f"  excluded {exclusion}" for exclusion in summary.excluded[:max_listed]]
    if len(summary.excluded) > max_listed:
        lines.append(f"  ... {len(summary.excluded) - max_listed} more in {EXCLUDED_FILE}")
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def claim_root(out_root: Path, wait_s: float = 0.0) -> OwnedFolder:
    """The prepared root, locked for this process; PrepareError, from BusyError, when it is held."""
    try:
        return OwnedFolder.claim(out_root, KIND, key="output_dir", wait_s=wait_s)
    except BusyError as err:
        raise PrepareError(
            f"output_dir={out_root} is in use: another prepare is writing it, or a training is "
            "reading it; nothing was changed: run this once it has finished"
        ) from err


def prepare(
    input_dir: Path | str,
    output_dir: Path | str,
    settings: PrepareSettings,
    source: dict | None = None,
    wait_s: float = 0.0,
) -> Summary:
    """Prepare `input_dir` (Images/<group>/, Masks/<group>/, never written) into `output_dir`;
    `source`: the synthetic set the input is, kept in the root's marker; `wait_s`: how long to
    wait for another command holding the root."""
    start = time.perf_counter()
    input_dir, out_root = Path(input_dir), Path(output_dir)
    check_request(input_dir, out_root, settings)
    pairs, excluded = find_pairs(input_dir)
    if not pairs:
        raise PrepareError(nothing_usable(input_dir, pairs, excluded))
    check_split_settings(settings.split, [p.group for p in pairs])  # the held-out groups
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
        for outcome in convert(stale, folder, settings.mask_threshold, settings.num_workers):
            summary.add(outcome)
            current += [outcome.record] if outcome.record is not None else []
        if not current:  # nothing was written: no trace of this run is left
            folder.update_marker(complete=complete)
            if not had_journal:
                folder.remove(JOURNAL_FILE)
            made = f"{out_root} holds only nailseg's marker and journal" if new else None
            raise PrepareError(nothing_usable(input_dir, pairs, summary.excluded, made))
        current.sort(key=lambda r: (r.group, r.stem))
        splits = split_usable([r.group for r in current], [r.stem for r in current], settings.split)
        _finish(folder, records, current, splits, settings.prune, summary)
        folder.update_marker(
            complete=True, synthetic=source, mask_threshold=settings.mask_threshold
        )
        summary.megabytes = sum(r.size for r in folder.journal.files.values()) / 1e6
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

        n, seed, framing = (cfg.dataset.synthetic[k] for k in ("n", "seed", "framing"))
        try:
            generate(input_dir, n, seed, cfg.num_workers or 0, "dataset.raw_dir", wait_s, framing)
        except NotOursError as err:
            raise PrepareError(str(err)) from err
        source = manifest(n, seed, framing)
    summary = prepare(input_dir, output_dir, PrepareSettings.from_config(cfg), source, wait_s)
    print_summary(summary)
    return summary
