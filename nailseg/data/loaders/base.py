"""What the DataLoader-based backends (torch, kornia) share: records, dataset, epoch plan, passes.

* Order and sharding come from `sampling.epoch_batches` through a batch sampler, so these backends
  follow the same plan as DALI: `len()` is exact, eval sees every row once across ranks.
* Each sampled index is a (row, epoch) pair and a sample's randomness is seeded by
  (seed, epoch, row), so a seed gives the same batches whatever the number of workers, and
  persistent workers need no epoch pushed to them.
* Every `iter()` is one full, fresh pass, started at its first `next()` (Lightning probes with an
  unused `iter()`); starting a pass ends any unfinished one, whose iterator then stops.
* The DataLoader and its iterator are owned by a `weakref.finalize`, never only by the loader:
  Lightning keeps loaders in reference cycles, and a DataLoader collected as cyclic garbage has its
  queues closed before its workers are told to stop, so each worker costs a 5 s join timeout.
  Through the finalizer they are dropped by reference count, and workers stop at once.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from nailseg.data.augment import AugSpec
from nailseg.data.loaders.sampling import epoch_batches, num_batches

Key = tuple[int, int]  # (CSV row, epoch)
Batch = dict[str, torch.Tensor]  # the batch contract: image, mask, group, index


def resolve_device(device: str) -> str:
    """'auto' -> 'gpu' when torch sees CUDA, else 'cpu'; 'cpu' and 'gpu' pass through."""
    if device == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "gpu"):
        raise ValueError(f"loader.device must be 'auto', 'cpu' or 'gpu', got {device!r}")
    return device


def npy_shape(path: Path, channels: int) -> tuple[int, int]:
    """(height, width) of a prepared .npy, after checking it is what the decoder expects."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version != (1, 0):
            raise ValueError(f"{path}: npy format {version}, DALI's decoder reads only 1.0")
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
    if dtype != np.uint8 or fortran_order or len(shape) != 3 or shape[2] != channels:
        raise ValueError(
            f"{path}: expected a C-order uint8 HxWx{channels} array, got dtype {dtype}, "
            f"shape {shape}, fortran_order={fortran_order}"
        )
    return shape[0], shape[1]


class SampleTransform(Protocol):
    """Per-sample CPU work run in the workers: uint8 HxWx3 image and HxW mask in, CHW arrays out."""

    def __call__(
        self, image: np.ndarray, mask: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]: ...

    def worker_init(self, worker_id: int) -> None: ...


# The device-side step of a backend: (batch on the device, its CSV rows as a host array, a seed for
# its random draws) -> the batch. The host rows spare a device-to-host copy, which would wait for
# the training step still running on the device. The batch's tensors are the step's to modify.
BatchTransform = Callable[[Batch, np.ndarray, int], Batch]


def torch_device(device: str) -> torch.device:
    """'auto' | 'cpu' | 'gpu' (as for DALI) -> the torch device that batches are moved to."""
    if resolve_device(device) == "gpu":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class Records:
    """The split's files, checked once up front so a bad file fails with its name, not mid-epoch."""

    images: list[str]
    masks: list[str]
    groups: np.ndarray  # int64 group id per row
    sizes: np.ndarray  # int64 (height, width) per row


def read_records(records: pd.DataFrame, root: Path, group_ids: Mapping[str, int]) -> Records:
    unknown = sorted(set(records["group"]) - set(group_ids))
    if unknown:
        raise ValueError(f"groups {unknown} have no id in group_ids {dict(group_ids)}")
    root = Path(root)
    images, masks, sizes = [], [], []
    for image_rel, mask_rel in zip(records["images"], records["masks"], strict=True):
        image_path, mask_path = root / image_rel, root / mask_rel
        size = npy_shape(image_path, 3)
        if size != npy_shape(mask_path, 1):
            raise ValueError(f"{image_path} and {mask_path} differ in height or width")
        images.append(str(image_path))
        masks.append(str(mask_path))
        sizes.append(size)
    groups = np.array([group_ids[g] for g in records["group"]], dtype=np.int64)
    return Records(images, masks, groups, np.array(sizes, dtype=np.int64).reshape(-1, 2))


class NpyDataset(Dataset):
    """Prepared samples indexed by (row, epoch); the transform draws from a (seed, epoch, row) rng."""

    def __init__(self, records: Records, transform: SampleTransform, seed: int) -> None:
        self.records, self.transform, self.seed = records, transform, seed

    def __len__(self) -> int:
        return len(self.records.images)

    def __getitem__(self, key: Key) -> dict[str, torch.Tensor | int]:
        row, epoch = key
        image = np.load(self.records.images[row], allow_pickle=False)
        mask = np.load(self.records.masks[row], allow_pickle=False)[..., 0]
        rng = np.random.default_rng((self.seed, epoch, row))
        image, mask = self.transform(image, mask, rng)
        return {
            "image": torch.from_numpy(image),
            "mask": torch.from_numpy(mask),
            "group": int(self.records.groups[row]),
            "index": row,
        }


