"""`trainer.overfit_batches` under DDP, with ranks simulated by an explicit rank and world size.

Every rank must run the same number of train steps (a rank with fewer would leave the others
waiting in the gradient all-reduce forever): the overfit train loader takes the train split
unshuffled, in equal shares, unaugmented, the same batches every epoch; validation (on the same
split) still sees every row once, and a rank's first batches are the ones it trains on.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
from support.loaders import EVERYTHING, loader_settings, trainer_stand_in
from support.prepared import write_prepared

from nailseg.data.datamodule import NailDataModule
from nailseg.data.loaders.dali import DaliLoader
from nailseg.data.loaders.torch_workers import TorchLoader
from nailseg.data.sampling import epoch_batches, num_batches


@pytest.mark.parametrize("drop_last", [True, False])
def test_unshuffled_train_plan_is_an_equal_share_of_eval_rows(drop_last: bool) -> None:
    for n in range(1, 30):
        for world in range(1, 5):
            for batch_size in (1, 2, 3, 5):
                plan = functools.partial(
                    epoch_batches, n, batch_size, world_size=world, drop_last=drop_last
                )
                for rank in range(world):
                    mine = [b.tolist() for b in plan(train=True, shuffle=False, rank=rank)]
                    expected = num_batches(
                        n, batch_size, train=True, rank=rank, world_size=world, drop_last=drop_last
                    )
                    assert len(mine) == expected  # the same count on every rank
                    later = plan(train=True, shuffle=False, rank=rank, seed=5, epoch=3)
                    assert [b.tolist() for b in later] == mine  # fixed: no seed, no epoch
                    rows = [r for b in mine for r in b]
                    eval_rows = [r for b in plan(train=False, rank=rank) for r in b.tolist()]
                    assert rows == eval_rows[: len(rows)]  # the rank's first eval rows, in order


def _datamodule(
    root: Path,
    backend: type,
    batch_size: int,
    drop_last: bool,
    rank: int,
    world: int,
    overfit_batches: int = 2,
) -> NailDataModule:
    workers = {} if backend is DaliLoader else {"num_workers": 0}
    loader = functools.partial(
        backend, **loader_settings(backend, batch_size=batch_size, drop_last=drop_last, **workers)
    )
    datamodule = NailDataModule(root, (32, 32), loader, EVERYTHING, "auto", mix=[], weight=1.0)
    datamodule.trainer = trainer_stand_in(rank, world, overfit_batches)
    return datamodule


def _passes(loader, epochs: int = 2) -> list[list[tuple[list[int], np.ndarray]]]:
    """Each pass's batches as (rows, images)."""
    passes = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        passes.append([(b["index"].tolist(), b["image"].cpu().numpy()) for b in loader])
    return passes


def _check_overfit(root: Path, n: int, backend: type, batch_size: int, world: int) -> None:
    for drop_last in (True, False):
        lengths, seen = set(), []
        for rank in range(world):
            datamodule = _datamodule(root, backend, batch_size, drop_last, rank, world)
            counted = datamodule.train_batches()
            train, val = datamodule.train_dataloader(), datamodule.val_dataloader()
            assert counted == len(train)
            first, again = _passes(train)
            lengths.add(len(train))
            assert len(train) == len(first) == len(again)
            assert [rows for rows, _ in first] == [rows for rows, _ in again]  # unshuffled
            assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(first, again, strict=True))
            (evaluated,) = _passes(val, epochs=1)
            for (rows, images), (val_rows, val_images) in zip(first, evaluated, strict=False):
                # the batches validated on, unaugmented (the last train one may be cut short)
                assert rows == val_rows[: len(rows)]
                assert np.array_equal(images, val_images[: len(rows)])
            seen += [r for rows, _ in evaluated for r in rows]
            datamodule.teardown("fit")
        assert len(lengths) == 1, f"n={n}, batch={batch_size}, world={world}: lengths {lengths}"
        assert sorted(seen) == list(range(n))  # validation: every train row once


@pytest.mark.slow
@pytest.mark.parametrize("n", [5, 7, 12])
def test_overfit_train_loader_has_equal_length_on_every_rank(n: int, tmp_path: Path) -> None:
    root = write_prepared(tmp_path / "prepared", n_train=n, n_valid=3)
    for world in (1, 2, 3):
        for batch_size in (1, 2, 3):
            _check_overfit(root, n, TorchLoader, batch_size, world)


def test_overfit_on_dali(tmp_path: Path) -> None:
    root = write_prepared(tmp_path / "prepared", n_train=7, n_valid=3)
    _check_overfit(root, 7, DaliLoader, batch_size=2, world=3)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [TorchLoader, DaliLoader])
def test_train_batches_counted_before_the_fit_are_the_loaders(backend: type, tmp_path: Path):
    """What sizes a resumed fit's schedule before the fit (build.fit_steps), on any rank."""
    root = write_prepared(tmp_path / "prepared", n_train=11, n_valid=3)
    for world in (1, 2, 3):
        for rank in range(world):
            for drop_last in (True, False):
                datamodule = _datamodule(root, backend, 3, drop_last, rank, world, 0)
                counted = datamodule.train_batches()
                assert counted == len(datamodule.train_dataloader())
                datamodule.teardown("fit")


def test_overfitting_leaves_the_final_evaluation_on_its_own_split(tmp_path: Path) -> None:
    # training and validation take the train split's fixed batches; the final evaluation (here
    # the valid split: the data has no test split) once read the 7 train rows instead
    root = write_prepared(tmp_path / "prepared", n_train=7, n_valid=3)
    datamodule = _datamodule(root, TorchLoader, batch_size=2, drop_last=False, rank=0, world=1)
    assert datamodule.final_split == "valid"
    assert sum(len(b["index"]) for b in datamodule.val_dataloader()) == 7
    assert [r for b in datamodule.test_dataloader() for r in b["index"].tolist()] == [0, 1, 2]
    datamodule.teardown("test")
