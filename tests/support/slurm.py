"""`train.py -m hydra/launcher=slurm` run here as a user runs it, submitit recording what it would
submit instead of submitting (no SLURM cluster here): nothing is submitted or run."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import submitit
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
RESOURCES = ("nodes", "tasks_per_node", "gpus_per_node", "slurm_partition")


def fake_srun(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """An `srun` on PATH, as on a SLURM login node (the launcher refuses to start without one)."""
    folder.mkdir(parents=True, exist_ok=True)
    srun = folder / "srun"
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{sys.exec_prefix}/bin:/usr/bin:/bin")


class Done:
    """A submitted job, already finished."""

    def results(self) -> list[JobReturn]:
        return [JobReturn(status=JobStatus.COMPLETED)]


def slurm_sweep(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *overrides: str, argv: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Run `train.py -m hydra/launcher=slurm *overrides` here (or `train.py *argv`, a whole
    command line), submitit recording instead of submitting; per job, its overrides and what
    SLURM would be asked for."""
    submitted: list[dict[str, Any]] = []

    class Recorder:
        def __init__(self, cluster: str, **_: Any) -> None:
            self.params: dict[str, Any] = {}

        def update_parameters(self, **params: Any) -> None:
            self.params.update(params)

        def map_array(self, _launcher: Any, jobs: list[list[str]], *_: Any) -> list[Done]:
            request = {key: self.params[key] for key in RESOURCES}
            submitted.extend({"overrides": job, **request} for job in jobs)
            return [Done() for _ in jobs]

    monkeypatch.setattr(submitit, "AutoExecutor", Recorder)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # raise, not print and exit
    fake_srun(monkeypatch, tmp_path.parent / "slurm_bin")
    argv = argv or (
        "-m",
        "hydra/launcher=slurm",
        "hydra/hydra_logging=none",
        "hydra/job_logging=none",
    )
    monkeypatch.setattr(sys, "argv", [str(TRAIN), *argv, f"hydra.sweep.dir={tmp_path}", *overrides])
    state = Singleton.get_state()
    try:
        runpy.run_path(str(TRAIN), run_name="__main__")
    finally:
        Singleton.set_state(state)
    return submitted