class PlanSampler(Sampler[list[Key]]):
    """Batch sampler: `epoch_batches` for `epoch`, each row paired with the epoch it is drawn in."""

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        train: bool,
        seed: int,
        rank: int,
        world_size: int,
        drop_last: bool,
    ) -> None:
        self.n, self.batch_size, self.train, self.seed = n, batch_size, train, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.epoch = 0
        self._len = num_batches(
            n, batch_size, train=train, rank=rank, world_size=world_size, drop_last=drop_last
        )

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[list[Key]]:
        epoch = self.epoch
        plan = epoch_batches(
            self.n,
            self.batch_size,
            train=self.train,
            seed=self.seed,
            epoch=epoch,
            rank=self.rank,
            world_size=self.world_size,
            drop_last=self.drop_last,
        )
        for rows in plan:
            yield [(int(row), epoch) for row in rows]


class _Workers:
    """The DataLoader and the running pass's iterator; the only owner, so dropping them here stops
    the workers (a non-persistent iterator's at once, persistent ones' with the DataLoader)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader: DataLoader | None = loader
        self.it: Iterator | None = None

    def release(self) -> None:
        self.it = self.loader = None


class WorkerLoader(ABC):
    """A torch DataLoader over the prepared files in the batch contract, Lightning-safe.

    Yields {"image": float32 Bx3xHxW normalised, "mask": float32 Bx1xHxW in {0, 1},
    "group": int64 B, "index": int64 B (the CSV row)} on `device` ('auto' | 'cpu' | 'gpu').
    Subclasses say what runs in the workers and what runs on the device (`_transforms`).
    `num_workers`, `pin_memory` (on CUDA only) and `persistent_workers` are the DataLoader's;
    `prefetch` is its batches in flight per worker. A pass shuffles as the epoch given to
    `set_epoch`, else as one more than the previous pass.
    """

    def __init__(
        self,
        records: pd.DataFrame,
        root: Path,
        spec: AugSpec,
        *,
        train: bool,
        batch_size: int,
        image_size: tuple[int, int],
        group_ids: Mapping[str, int],
        device: str = "auto",
        num_workers: int = 2,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        prefetch: int = 2,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
    ) -> None:
        self.train, self.batch_size, self.seed = train, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.device = torch_device(device)
        self.records = read_records(records, root, group_ids)
        size = (int(image_size[0]), int(image_size[1]))
        sample_transform, self._batch_transform = self._transforms(spec, size)
        self._sampler = PlanSampler(
            len(records),
            batch_size,
            train=train,
            seed=seed,
            rank=rank,
            world_size=world_size,
            drop_last=drop_last,
        )
        workers = num_workers > 0
        self._workers = _Workers(
            DataLoader(
                NpyDataset(self.records, sample_transform, seed),
                batch_sampler=self._sampler,
                num_workers=num_workers,
                pin_memory=pin_memory and self.device.type == "cuda",
                persistent_workers=persistent_workers and workers,
                prefetch_factor=prefetch if workers else None,
                worker_init_fn=sample_transform.worker_init if workers else None,
            )
        )
        self._release = weakref.finalize(self, self._workers.release)
        self._pass = 0  # id of the current pass; a generator of an older one stops
        self._epoch = 0

    @abstractmethod
    def _transforms(
        self, spec: AugSpec, image_size: tuple[int, int]
    ) -> tuple[SampleTransform, BatchTransform | None]:
        """The per-sample work for the workers, and the per-batch work on the device (or None)."""

    def __len__(self) -> int:
        return len(self._sampler)

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next pass as epoch `epoch` (Lightning-style callers set it each epoch)."""
        self._epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        """One full pass; it starts at the first `next()`, so an unused iterator costs nothing."""
        workers = self._workers
        if workers.loader is None:
            raise RuntimeError(f"this {type(self).__name__} was closed")
        self._pass += 1
        pass_id, epoch = self._pass, self._epoch
        self._epoch += 1
        self._sampler.epoch = epoch
        # Replacing the old pass's iterator frees its workers (persistent ones are reset and
        # drained instead). Only `workers.it` holds it, never a local across a yield.
        workers.it = iter(workers.loader)
        step = 0
        while pass_id == self._pass:
            try:
                batch = next(workers.it)
            except StopIteration:
                workers.it = None
                return
            yield self._finish(batch, epoch, step)
            step += 1

    def _finish(self, batch: dict[str, torch.Tensor], epoch: int, step: int) -> Batch:
        """Move to the device (masks travel as uint8: a quarter of the bytes), then the device step."""
        rows = batch["index"].numpy()
        batch = {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}
        batch["mask"] = batch["mask"].float()
        if self._batch_transform is None:
            return batch
        # Differently seeded per rank, so ranks do not draw identical augmentations.
        seed = np.random.SeedSequence((self.seed, self.rank, epoch, step)).generate_state(1)[0]
        return self._batch_transform(batch, rows, int(seed))

    def close(self) -> None:
        """Release the workers now rather than at garbage collection; the loader is done."""
        self._pass += 1
        self._release()
