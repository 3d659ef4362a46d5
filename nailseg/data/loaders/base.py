"""What every loader backend shares: the batch contract, a split's files read and checked once,
this rank's epoch plan (sampling.py) and the bookkeeping of passes.

Every `iter()` of a `PlannedLoader` is one full, fresh pass, started at its first `next()`
(Lightning probes with an unused `iter()`); starting a pass ends any unfinished one. A pass
shuffles as the epoch given to `set_epoch`, else as one more than the previous pass.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pandas as pd
import torch

from nailseg.data.sampling import epoch_batches, num_batches
from nailseg.device import resolve_device
from nailseg.prep.format import SplitFileError

Batch = dict[str, torch.Tensor]  # the batch contract: image, mask, group, index
SOURCE = "source"  # the column of records that mix sources: each row's source id


class DataError(SplitFileError):
    """Prepared data that is not as prepare writes it; the message names the file."""

    def __init__(self, message: str) -> None:
        # torch re-raises a worker's error as its type made from the worker's traceback, whose
        # last line is `module.DataError: <message>`: that message alone is kept
        if message.startswith("Caught DataError"):
            message = message.rstrip().rsplit("\n", 1)[-1].split(": ", 1)[-1]
        super().__init__(message)


@contextlib.contextmanager
def _plain_file(path: str) -> Iterator[BinaryIO]:
    """The plain file at `path`, open; a FIFO (reading it would wait forever), folder or device
    is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise DataError(f"{path}: {err.strerror}; prepare the data again") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DataError(f"{path} is not a plain file, so it is not read")
        yield f


def _header(f: BinaryIO, path: str, channels: int) -> tuple[int, ...]:
    """The shape of the npy open as `f` (left at its data), checked to be what prepare writes:
    npy 1.0 (what DALI decodes), a C-order uint8 HxWx`channels` array, every byte there."""
    try:
        if np.lib.format.read_magic(f) != (1, 0):
            raise ValueError("another npy format version")
        shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
    except ValueError as err:
        raise DataError(
            f"{path}: not an npy file of format 1.0, which DALI decodes ({err})"
        ) from None
    if dtype != np.uint8 or fortran_order or len(shape) != 3 or shape[2] != channels:
        raise DataError(
            f"{path}: expected a C-order uint8 HxWx{channels} array, got dtype {dtype}, "
            f"shape {shape}, fortran_order={fortran_order}"
        )
    size, expected = os.fstat(f.fileno()).st_size, f.tell() + math.prod(shape)
    if size != expected:
        raise DataError(f"{path}: {size} bytes where its header needs {expected}: damaged")
    return shape


def read_npy(path: str, channels: int) -> np.ndarray:
    """A prepared image (3 channels) or mask (1 channel: values 0 and 1 only) read and checked."""
    with _plain_file(path) as f:
        shape = _header(f, path, channels)
        array = np.fromfile(f, np.uint8).reshape(shape)
    if channels == 1 and array.max(initial=0) > 1:
        found = np.unique(array)[:4].tolist()
        raise DataError(
            f"{path}: a mask holds values {found}, not only 0 (background) and 1 (nail); "
            "prepare the data with prepare.py, which writes them so"
        )
    return array


@dataclass(frozen=True)
class Records:
    """A split's files, checked up front: a bad file fails with its name, not mid-epoch."""

    images: list[str]
    masks: list[str]
    groups: np.ndarray  # int64 group id per row
    sizes: np.ndarray  # int64 (height, width) per row
    mix: tuple[np.ndarray, list[float]] | None  # source per row and weight per source


MASKS_SAMPLED = 16  # the masks whose values are checked up front, evenly spread over the rows


def read_records(
    records: pd.DataFrame,
    root: Path,
    group_ids: Mapping[str, int],
    weights: Sequence[float] | None = None,
) -> Records:
    """The rows' files under `root` (or absolute), each header checked, a sample of the masks
    read whole (the torch backends check each mask they read); rows that mix sources carry
    their source's id in `SOURCE`, `weights` each source's weight."""
    unknown = sorted(set(records["group"]) - set(group_ids))
    if unknown:
        raise ValueError(f"groups {unknown} have no id in group_ids {dict(group_ids)}")
    images = [str(Path(root, rel)) for rel in records["images"]]
    masks = [str(Path(root, rel)) for rel in records["masks"]]
    sizes = []
    for image, mask in zip(images, masks, strict=True):
        with _plain_file(image) as f, _plain_file(mask) as g:
            size = _header(f, image, 3)[:2]
            if size != _header(g, mask, 1)[:2]:
                raise DataError(f"{image} and {mask} differ in height or width")
        sizes.append(size)
    for row in (
        np.unique(np.linspace(0, len(masks) - 1, MASKS_SAMPLED).astype(int)) if masks else ()
    ):
        read_npy(masks[row], 1)
    groups = np.array([group_ids[g] for g in records["group"]], dtype=np.int64)
    sizes_ = np.array(sizes, dtype=np.int64).reshape(-1, 2)
    mix = None
    if weights is not None:
        mix = (records[SOURCE].to_numpy(), list(weights))
    return Records(images, masks, groups, sizes_, mix)


class PlannedLoader(ABC):
    """A backend's shared half: records, device, plan, exact length and passes. Yields the batch
    contract (docs/DESIGN.md) on `device` (auto | cpu | gpu)."""

    MIN_WORKERS = 0  # the fewest `num_workers` a backend takes (0: the main process reads)

    def __init__(
        self,
        records: Records,
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
        self.records = records
        n = len(records.images)
        shard = {"rank": rank, "world_size": world_size, "drop_last": drop_last}
        self._len = num_batches(n, batch_size, train=train, **shard)
        # eval sees every row once, unweighted; an unshuffled train plan its fixed rows
        mix = records.mix if train and shuffle else None
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
