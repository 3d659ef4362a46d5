"""The ledger's training verdict on ledgers with known faults (the format SampleLedger writes)."""

from __future__ import annotations

import json
from pathlib import Path

from nailseg.training.ledger import train_rows_once


def _entry(folder: Path, epoch: int, rank: int, rows: list[int], world_size: int = 2) -> None:
    entry = {"stage": "train", "epoch": epoch, "global_step": 3 * (epoch + 1), "rank": rank,
             "world_size": world_size, "rows": rows}  # fmt: skip
    (folder / f"train_epoch{epoch:03d}_step{3 * (epoch + 1):07d}_rank{rank}.json").write_text(
        json.dumps(entry)
    )


def test_disjoint_shares_pass_and_each_fault_is_named(tmp_path):
    assert train_rows_once(tmp_path) is None  # nothing recorded
    for epoch, (a, b) in enumerate([([0, 2], [1, 3]), ([3, 1], [0, 4])]):
        _entry(tmp_path, epoch, 0, a)
        _entry(tmp_path, epoch, 1, b)
    assert train_rows_once(tmp_path) == "every row once in each of 2 epochs"
    _entry(tmp_path, 2, 0, [0, 1])
    assert train_rows_once(tmp_path) == "epoch 2: ranks [0] of 2 wrote rows"
    _entry(tmp_path, 2, 1, [1, 2])  # row 1 on both ranks
    assert train_rows_once(tmp_path) == "epoch 2: 1 rows seen twice"
    _entry(tmp_path, 2, 1, [2, 2])  # row 2 twice on one rank
    assert train_rows_once(tmp_path) == "epoch 2: 1 rows seen twice"
