"""The loader contract, one test class every backend inherits (as smp's BaseModelTester serves every
architecture): a new backend is covered by subclassing `LoaderContract` with its `kind`.

The contract: `iter`, `len`, `set_epoch`, `close`; `len()` equals the batches a pass yields; a
pass follows the epoch plan (data/sampling.py) and `set_epoch`; evaluation sees every row once
across ranks; an abandoned pass is ended by the next one; Lightning's probes, sanity check and
batch limits never cost a sample; a seed gives the same batches; batches keep the batch contract;
a closed loader says so.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from support.loaders import EVERYTHING, Outputs, make_loader, run, spec

from nailseg.data.loaders.base import PlannedLoader
from nailseg.data.loaders.torch_workers import OpenCVTransform
from nailseg.data.sampling import epoch_batches


class LoaderContract:
    kind: ClassVar[str]
    other_workers: ClassVar[dict[str, Any]] = {}  # a second way to build it, same batches

    def test_keeps_the_batch_contract_and_says_when_closed(self, prepared: Path) -> None:
        loader = make_loader(self.kind, prepared, EVERYTHING, batch_size=4)
        assert isinstance(loader, PlannedLoader)
        batch = next(iter(loader))
        assert batch["image"].dtype == torch.float32 and batch["image"].shape == (4, 3, 32, 32)
        assert batch["mask"].dtype == torch.float32 and batch["mask"].shape == (4, 1, 32, 32)
        assert set(batch["mask"].unique().tolist()) <= {0.0, 1.0}
        assert batch["group"].dtype == batch["index"].dtype == torch.int64
        loader.close()
        with pytest.raises(RuntimeError, match="closed"):
            next(iter(loader))

    def test_same_seed_same_batches(self, prepared: Path) -> None:
        """Run to run; for the DataLoader backends also with worker processes instead of none."""

        def batches(seed: int, **kwargs) -> Outputs:
            loader = make_loader(self.kind, prepared, EVERYTHING, batch_size=4, seed=seed, **kwargs)
            return run(loader, epochs=2)

        first = batches(3)
        again = batches(3, **self.other_workers)
        assert (first.rows == again.rows).all()
        assert (first.images == again.images).all() and (first.masks == again.masks).all()
        assert not np.array_equal(batches(4).images, first.images)

    def test_len_equals_batches_yielded(self, prepared: Path) -> None:
        for split, world, drop_last in [
            ("train", 1, True),
            ("train", 2, False),
            ("valid", 3, True),
        ]:
            for rank in range(world):
                loader = make_loader(
                    self.kind,
                    prepared,
                    spec(),
                    split,
                    batch_size=4,
                    rank=rank,
                    world_size=world,
                    drop_last=drop_last,
                )
                assert len(loader) == sum(1 for _ in loader) == sum(1 for _ in loader)
                loader.close()

    @pytest.mark.parametrize("world", [1, 2, 3])
    def test_eval_covers_every_row_once(self, world: int, prepared: Path) -> None:
        rows = []
        for rank in range(world):
            loader = make_loader(
                self.kind, prepared, spec(), "valid", batch_size=2, rank=rank, world_size=world
            )
            for _ in range(2):  # a second pass covers the shard again
                pass_rows = []
                for batch in loader:
                    index = batch["index"]
                    assert (
                        batch["mask"][:, 0, 0, 0] == (index % 2).float()
                    ).all()  # conftest's tag
                    pass_rows += index.tolist()
                assert pass_rows == list(range(rank, 5, world))
            rows += pass_rows
            loader.close()
        assert sorted(rows) == list(range(5))

    def test_loader_follows_the_plan_and_set_epoch(self, prepared: Path) -> None:
        loader = make_loader(self.kind, prepared, EVERYTHING, batch_size=3, seed=7)
        loader.set_epoch(5)
        iter(loader)  # a probe never advanced (Lightning does this) starts no pass, uses no epoch
        got = [b["index"].tolist() for b in loader]
        assert got == [b.tolist() for b in epoch_batches(12, 3, train=True, seed=7, epoch=5)]
        got_next = [b["index"].tolist() for b in loader]  # no set_epoch: the next epoch
        assert got_next == [b.tolist() for b in epoch_batches(12, 3, train=True, seed=7, epoch=6)]

    def test_abandoned_pass_then_full_pass(self, prepared: Path) -> None:
        loader = make_loader(self.kind, prepared, EVERYTHING, batch_size=2)
        assert len(loader) == 6
        for _ in range(3):
            next(iter(loader))  # abandoned after 1 batch, like limit_train_batches=1
            rows = [i for batch in loader for i in batch["index"].tolist()]
            assert sorted(rows) == list(range(12))
        stale, fresh = iter(loader), iter(loader)
        next(stale)
        first = next(fresh)  # starting a new pass supersedes the old one
        assert list(stale) == []
        assert 1 + sum(1 for _ in fresh) == 6
        assert len(first["index"]) == 2
        loader.close()

    def test_lightning_sanity_check_and_batch_limits_keep_passes_full(
        self, prepared: Path, tmp_path: Path
    ) -> None:
        import lightning as L

        class Probe(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.weight = torch.nn.Parameter(torch.zeros(1))
                self.train_rows: list[list[int]] = []
                self.val_rows: list[list[int]] = []

            def training_step(self, batch: dict, _: int) -> torch.Tensor:
                self.train_rows.append(batch["index"].tolist())
                return (self.weight * batch["image"].mean()).sum()

            def on_validation_epoch_start(self) -> None:
                self.val_rows.append([])

            def validation_step(self, batch: dict, _: int) -> None:
                self.val_rows[-1] += batch["index"].tolist()

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.1)

        train = make_loader(self.kind, prepared, EVERYTHING, batch_size=4, seed=3)
        valid = make_loader(self.kind, prepared, spec(), "valid", batch_size=2)
        probe = Probe()
        trainer = L.Trainer(
            max_epochs=3,
            limit_train_batches=1,  # abandons every train pass after 1 of 3 batches
            num_sanity_val_steps=1,  # abandons the first validation pass after 1 of 3 batches
            accelerator="cpu",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(probe, train_dataloaders=train, val_dataloaders=valid)
        train.close()  # DALI threads left running would be inherited by a later fork
        valid.close()
        first = [epoch_batches(12, 4, train=True, seed=3, epoch=e)[0].tolist() for e in range(3)]
        assert probe.train_rows == first  # each epoch starts a fresh, reshuffled pass
        assert len(probe.val_rows) == 4  # sanity check + 3 epochs
        assert all(sorted(rows) == list(range(5)) for rows in probe.val_rows[1:])


class TestDaliLoader(LoaderContract):
    kind = "dali"


class TestTorchLoader(LoaderContract):
    kind = "torch"
    other_workers: ClassVar[dict[str, Any]] = {"num_workers": 2}


@pytest.mark.slow  # worker processes start
class TestTorchLoaderWithWorkers(LoaderContract):
    kind = "torch-workers"

    @pytest.mark.parametrize("persistent", [True, False])
    def test_workers_stop_promptly_when_collected_in_a_cycle(
        self, persistent: bool, prepared: Path
    ) -> None:
        """Lightning holds loaders in reference cycles; collecting one must not wait out each
        worker's 5 s join timeout (what a DataLoader collected as cyclic garbage does)."""
        loader = make_loader(
            "torch-workers", prepared, spec(), batch_size=2, persistent_workers=persistent
        )
        next(iter(loader))  # workers started, a pass abandoned with batches in flight
        loader.cycle = loader
        del loader
        start = time.perf_counter()
        gc.collect()
        # the fault waits >= 5 s (one worker's timeout); a prompt stop is well under a second,
        # so the bound only needs to tell the two apart, also on a machine under load
        assert time.perf_counter() - start < 4.5


