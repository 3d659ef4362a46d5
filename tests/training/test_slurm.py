"""What `train.py -m hydra/launcher=slurm` asks SLURM for, composed from the real config: the
trainer's nodes, tasks and GPUs per node, and a sweep that varies them refused before submitting.
submitit's executor is replaced by a recorder (no SLURM cluster here): nothing is submitted or run."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import submitit
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import InstantiationException

from nailseg.training.checks import ConfigError
from nailseg.training.jobs import swept_keys

TRAIN = Path(__file__).resolve().parents[2] / "train.py"
RESOURCES = ("nodes", "tasks_per_node", "gpus_per_node", "slurm_partition")


class Done:
    """A submitted job, already finished."""

    def results(self) -> list[JobReturn]:
        return [JobReturn(status=JobStatus.COMPLETED)]


def slurm_sweep(monkeypatch, tmp_path: Path, *overrides: str) -> list[dict[str, Any]]:
    """Run `train.py -m hydra/launcher=slurm *overrides` here, submitit recording instead of
    submitting; per job, its overrides and what SLURM would be asked for."""
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
    argv = ["-m", "hydra/launcher=slurm", "hydra/hydra_logging=none", "hydra/job_logging=none"]
    monkeypatch.setattr(sys, "argv", [str(TRAIN), *argv, f"hydra.sweep.dir={tmp_path}", *overrides])
    state = Singleton.get_state()
    try:
        runpy.run_path(str(TRAIN), run_name="__main__")
    finally:
        Singleton.set_state(state)
    return submitted


@pytest.mark.parametrize(("nodes", "expected"), [([], 1), (["trainer.num_nodes=2"], 2)])
def test_each_job_asks_for_the_trainers_nodes_tasks_and_gpus(
    monkeypatch, tmp_path, nodes, expected
):
    # trainer.num_nodes left out: one node (it was null, failing the launcher's validation)
    jobs = slurm_sweep(
        monkeypatch,
        tmp_path,
        "trainer=ddp",
        "trainer.devices=4",
        *nodes,
        "hydra.launcher.partition=gpu",
        "aug=none,light",
    )
    assert [job["overrides"][-1] for job in jobs] == ["aug=none", "aug=light"]
    for job in jobs:
        assert (job["nodes"], job["tasks_per_node"], job["gpus_per_node"]) == (expected, 4, 4)
        assert job["slurm_partition"] == "gpu"


@pytest.mark.parametrize(
    ("sweep", "key"),
    [
        (["trainer=ddp", "trainer.devices=2,4"], "trainer.devices"),
        (["trainer=gpu,ddp", "trainer.devices=2"], "trainer"),
        (["trainer=ddp", "trainer.devices=2", "trainer.num_nodes=1,2"], "trainer.num_nodes"),
    ],
)
def test_a_sweep_that_varies_the_trainer_is_refused_before_submitting(
    monkeypatch, tmp_path, sweep, key
):
    with pytest.raises(InstantiationException, match=rf"varies {key}, but SLURM") as refused:
        slurm_sweep(monkeypatch, tmp_path, *sweep, "aug=none,light")
    assert isinstance(refused.value.__cause__, ConfigError)


def test_a_job_whose_choice_sets_other_devices_is_refused_before_submitting(monkeypatch, tmp_path):
    # a user's experiment sets the devices without the sweep naming any trainer key: the keys
    # check let it through, and all jobs would have been submitted with job 1's request
    extra = tmp_path / "conf"
    (extra / "experiment").mkdir(parents=True)
    (extra / "experiment" / "four_gpus.yaml").write_text(
        "# @package _global_\ntrainer:\n  devices: 4\n"
    )
    with pytest.raises(SystemExit) as refused:
        slurm_sweep(
            monkeypatch,
            tmp_path / "sweep",
            "trainer=gpu",
            f"hydra.searchpath=[file://{extra}]",
            "experiment=gpu_384,four_gpus",
        )
    assert str(refused.value) == (
        "train.py: job 1 of 2 (trainer=gpu experiment=four_gpus): ConfigError: hydra/launcher=slurm: "
        "this job's trainer needs trainer.num_nodes=1, trainer.devices=4, but SLURM gets the sweep's "
        "one request for every job, trainer.num_nodes=1, trainer.devices=1: run the jobs that "
        "differ as a sweep of their own"
    )
    assert not (tmp_path / "sweep").exists()  # nothing submitted, nothing written


def test_the_keys_a_sweep_varies_include_the_sweepers_search_space():
    overrides = ["trainer.devices=4", "aug=none,light", "optimizer.lr=interval(1e-4,1e-2)"]
    params = {"trainer.num_nodes": "choice(1,2)"}
    assert swept_keys(overrides, params) == {"aug", "optimizer.lr", "trainer.num_nodes"}
