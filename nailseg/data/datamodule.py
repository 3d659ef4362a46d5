"""Reads the prepared CSVs and builds the loader backend named by `loader=` for each split.

The backend is a partial (Hydra `_partial_: true`) taking the split's records; whatever it is, it
yields the batch contract, so nothing downstream knows which backend runs. Sharding uses the
trainer's global rank and world size (not LOCAL_RANK), so it is right on any number of nodes.

Under DDP ranks may run different numbers of evaluation batches (rows r, r + world, ...; nothing
padded): nothing in an evaluation step talks to other ranks (metrics sync once, at epoch end), so
no rank waits. A rank with *no* evaluation batch would skip Lightning's whole evaluation loop,
epoch-end sync included, and leave the others waiting forever: an evaluation split smaller than
the world size is refused up front, on every rank alike.

Loaders hold threads and (DALI) device buffers: each is closed when it is replaced or at
`teardown`, so the jobs of a sweep in one process do not pile them up.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning as L
import pandas as pd

from nailseg.data.augment import AugSpec
from nailseg.prep.format import CSV_COLUMNS


def read_split(root: Path, split: str) -> pd.DataFrame:
    """One split's rows; a clear error when the root was never prepared."""
    path = root / f"{split}.csv"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: prepare the data first (`python prepare.py output_dir={root}` "
            f"or `make prepare`)"
        )
    from nailseg.prep.format import read_table  # names like `NA` stay text

    return read_table(path, required=CSV_COLUMNS)


class NailDataModule(L.LightningDataModule):
    """train / valid loaders over a prepared root, and the loader of the final evaluation.

    Lightning's test stage runs the final evaluation on `final_split`: `auto` is the test split
    when the data has one, else the validation split (then the module must not report it as a
    test score; see `SegModule.test_prefix`).
    """

    def __init__(
        self,
        root: str | Path,
        image_size: tuple[int, int],
        loader: functools.partial,
        aug: AugSpec,
        final_split: str = "auto",
    ) -> None:
        super().__init__()
        self.root = Path(root)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.loader = loader
        self.aug = aug
        self.splits = {
            "train": read_split(self.root, "train"),
            "valid": read_split(self.root, "valid"),
        }
        if (self.root / "test.csv").is_file():
            self.splits["test"] = read_split(self.root, "test")
        if final_split == "auto":
            final_split = "test" if "test" in self.splits else "valid"
        if final_split not in self.splits:
            raise FileNotFoundError(
                f"eval_split={final_split}: {self.root} has no {final_split}.csv "
                "(prepare it with split.test_fraction > 0, or evaluate on valid)"
            )
        self.final_split = final_split
        self.group_names = sorted({g for rows in self.splits.values() for g in rows["group"]})
        self.group_ids = {name: i for i, name in enumerate(self.group_names)}
        self._loaders: dict[str, Any] = {}  # the open loader of each stage

    @property
    def eval_spec(self) -> AugSpec:
        """Evaluation: the same resize and normalisation, no augmentation."""
        return AugSpec(ops=(), mean=self.aug.mean, std=self.aug.std)

    @property
    def overfitting(self) -> bool:
        """`trainer.overfit_batches`: train and validate on the same fixed, unaugmented batches."""
        return self.trainer is not None and self.trainer.overfit_batches > 0

    def _build(self, stage: str, split: str, train: bool):
        rank, world = (
            (self.trainer.global_rank, self.trainer.world_size) if self.trainer else (0, 1)
        )
        if self.overfitting:
            split, train = "train", False
        if not train and len(self.splits[split]) < world:
            raise ValueError(
                f"the {split} split has {len(self.splits[split])} rows for {world} ranks: every "
                f"rank needs one to evaluate (nothing is padded); use fewer devices or more data"
            )
        self._close(stage)
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
        self._loaders[stage] = loader
        return loader

    def _close(self, stage: str) -> None:
        loader = self._loaders.pop(stage, None)
        if loader is not None:
            loader.close()

    def train_dataloader(self):
        return self._build("train", "train", train=True)

    def val_dataloader(self):
        return self._build("val", "valid", train=False)

    def test_dataloader(self):
        return self._build("test", self.final_split, train=False)

    def teardown(self, stage: str) -> None:
        """After fit / validate / test (Lightning calls it): release every loader now."""
        for name in list(self._loaders):
            self._close(name)
