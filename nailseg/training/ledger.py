"""An audit of which CSV rows each rank saw (`callbacks=audit`): a `*/samples` count can be
right while the rows are wrong (one row twice, another never). Each rank keeps its rows (the
batch's `index`) on the device until the epoch ends, then writes its own file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch

from nailseg.io.folder import read_regular
from nailseg.training.run_folder import write_file


class SampleLedger(L.Callback):
    """Writes `<dirpath>/<stage>_epoch<EEE>_step<SSSSSSS>_rank<R>.json` for every train, val and
    test epoch on every rank: `rows`, the CSV rows the rank saw in order, and where it was."""

    def __init__(self, dirpath: str | Path) -> None:
        self.dirpath = Path(dirpath)
        self._rows: dict[str, list[torch.Tensor]] = {"train": [], "val": [], "test": []}

    def _record(self, trainer: L.Trainer, stage: str, batch: Mapping[str, torch.Tensor]) -> None:
        if not trainer.sanity_checking:
            self._rows[stage].append(batch["index"].detach())

    def _write(self, trainer: L.Trainer, stage: str) -> None:
        if trainer.sanity_checking:
            return
        chunks, self._rows[stage] = self._rows[stage], []
        rows = torch.cat(chunks).cpu().tolist() if chunks else []
        epoch, step, rank = trainer.current_epoch, trainer.global_step, trainer.global_rank
        entry = {"stage": stage, "epoch": epoch, "global_step": step, "rank": rank}
        entry |= {"world_size": trainer.world_size, "rows": rows}
        name = f"{stage}_epoch{epoch:03d}_step{step:07d}_rank{rank}.json"
        write_file(self.dirpath / name, json.dumps(entry).encode())

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._record(trainer, "train", args[2])  # (pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._record(trainer, "val", args[2])

    def on_test_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._record(trainer, "test", args[2])

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "train")

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "val")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "test")


def train_rows_once(dirpath: Path) -> str | None:
    """The ledger's verdict on training: "every row once in each of N epochs", or the first epoch
    where a rank is missing or a row was seen twice (rows `drop_last` leaves out are no error)."""
    entries = [json.loads(read_regular(p)) for p in sorted(Path(dirpath).glob("train_*.json"))]
    if not entries:
        return None
    epochs: dict[int, list[dict[str, Any]]] = {}
    for entry in entries:
        epochs.setdefault(entry["epoch"], []).append(entry)
    for epoch, ranks in sorted(epochs.items()):
        world = ranks[0]["world_size"]
        if sorted(e["rank"] for e in ranks) != list(range(world)):
            return f"epoch {epoch}: ranks {sorted(e['rank'] for e in ranks)} of {world} wrote rows"
        rows = [row for e in ranks for row in e["rows"]]
        if len(set(rows)) != len(rows):
            return f"epoch {epoch}: {len(rows) - len(set(rows))} rows seen twice"
    return f"every row once in each of {len(epochs)} epochs"
