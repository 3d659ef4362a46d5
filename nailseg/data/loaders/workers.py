"""The DataLoader backends' shared half (torch: the spec in the workers; kornia: on the device).

* The plan reaches the DataLoader through a batch sampler (`PlanSampler`) of (row, epoch, draw)
  keys, `draw` counting the row's earlier draws in the whole epoch's plan; a sample's randomness
  is seeded by (seed, epoch, row, draw), so it does not depend on the number of workers or ranks,
  a repeated row gets fresh augmentation, and persistent workers need no epoch pushed to them.
* The DataLoader and its iterator are owned by a `weakref.finalize`, never only by the loader:
  Lightning keeps loaders in reference cycles, and a DataLoader collected as cyclic garbage waits
  out its workers' join timeout; dropped by reference count, the workers stop at once.
"""

from __future__ import annotations

import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from nailseg.collector import frozen_heap
from nailseg.data.augment import AugSpec
from nailseg.data.loaders.base import Batch, PlannedLoader, Records, read_npy

Key = tuple[int, int, int]  # (CSV row, epoch, earlier draws of the row in the epoch's plan)


class SampleTransform(Protocol):
    """Per-sample CPU work run in the workers: uint8 HxWx3 image and HxW mask in, CHW arrays out."""

    def __call__(
        self, image: np.ndarray, mask: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def worker_init(self, worker_id: int) -> None: ...


# The device-side step of a backend: (batch on the device, its CSV rows on the host, so no copy
# waits for the device; a seed for its draws) -> the batch, whose tensors it may modify.
BatchTransform = Callable[[Batch, np.ndarray, int], Batch]


class NpyDataset(Dataset):
    """Prepared samples indexed by (row, epoch, draw); the transform draws from a
    (seed, epoch, row, draw) rng."""

    def __init__(self, records: Records, transform: SampleTransform, seed: int) -> None:
        self.records, self.transform, self.seed = records, transform, seed

    def __len__(self) -> int:
        return len(self.records.images)

    def __getitem__(self, key: Key) -> dict[str, torch.Tensor | int]:
        row, epoch, draw = key
        image = read_npy(self.records.images[row], 3)
        mask = read_npy(self.records.masks[row], 1)[..., 0]
        rng = np.random.default_rng((self.seed, epoch, row, draw))
        image, mask = self.transform(image, mask, rng)
        return {
            "image": torch.from_numpy(image),
            "mask": torch.from_numpy(mask),
            "group": int(self.records.groups[row]),
            "index": row,
        }


class PlanSampler(Sampler[list[Key]]):
    """Batch sampler: the loader's plan for `epoch`, each row with the epoch it is drawn in and
    its earlier draws in that epoch's whole plan (`plan` gives batches with `draws`: the counts
    of one rank's batches alone would repeat a key on two ranks). It holds the plan, never the
    loader (see the module docstring)."""

    def __init__(self, plan: Callable[..., list[np.ndarray]], length: int) -> None:
        self._plan, self._len = plan, length
        self.epoch = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[list[Key]]:
        epoch = self.epoch
        for rows, draws in self._plan(epoch=epoch, draws=True):
            yield [
                (row, epoch, draw) for row, draw in zip(rows.tolist(), draws.tolist(), strict=True)
            ]


class _Workers:
    """The DataLoader and the running pass's iterator; the only owner, so dropping them here stops
    the workers (a non-persistent iterator's at once, persistent ones' with the DataLoader)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader: DataLoader | None = loader
        self.it: Iterator | None = None

    def release(self) -> None:
        self.it = self.loader = None


class WorkerLoader(PlannedLoader):
    """A torch DataLoader over the prepared files in the batch contract, Lightning-safe.

    Subclasses say what runs in the workers and what runs on the device (`_transforms`).
    `num_workers`, `pin_memory` (on CUDA only) and `persistent_workers` are the DataLoader's;
    `prefetch` is its batches in flight per worker.
    """

    def __init__(
        self,
        records: Records,
        spec: AugSpec,
        *,
        image_size: tuple[int, int],
        num_workers: int,
        pin_memory: bool,
        persistent_workers: bool,
        prefetch: int,
        **plan: Any,
    ) -> None:
        """`plan`: `PlannedLoader`'s keyword arguments."""
        super().__init__(records, **plan)
        size = (int(image_size[0]), int(image_size[1]))
        sample_transform, self._batch_transform = self._transforms(spec, size)
        self._sampler = PlanSampler(self.plan, len(self))
        workers = num_workers > 0
        self._workers = _Workers(
            DataLoader(
                NpyDataset(self.records, sample_transform, self.seed),
                batch_sampler=self._sampler,
                num_workers=num_workers,
                pin_memory=pin_memory and self.device.type == "cuda",
                persistent_workers=persistent_workers and workers,
                prefetch_factor=prefetch if workers else None,
                worker_init_fn=sample_transform.worker_init if workers else None,
            )
        )
        self._release = weakref.finalize(self, self._workers.release)

    @abstractmethod
    def _transforms(
        self, spec: AugSpec, image_size: tuple[int, int]
    ) -> tuple[SampleTransform, BatchTransform | None]:
        """The per-sample work for the workers, and the per-batch work on the device (or None)."""

    def __iter__(self) -> Iterator[Batch]:
        """One full pass; it starts at the first `next()`, so an unused iterator costs nothing."""
        workers = self._workers
        if workers.loader is None:
            raise RuntimeError(f"this {type(self).__name__} was closed")
        pass_id, epoch = self._begin_pass()
        self._sampler.epoch = epoch
        # Replacing the old pass's iterator frees its workers (persistent ones are reset and
        # drained instead). Only `workers.it` holds it, never a local across a yield.
        with frozen_heap():  # workers forked here never collect (and finalize) our garbage
            workers.it = iter(workers.loader)
        step = 0
        while self._is_current(pass_id):
            try:
                batch = next(workers.it)
            except StopIteration:
                workers.it = None
                return
            yield self._finish(batch, epoch, step)
            step += 1

    def _free(self) -> None:
        self._release()

    def _finish(self, batch: dict[str, torch.Tensor], epoch: int, step: int) -> Batch:
        """Move to the device (masks travel as uint8: a quarter of the bytes), then the device step."""
        rows = batch["index"].numpy()
        batch = {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}
        batch["mask"] = batch["mask"].float()
        if self._batch_transform is None:
            return batch
        # seeded per rank, so ranks do not draw identical augmentations
        seed = np.random.SeedSequence((self.seed, self.rank, epoch, step)).generate_state(1)[0]
        return self._batch_transform(batch, rows, int(seed))
