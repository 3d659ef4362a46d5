"""Read the history rows of an offline W&B run (`run-<id>.wandb`) to check what a run logged.

The file is a LevelDB-style log: a 7-byte file header, then 32 KiB blocks of chunks, each with a
7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and a protobuf `Record`.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7


def _records(path: Path):
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 2):
            pending = chunk
        else:
            pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def complete_records(path: Path, timeout: float = 60.0) -> list[pb.Record]:
    """The file's records once W&B's service process has written its last one (`exit`): the
    service writes the file, and `finish()` can return before the tail is on disk."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = list(_records(path))
        except DecodeError:  # a chunk still being written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: no exit record after {timeout:.0f} s")
        time.sleep(0.2)


def history(run_file: Path) -> list[dict]:
    """Every history row the run logged, as {key: value}."""
    rows = []
    for record in complete_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
    return rows


def run_record(run_file: Path):
    """The run's own record: id, group, display name, config."""
    for record in complete_records(run_file):
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise ValueError(f"{run_file}: no run record")


def run_id(run_file: Path) -> str:
    return run_record(run_file).run_id


def summary(run_file: Path) -> dict:
    """The run's final summary, as {key: value}."""
    values = {}
    for record in complete_records(run_file):
        if record.WhichOneof("record_type") == "summary":
            for item in record.summary.update:
                values[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return values
