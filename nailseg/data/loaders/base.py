"""What every loader backend shares: the batch contract, the split's records read and checked once,
this rank's epoch plan (sampling.py) and the bookkeeping of passes.

Every backend is a `PlannedLoader` and follows the same plan: `len()` is exact, and evaluation
sees every row once across ranks. Every `iter()` is one full, fresh pass, started at its first
`next()` (Lightning probes with an unused `iter()`); starting a pass ends any unfinished one. A
pass shuffles as the epoch given to `set_epoch`, else as one more than the previous pass.
Records that mix sources carry the columns `SOURCE` and `SOURCE_WEIGHT` (datamodule.py), by
which a shuffled train plan draws each source's share of every epoch.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import pandas as pd
import torch

from nailseg.data.sampling import check_sources, epoch_batches, num_batches
from nailseg.device import resolve_device

Batch = dict[str, torch.Tensor]  # the batch contract: image, mask, group, index
SOURCE, SOURCE_WEIGHT = "source", "source_weight"  # the columns of records that mix sources


@runtime_checkable
class Loader(Protocol):
    """The contract the datamodule and Lightning rely on, whatever the backend."""

    def __iter__(self) -> Iterator[Batch]: ...

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def close(self) -> None: ...


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


def read_sources(records: pd.DataFrame) -> tuple[np.ndarray, list[float]] | None:
    """(source id per row, weight per source) of records that mix sources, else None."""
    if SOURCE not in records.columns:
        return None
    sources = records[SOURCE].to_numpy(dtype=np.int64)
    row_weights = records[SOURCE_WEIGHT].to_numpy(dtype=np.float64)
    weights = []
    for k in range(int(sources.max()) + 1 if len(sources) else 0):
        distinct = np.unique(row_weights[sources == k])
        if len(distinct) != 1:
            raise ValueError(
                f"source {k} needs one {SOURCE_WEIGHT} on all its rows, got {distinct}"
            )
        weights.append(float(distinct[0]))
    return check_sources(len(sources), sources, weights), weights


class PlannedLoader(ABC):
    """A backend's shared half: records, device, plan, length and passes (see the module
    docstring). Yields {"image": float32 Bx3xHxW normalised, "mask": float32 Bx1xHxW in {0, 1},
    "group": int64 B, "index": int64 B (the CSV row)} on `device` (auto | cpu | gpu)."""

    MIN_WORKERS = 0  # the fewest `num_workers` a backend takes (0: the main process reads)

    def __init__(
        self,
        records: pd.DataFrame,
        root: Path,
        group_ids: Mapping[str, int],
        *,
        train: bool,
        batch_size: int,
        device: str,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        shuffle: bool = True,
    ) -> None:
        self.train, self.batch_size, self.seed = train, batch_size, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.device = resolve_device(device)
        self.records = read_records(records, root, group_ids)
        n = len(self.records.images)
        shard = {"rank": rank, "world_size": world_size, "drop_last": drop_last}
        self._len = num_batches(n, batch_size, train=train, **shard)
        # eval sees every row once, unweighted; an unshuffled train plan its fixed rows
        mix = read_sources(records) if train and shuffle else None
        if mix is not None:
            shard |= {"sources": mix[0], "weights": mix[1]}
        # a plain function of the epoch: what holds it (a sampler) does not hold the loader
        self.plan: Callable[..., list[np.ndarray]] = functools.partial(
            epoch_batches, n, batch_size, train=train, seed=seed, shuffle=shuffle, **shard
        )
        self._pass = 0  # id of the current pass; a generator of an older one stops
        self._epoch = 0

    def __len__(self) -> int:
        return self._len

    def set_epoch(self, epoch: int) -> None:
        """Shuffle the next pass as epoch `epoch` (Lightning-style callers set it each epoch)."""
        self._epoch = epoch

    def _begin_pass(self) -> tuple[int, int]:
        """Start a pass, ending any older one: (its id, the epoch it shuffles as)."""
        self._pass += 1
        epoch, self._epoch = self._epoch, self._epoch + 1
        return self._pass, epoch

    def _is_current(self, pass_id: int) -> bool:
        return pass_id == self._pass

    def close(self) -> None:
        """Release threads, workers and buffers now rather than at garbage collection."""
        self._pass += 1
        self._free()

    @abstractmethod
    def __iter__(self) -> Iterator[Batch]:
        """One full pass (see the module docstring)."""

    @abstractmethod
    def _free(self) -> None:
        """Release what the backend holds; it is not used again."""
