"""The prepared CSVs read, and the loader backend named by `loader=` (a partial taking a split's
records) built for each split, sharded by the trainer's global rank and world size.

Mixed sources (`dataset.mix`): the root stays the primary source (its splits train, validate and
evaluate); each extra source adds only its train rows, after the primary's, with absolute paths,
groups named `<name>/<group>` and their source in the `SOURCE` column.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import pandas as pd

from nailseg.data.augment import AugSpec
from nailseg.data.loaders.base import SOURCE, DataError, Records, read_records
from nailseg.data.sampling import source_shares
from nailseg.errors import MissingFile
from nailseg.io.folder import below, lock_shared
from nailseg.io.overlap import within
from nailseg.prep.format import CSV_COLUMNS, read_table

log = logging.getLogger(__name__)


def read_split(root: Path, split: str) -> pd.DataFrame:
    """One split's rows; a clear error when the root was never prepared, the file is damaged
    (SplitFileError) or a row names a file outside the root."""
    path = root / f"{split}.csv"
    if os.path.lexists(path) and not path.is_file():  # a FIFO would never end reading
        raise DataError(f"{path} is not a plain file, so it is not read")
    if not path.is_file():
        raise MissingFile(
            f"{path} not found: prepare the data first (`python prepare.py dataset=DATASET "
            f"input_dir=RAW output_dir={root}`, RAW holding Images/<group>/ and Masks/<group>/)"
        )
    rows = read_table(path, CSV_COLUMNS)  # names like `NA` stay text
    for column in ("images", "masks"):
        outside = [rel for rel in rows[column] if not below(rel)]
        if outside:
            raise DataError(
                f"{path}: {column} {outside[0]!r} is not a path inside {root}: a split CSV "
                "names files below its own root; prepare the data again"
            )
    return rows


@dataclass(frozen=True)
class Source:
    """One source of the train split: `name` ('' for the primary), its root, weight and rows."""

    name: str
    root: Path
    weight: float
    key: str = "dataset.root"  # the config key naming the root
    rows: int = 0


def _check_weight(key: str, weight: Any, zero: bool = False) -> float:
    """`weight` as a float; a ValueError naming `key` unless finite and > 0 (`zero`: or 0)."""
    number = isinstance(weight, int | float) and not isinstance(weight, bool)
    if not number or not math.isfinite(weight) or weight < 0 or (weight == 0 and not zero):
        bound = ">= 0 (0: it only validates and tests)" if zero else "> 0"
        raise ValueError(f"{key}={weight}: a source's weight must be a finite number {bound}")
    return float(weight)


def read_mix(root: Path, weight: float, mix: Sequence[Mapping[str, Any]]) -> list[Source]:
    """The sources of the train split, primary first, checked before any is read."""
    primary = Source("", root, _check_weight("dataset.weight", weight, zero=True))
    if primary.weight == 0 and not mix:
        raise ValueError(
            "dataset.weight=0: dataset.root then only validates and tests; give dataset.mix a "
            "source to train on, or a weight > 0"
        )
    sources = [primary]
    for i, entry in enumerate(mix):
        key, name = f"dataset.mix[{i}]", entry["name"]  # {name, root, weight}: the schema's
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(
                f"{key}.name={name!r}: a non-empty name without '/' (its groups are <name>/<group>)"
            )
        if any(s.name == name for s in sources[1:]):
            raise ValueError(f"{key}.name={name}: two sources are named {name}; names must differ")
        mix_weight = _check_weight(f"{key}.weight", entry["weight"])
        source = Source(name, Path(str(entry["root"])), mix_weight, f"{key}.root")
        for other in sources:
            if within(source.root, other.root) and within(other.root, source.root):  # one folder
                why = "it trains already" if not other.name else "each root is mixed in once"
                raise ValueError(
                    f"{source.key}={source.root} is {other.key} ({other.root}): {why}; mix in "
                    "another prepared root"
                )
        if not (source.root / "train.csv").is_file():
            raw = source.root.parent / "raw"
            raise MissingFile(
                f"{source.key}={source.root} is not a prepared root (no train.csv): prepare it "
                f"first; the synthetic photos: `python prepare.py dataset=synthetic_mix "
                f"dataset.raw_dir={raw} dataset.root={source.root}`, your own: "
                f"`python prepare.py input_dir=RAW output_dir={source.root}`"
            )
        sources.append(source)
    return sources


def _mixed_rows(source: Source) -> pd.DataFrame:
    """A mixed-in source's train rows: paths absolute, groups `<name>/<group>`."""
    rows = read_split(source.root, "train")
    if rows.empty:
        raise ValueError(f"{source.key}={source.root}: its train split has no rows to mix in")
    absolute = source.root.absolute()
    return rows.assign(
        images=[str(absolute / rel) for rel in rows["images"]],
        masks=[str(absolute / rel) for rel in rows["masks"]],
        group=[f"{source.name}/{group}" for group in rows["group"]],
    )


