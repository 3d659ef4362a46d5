"""Sweeps stay clean (DDP inside a multirun: test_ddp.py): the submitit launcher, an Optuna study, one W&B run
per job (even after a failed one), loaders released after a run, the SLURM launcher's resources."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import yaml
from hydra import compose, initialize_config_dir
from support.ddp import job_dirs, run_train
from support.train import CONF, small_overrides, train
from support.wandb_records import complete_records, history, run_id, run_record

from nailseg.data.datamodule import NailDataModule
from nailseg.tools.compare import summarise

pytestmark = pytest.mark.slow  # trains in subprocesses (DDP ranks, sweeps, kills)


def multirun(*args: str) -> None:
    run_train("-m", *args)


def test_submitit_local_launcher_runs_every_job(prepared, tmp_path):
    sweep = tmp_path / "sweep"
    multirun(
        *small_overrides(prepared, "debug=fast", "logger=csv"),
        "hydra/launcher=submitit_local",
        "aug=none,light",
        f"hydra.sweep.dir={sweep}",
    )
    jobs = job_dirs(sweep)
    assert [p.name for p in jobs] == ["0", "1"]
    choices = [json.loads((job / "metrics.json").read_text())["choices"]["aug"] for job in jobs]
    assert choices == ["none", "light"]


def test_optuna_study_persists_resumes_and_compares_by_the_swept_values(prepared, tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"

    def study(sweep: Path, trials: int) -> None:  # no -m: the preset is a sweep by itself
        run_train(
            *small_overrides(prepared, "debug=fast", "logger=none"),
            "hparams_search=optuna",
            f"hydra.sweeper.n_trials={trials}",
            f"hydra.sweeper.storage={storage}",
            f"hydra.sweep.dir={sweep}",
        )

    study(tmp_path / "study", 2)
    results = yaml.safe_load((tmp_path / "study" / "optimization_results.yaml").read_text())
    assert set(results["best_params"]) == {
        "optimizer.lr",
        "model.encoder_name",
        "aug",
        "module.loss",
    }
    values = [
        json.loads((job / "metrics.json").read_text())["best"]["value"]
        for job in job_dirs(tmp_path / "study")
    ]
    assert len(values) == 2 and results["best_value"] == pytest.approx(max(values))
    rows = summarise(tmp_path / "study")
    assert rows["optimizer.lr"].astype(float).between(1e-4, 1e-2).all()

    study(tmp_path / "more", 1)  # the same storage: the study goes on
    trials = optuna.load_study(study_name="nailseg", storage=storage).trials
    assert len(trials) == 3 and all(t.state.name == "COMPLETE" for t in trials)


def _exit_code(run_file: Path) -> int:
    (code,) = [
        r.exit.exit_code
        for r in complete_records(run_file)
        if r.WhichOneof("record_type") == "exit"
    ]
    return code


def test_each_job_gets_its_own_wandb_run_even_after_a_failed_job(failing_sweep):
    jobs = job_dirs(failing_sweep)
    assert (jobs[1] / "failed.json").is_file()
    files = [next(job.glob("wandb/offline-run-*/run-*.wandb")) for job in jobs]
    assert len({run_id(f) for f in files}) == 3
    runs = [run_record(f) for f in files]  # one W&B group per sweep, runs named by their overrides
    assert {r.run_group for r in runs} == {failing_sweep.name}
    assert [r.display_name.split(",")[-1] for r in runs] == [
        "scheduler.total_steps=null",
        "scheduler.total_steps=1",
        "scheduler.total_steps=null",
    ]
    assert [_exit_code(f) for f in files] == [0, 1, 0]  # every run closed, the failed one as such
    assert [r["val/samples"] for r in history(files[2]) if "val/samples" in r] == [4]


def test_run_releases_its_loaders(prepared, tmp_path, monkeypatch):
    built = []
    original = NailDataModule._build

    def spy(self, *args, **kwargs):
        built.append(original(self, *args, **kwargs))
        return built[-1]

    monkeypatch.setattr(NailDataModule, "_build", spy)
    train(prepared, tmp_path / "run", "trainer.max_epochs=1", "logger=none")
    assert len(built) == 3  # train, val, test
    for loader in built:
        with pytest.raises(RuntimeError, match="closed"):
            next(iter(loader))


def test_slurm_launcher_starts_one_task_per_device_the_trainer_expects():
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "hydra/launcher=slurm",
                "trainer=ddp",
                "trainer.devices=4",
                "trainer.num_nodes=2",
                "hydra.launcher.partition=gpu",
            ],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (2, 4, 4)
    assert launcher.partition == "gpu" and launcher.timeout_min > 0 and launcher.mem_gb > 0
