"""A sweep job's failure record, `failed.json` in its run folder: written by `run_job` when a job
of a sweep fails (the sweep goes on), reported by `python -m nailseg compare` and by the sweep's
exit status (`FailedJobsExit`), and removed when a later run in that folder completes (the job
resumed). Only a record this module wrote is ever read as a failure or removed: a user's own
`failed.json` there is left alone."""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from nailseg.io.atomic import write_text
from nailseg.io.ownership import make_folder, remove_file

FAILED = "failed.json"
_KEYS = frozenset({"error", "traceback"})  # exactly what `write_failure` writes


def write_failure(run_dir: Path, err: BaseException) -> Path:
    """Record `err` (raised just now: its traceback is the current one) for the sweep's table."""
    make_folder(run_dir)
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
    naming the failed jobs. Each failing job writes its record and the sweep goes on, so without
    this `train.py -m` exited 0 however many jobs failed, and a script or CI step could not tell."""

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
