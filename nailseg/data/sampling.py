"""Which CSV rows each rank yields in each epoch: the one plan every loader backend follows.

Train: one permutation seeded by (seed, epoch), identical on every rank, cut into equal shares of
floor(N / world_size) rows, then into batches, so every rank runs the same number of steps.
Over mixed sources (`sources`, `weights`) the epoch still has N samples, source k making up
exactly `source_shares` of them: each source's rows in seeded permutations laid end to end (no
row repeats before its source's every row came), merged in a random order.

Eval: rank r takes rows r, r + world_size, ...; nothing padded or dropped: every row once.
Unshuffled train (`trainer.overfit_batches`): eval's rows cut to the equal share.

Draws (`draws=True`): under each batch's rows, how often each row was drawn earlier in the whole
epoch's plan, so a repeated row is told apart whatever the number of ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

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
    sources: np.ndarray | None = None,
    weights: Sequence[float] | None = None,
    shuffle: bool = True,
    draws: bool = False,
) -> list[np.ndarray]:
    """The batches (int64 arrays of row indices) this rank yields this epoch.

    `drop_last` only applies to train; eval always keeps its last, partial batch. `sources` (a
    source id per row, every source with rows) and `weights` (finite, >= 0, one > 0) mix the
    shuffled train rows by source; eval and an unshuffled train plan ignore them. With `draws`
    each batch is a 2 x B array: its rows, then each row's earlier draws in the epoch.
    """
    share = n // world_size
    if train and shuffle:
        rng = np.random.default_rng((seed, epoch))
        if sources is not None and len(weights) > 1:
            order = _mixed_order(rng, np.asarray(sources), weights)
        else:
            order = rng.permutation(n)
        mine = slice(rank * share, (rank + 1) * share)
        rows = order[mine]
        drawn = _earlier_draws(order)[mine] if draws else None
    else:
        rows = np.arange(rank, n, world_size)[: share if train else None]
        drawn = np.zeros_like(rows) if draws else None  # each row at most once
    columns = np.stack([rows, drawn]) if draws else rows
    batches = [columns[..., i : i + batch_size] for i in range(0, len(rows), batch_size)]
    if train and drop_last and batches and batches[-1].shape[-1] < batch_size:
        batches.pop()
    return [b.astype(np.int64) for b in batches]


def _earlier_draws(order: np.ndarray) -> np.ndarray:
    """For each position of `order`, how many earlier positions hold the same row."""
    by_row = np.argsort(order, kind="stable")  # each row's positions, in epoch order
    sorted_rows = order[by_row]
    first = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]])
    runs = np.diff(np.r_[first, len(order)])
    drawn = np.empty(len(order), dtype=np.int64)
    drawn[by_row] = np.arange(len(order)) - np.repeat(first, runs)
    return drawn


def source_shares(total: int, weights: Sequence[float]) -> np.ndarray:
    """How many of an epoch's `total` samples each source makes up: total * w_k / sum(w),
    rounded down, the remainder going one each to the largest fractions (ties: the earlier
    source). Exact rational arithmetic, so the counts never depend on float rounding."""
    exact = [Fraction(total) * Fraction(w) / sum(Fraction(v) for v in weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    left = total - sum(counts)
    by_fraction = sorted(range(len(exact)), key=lambda k: (-(exact[k] - counts[k]), k))
    for k in by_fraction[:left]:
        counts[k] += 1
    return np.array(counts, dtype=np.int64)


def _mixed_order(
    rng: np.random.Generator, sources: np.ndarray, weights: Sequence[float]
) -> np.ndarray:
    """The epoch's samples over mixed sources, before sharding (see the module docstring)."""
    counts = source_shares(len(sources), weights)
    draws = []
    for k, count in enumerate(counts):
        rows = np.flatnonzero(sources == k)
        tiles = -(-int(count) // len(rows))  # 0 for a source whose share rounds to nothing
        draws.append(
            np.concatenate([rows[rng.permutation(len(rows))] for _ in range(tiles)] or [rows[:0]])
        )
    slots = rng.permutation(np.repeat(np.arange(len(counts)), counts))  # whose turn, each slot
    order = np.empty(len(sources), dtype=np.int64)
    for k, count in enumerate(counts):
        order[slots == k] = draws[k][:count]
    return order


def num_batches(
    n: int,
    batch_size: int,
    *,
    train: bool,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = True,
) -> int:
    """How many batches `epoch_batches` gives this rank (the same every epoch, mixed, shuffled
    or not: a mixed epoch has as many samples as rows)."""
    rows = n // world_size if train else len(range(rank, n, world_size))
    if train and drop_last:
        return rows // batch_size
    return -(-rows // batch_size)