class NailDataModule(L.LightningDataModule):
    """train / valid loaders over a prepared root, and the loader of the final evaluation
    (Lightning's test stage) on `final_split`: `auto` is the test split when there is one, else
    valid. `mix` ({name, root, weight} each) adds other roots' train splits, drawn by weight
    against the root's own `weight`; `sources` lists them, the root first."""

    def __init__(
        self,
        root: str | Path,
        image_size: tuple[int, int],
        loader: functools.partial,
        aug: AugSpec,
        final_split: str,
        mix: Sequence[Mapping[str, Any]],
        weight: float,
    ) -> None:
        super().__init__()
        self.root = Path(root)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.loader = loader
        self.aug = aug
        self.sources = read_mix(self.root, weight, mix)  # its errors come before any reading
        self._loaders: dict[str, Any] = {}  # the open loader of each stage
        self._locks: list[int] = []  # the reader's locks on the roots (`_hold`)
        self._locked_by = os.getpid()
        weakref.finalize(self, _unlock, self._locks, self._locked_by)
        self._hold()
        try:
            self._read(final_split)
        except BaseException:
            _unlock(self._locks, self._locked_by)
            raise

    def _read(self, final_split: str) -> None:
        mixed = [_mixed_rows(source) for source in self.sources[1:]]
        self.splits = {
            "train": read_split(self.root, "train"),
            "valid": read_split(self.root, "valid"),
        }
        if (self.root / "test.csv").is_file():
            self.splits["test"] = read_split(self.root, "test")
        primary_groups = sorted({g for rows in self.splits.values() for g in rows["group"]})
        mixed_groups = sorted({g for rows in mixed for g in rows["group"]})
        clash = sorted(set(primary_groups) & set(mixed_groups))
        if clash:
            raise ValueError(f"dataset.mix: groups {clash} are also groups of {self.root}")
        counts = [len(rows) for rows in (self.splits["train"], *mixed)]
        self.sources = [replace(s, rows=n) for s, n in zip(self.sources, counts, strict=True)]
        if mixed and self.splits["train"].empty:
            raise ValueError(f"dataset.root={self.root}: its train split has no rows to mix with")
        # the rows training draws from: the primary's train split, then each mixed source's;
        # `splits` stays the primary's CSVs, which every evaluation reads
        frames = [
            rows.assign(**{SOURCE: k}) for k, rows in enumerate([self.splits["train"], *mixed])
        ]
        self.train_rows = pd.concat(frames, ignore_index=True) if mixed else self.splits["train"]
        if mixed:
            self._describe_mix()
        if final_split == "auto":
            final_split = "test" if "test" in self.splits else "valid"
        if final_split not in self.splits:
            raise MissingFile(
                f"eval_split={final_split}: {self.root} has no {final_split}.csv "
                "(prepare it with split.test_fraction > 0, or evaluate on valid)"
            )
        self.final_split = final_split
        # the primary's groups keep their names and ids; mixed-in groups come after them
        self.group_names = primary_groups + mixed_groups
        self.group_ids = {name: i for i, name in enumerate(self.group_names)}
        # each split's files and those training draws from, checked once, before any training
        self.records = {
            k: read_records(v, self.root, self.group_ids) for k, v in self.splits.items()
        }
        self.train_records = (
            read_records(
                self.train_rows, self.root, self.group_ids, [s.weight for s in self.sources]
            )
            if mixed
            else self.records["train"]
        )

    def _hold(self) -> None:
        """A reader's lock on each root, from now (or `setup`) to `teardown`: prepare refuses to
        rewrite or prune a root meanwhile, and training refuses a root prepare is writing."""
        if self._locks:
            return
        self._locked_by = os.getpid()
        for source in self.sources:
            if source.root.is_dir():  # else read_split names what is missing
                self._locks.append(lock_shared(source.root, source.key))

    def setup(self, stage: str) -> None:
        self._hold()

    def _describe_mix(self) -> None:
        shares = source_shares(len(self.train_rows), [s.weight for s in self.sources])
        log.info(
            "training mixes %d sources, %d samples an epoch: %s",
            len(self.sources),
            len(self.train_rows),
            "; ".join(
                f"{s.name or 'dataset.root'} ({s.root}): {s.rows} rows, weight {s.weight:g}, "
                f"{share} an epoch"
                for s, share in zip(self.sources, shares, strict=True)
            ),
        )

    @property
    def eval_spec(self) -> AugSpec:
        """Evaluation: the same resize and normalisation, no augmentation."""
        return AugSpec(ops=(), mean=self.aug.mean, std=self.aug.std)

    @property
    def overfitting(self) -> bool:
        """`trainer.overfit_batches`: train and validate on the same fixed, unaugmented batches
        of the train split (training unshuffled, in equal shares per rank)."""
        return self.trainer is not None and self.trainer.overfit_batches > 0

    def check_evaluations(self, world_size: int, fit: bool, final: bool) -> None:
        """Refuse, before anything runs, an evaluation split with fewer rows than ranks (a rank
        without a batch would skip the epoch-end sync the others wait in): validation's when
        fitting, the final evaluation's when it runs."""
        stages = [stage for stage, runs in (("val", fit), ("test", final)) if runs]
        for stage in stages:
            self._check_rows(*self._rows(stage), world_size)

    def _rows(self, stage: str) -> tuple[str, Records]:
        """(split, records) a stage's loader reads: training (and validation when overfitting)
        the rows training draws from; validation and the final evaluation the primary's own."""
        if stage == "train" or (stage == "val" and self.overfitting):
            return "train", self.train_records
        split = "valid" if stage == "val" else self.final_split
        return split, self.records[split]

    @staticmethod
    def _check_rows(split: str, records: Records, world: int) -> None:
        rows = len(records.images)
        if rows < world:
            raise ValueError(
                f"the {split} split has {rows} rows for {world} ranks: every rank needs one "
                f"to evaluate (nothing is padded); use fewer devices or more data"
            )

    def _make(self, stage: str, **extra: Any):
        """This rank's loader of `stage` (`extra`: loader options over the config's)."""
        rank, world = (
            (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        )
        split, records = self._rows(stage)
        train = stage == "train"
        if not train:
            self._check_rows(split, records, world)
        return self.loader(
            records=records,
            spec=self.aug if train and not self.overfitting else self.eval_spec,
            train=train,
            shuffle=not self.overfitting,
            image_size=self.image_size,
            rank=rank,
            world_size=world,
            **extra,
        )

    def train_batches(self) -> int:
        """len() of this rank's train loader before the fit, counted on a CPU twin of it: the
        real one would take its device before Lightning sets each rank's own."""
        loader = self._make("train", device="cpu")
        try:
            return len(loader)
        finally:
            loader.close()

    def _build(self, stage: str):
        self._close(stage)
        loader = self._make(stage)
        if stage == "train" and self.trainer is not None:
            # the epoch the fit runs next: a fit resumed from an epoch's end-of-epoch checkpoint
            # has `current_epoch` (epochs completed) one short of it until that epoch starts
            loader.set_epoch(self.trainer.fit_loop.epoch_progress.current.processed)
        self._loaders[stage] = loader
        return loader

    def _close(self, stage: str) -> None:
        loader = self._loaders.pop(stage, None)
        if loader is not None:
            loader.close()

    def train_dataloader(self):
        return self._build("train")

    def val_dataloader(self):
        return self._build("val")

    def test_dataloader(self):
        return self._build("test")

    def teardown(self, stage: str) -> None:
        """After fit / validate / test (Lightning calls it): release every loader and lock now."""
        for name in list(self._loaders):
            self._close(name)
        _unlock(self._locks, self._locked_by)


def _unlock(locks: list[int], pid: int) -> None:
    """Drop the locks `pid` took; a spawned rank inherits their numbers, not the locks."""
    if os.getpid() == pid:
        for fd in locks:
            os.close(fd)
    locks.clear()
