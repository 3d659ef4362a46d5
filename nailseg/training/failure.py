"""A sweep job's failure record, `failed.json` in its run folder: written by `run_job` when a job
of a sweep fails (the sweep goes on), reported by `python -m nailseg.compare`, and removed when a
later run in that folder completes (the job resumed). Only a record this module wrote is ever
read as a failure or removed: a user's own `failed.json` there is left alone."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

from nailseg.atomic import write_text

FAILED = "failed.json"
_KEYS = frozenset({"error", "traceback"})  # exactly what `write_failure` writes


def write_failure(run_dir: Path, err: BaseException) -> Path:
    """Record `err` (raised just now: its traceback is the current one) for the sweep's table."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    return write_text(run_dir / FAILED, json.dumps(record, indent=2, sort_keys=True))


def read_failure(run_dir: Path) -> str | None:
    """The error of the failure recorded in `run_dir`, or None where there is no record of ours
    (no file, or a file of that name that `write_failure` did not write)."""
    try:
        record = json.loads((run_dir / FAILED).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(record, dict) or set(record) != _KEYS:
        return None
    return str(record["error"])


def clear_failure(run_dir: Path) -> None:
    """Remove the failure recorded in `run_dir` (the run there has now completed); a file of that
    name that is not a record of ours stays."""
    if read_failure(run_dir) is not None:
        (run_dir / FAILED).unlink(missing_ok=True)