def test_a_worker_never_collects_what_it_inherited(prepared, tmp_path, monkeypatch):
    """A forked worker collected the parent's garbage and ran its finalizers: a DALI pipeline
    left in a reference cycle was destroyed in a torch worker, which hung in DALI's executor
    destructor or died of a segmentation fault (2 of 4 CI runs). Everything a worker inherits is
    frozen for its collector; the parent's own collector is back as it was once they started."""

    worker_init = OpenCVTransform.worker_init

    def report(worker_id: int) -> None:  # runs in the worker, as the loader's worker_init does
        (tmp_path / f"worker{worker_id}").write_text(str(gc.get_freeze_count()))
        worker_init(worker_id)

    monkeypatch.setattr(OpenCVTransform, "worker_init", staticmethod(report))
    loader = make_loader("torch-workers", prepared, spec(), batch_size=2)
    assert len(list(loader)) >= 2  # a whole pass: both workers started and took a batch
    frozen = [int((tmp_path / f"worker{i}").read_text()) for i in range(2)]
    loader.close()
    assert min(frozen) > 100_000  # the test process's objects: torch, numpy, pytest, ...
    assert gc.get_freeze_count() == 0


class TestKorniaLoader(LoaderContract):
    kind = "kornia"
    other_workers: ClassVar[dict[str, Any]] = {"num_workers": 2}
