"""A sweep job's failure record, `failed.json` in its run folder: written by `run_job` when a job
of a sweep fails, reported by compare and the sweep's exit status (`FailedJobsExit`), removed when
a later run there completes. Its content is its proof: a user's file of that name is never read
as a failure, replaced or removed."""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from nailseg.io.atomic import write_text
from nailseg.io.ownership import make_folder, remove_file

log = logging.getLogger(__name__)
FAILED = "failed.json"
_KEYS = frozenset({"error", "traceback"})  # exactly what `write_failure` writes


def write_failure(run_dir: Path, err: BaseException) -> Path:
    """Record `err` (raised just now: its traceback is the current one) for the sweep's table;
    a file of that name that is not a record of ours stays, and is named."""
    make_folder(run_dir)
    path = run_dir / FAILED
    if os.path.lexists(path) and read_failure(run_dir) is None:
        log.warning("%s is not a failure record nailseg wrote: left as it is", path)
        return path
    record = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    return write_text(path, json.dumps(record, indent=2, sort_keys=True))


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
    if read_failure(run_dir) is not None:  # its content is the proof that it is ours
        remove_file(run_dir / FAILED, lambda _: True)


def job_folders(sweep_dir: Path) -> list[Path]:
    """A sweep's job folders (those with a `.hydra/`), by job number; none if it does not exist."""
    if not sweep_dir.is_dir():
        return []
    jobs = [p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir()]
    return sorted(
        jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name)
    )


class FailedJobsExit(Callback):
    """Hydra callback: a sweep in which a job failed exits with status 1 once every job has run,
    naming the failed jobs (each failing job records itself and the sweep goes on)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = job_folders(sweep_dir)
        failed = [(job, error) for job in jobs if (error := read_failure(job)) is not None]
        if failed:
            listed = "; ".join(f"{job} ({error})" for job, error in failed)
            sys.exit(
                f"train.py: {len(failed)} of {len(jobs)} jobs failed: {listed}. "
                f"python -m nailseg compare sweep_dir={sweep_dir} tabulates the sweep"
            )
