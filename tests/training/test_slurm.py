"""What `train.py -m hydra/launcher=slurm` asks SLURM for, composed from the real config: the
trainer's nodes, tasks and GPUs per node, and a sweep that varies them refused before submitting.
submitit's executor is replaced by a recorder (no SLURM cluster here): nothing is submitted or run."""

from __future__ import annotations

import runpy
import sys

import pytest
from hydra.core.singleton import Singleton
from hydra.errors import InstantiationException
from support.slurm import TRAIN, slurm_sweep

from nailseg.errors import ConfigError
from nailseg.training.jobs import swept_keys


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_a_slurm_sweep_where_there_is_no_srun_is_one_line_before_anything_is_written(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no srun: not a SLURM login node
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    argv = [
        "-m",
        "hydra/launcher=slurm",
        "trainer=ddp",
        "trainer.devices=4",
        "model=unet,segformer",
    ]
    monkeypatch.setattr(sys, "argv", [str(TRAIN), *argv, f"paths.root_dir={tmp_path}"])
    state = Singleton.get_state()
    try:
        with pytest.raises(SystemExit) as refused:
            runpy.run_path(str(TRAIN), run_name="__main__")
    finally:
        Singleton.set_state(state)
    assert str(refused.value) == (
        "train.py: ConfigError: hydra/launcher=slurm: SLURM's srun is not on PATH here: submit "
        "from a SLURM login node (hydra/launcher=submitit_local runs the same jobs on this machine)"
    )
    assert not list(tmp_path.iterdir())
