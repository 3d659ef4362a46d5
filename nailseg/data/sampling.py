"""Which CSV rows each rank yields in each epoch: the one plan every loader backend follows.

Train: one permutation seeded by (seed, epoch), identical on every rank, cut into equal shares of
floor(N / world_size) rows (the few left over change every epoch), then into batches. Every rank
runs the same number of steps, which DDP needs.

Eval: no shuffle; rank r takes rows r, r + world_size, ...; nothing is padded or dropped, so
across ranks every row is seen exactly once and metrics are not skewed by duplicates.
"""

from __future__ import annotations

import numpy as np


def epoch_batches(
    n: int,
    batch_size: int,
    *,
    train: bool,
    seed: int = 0,
    epoch: int = 0,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = True,
) -> list[np.ndarray]:
    """The batches (int64 arrays of row indices) this rank yields this epoch.

    `drop_last` only applies to train; eval always keeps its last, partial batch.
    """
    _check(n, batch_size, seed, epoch, rank, world_size)
    if train:
        order = np.random.default_rng((seed, epoch)).permutation(n)
        share = n // world_size
        rows = order[rank * share : (rank + 1) * share]
    else:
        rows = np.arange(rank, n, world_size)
    batches = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    if train and drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return [b.astype(np.int64) for b in batches]


def num_batches(
    n: int,
    batch_size: int,
    *,
    train: bool,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = True,
) -> int:
    """How many batches `epoch_batches` gives this rank (the same every epoch)."""
    _check(n, batch_size, 0, 0, rank, world_size)
    rows = n // world_size if train else len(range(rank, n, world_size))
    if train and drop_last:
        return rows // batch_size
    return -(-rows // batch_size)


def _check(n: int, batch_size: int, seed: int, epoch: int, rank: int, world_size: int) -> None:
    if n < 0 or batch_size < 1:
        raise ValueError(f"need n >= 0 and batch_size >= 1, got n={n}, batch_size={batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0 (they seed numpy), got {seed}, {epoch}")
