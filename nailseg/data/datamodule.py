"""Reads the prepared CSVs and builds the loader backend named by `loader=` for each split.

The backend is a partial (Hydra `_partial_: true`) taking the split's records; whatever it is, it
yields the batch contract, so nothing downstream knows which backend runs. Sharding uses the
trainer's global rank and world size (not LOCAL_RANK), so it is right on any number of nodes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pandas as pd

from nailseg.data.augment import AugSpec
from nailseg.data.prepare import CSV_COLUMNS


def read_split(root: Path, split: str) -> pd.DataFrame:
    """One split's rows; a clear error when the root was never prepared."""
    path = root / f"{split}.csv"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: prepare the data first (`python prepare.py output_dir={root}` "
            f"or `make prepare`)"
        )
    rows = pd.read_csv(path, dtype={"group": str})
    missing = set(CSV_COLUMNS) - set(rows.columns)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)} (expected {CSV_COLUMNS})")
    return rows


class NailDataModule(L.LightningDataModule):
    """train / valid / test loaders over a prepared root; test falls back to valid without test.csv."""

    def __init__(
        self,
        root: str | Path,
        image_size: tuple[int, int],
        loader: functools.partial,
        aug: AugSpec,
    ) -> None:
        super().__init__()
        self.root = Path(root)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.loader = loader
        self.aug = aug
        self.splits = {"train": read_split(self.root, "train"), "valid": read_split(self.root, "valid")}
        if (self.root / "test.csv").is_file():
            self.splits["test"] = read_split(self.root, "test")
        self.group_names = sorted({g for rows in self.splits.values() for g in rows["group"]})
        self.group_ids = {name: i for i, name in enumerate(self.group_names)}

    @property
    def eval_spec(self) -> AugSpec:
        """Evaluation: the same resize and normalisation, no augmentation."""
        return AugSpec(ops=(), mean=self.aug.mean, std=self.aug.std)

    @property
    def overfitting(self) -> bool:
        """`trainer.overfit_batches`: train and validate on the same fixed, unaugmented batches."""
        return self.trainer is not None and self.trainer.overfit_batches > 0

    def _build(self, split: str, train: bool):
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        if self.overfitting:
            split, train = "train", False
        loader = self.loader(
            records=self.splits[split],
            root=self.root,
            spec=self.aug if train else self.eval_spec,
            train=train,
            image_size=self.image_size,
            group_ids=self.group_ids,
            rank=rank,
            world_size=world,
        )
        if train and self.trainer is not None:
            loader.set_epoch(self.trainer.current_epoch)  # a resumed fit continues the shuffles
        return loader

    def train_dataloader(self):
        return self._build("train", train=True)

    def val_dataloader(self):
        return self._build("valid", train=False)

    def test_dataloader(self):
        return self._build("test" if "test" in self.splits else "valid", train=False)
