"""Sweeps stay clean (DDP inside a multirun, by `trainer=ddp` or Lightning's default strategy:
test_ddp.py): the submitit launcher, an Optuna study, one W&B run per job (even after a failed
one), loaders released after a run (the SLURM launcher: test_slurm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import yaml
from support.cli import run_command
from support.ddp import job_dirs
from support.train import small_overrides, train
from support.wandb_records import complete_records, history, run_id, run_record

from nailseg.compare import summarise
from nailseg.data.datamodule import NailDataModule
from nailseg.training.run_folder import read_failure

pytestmark = pytest.mark.slow  # trains in subprocesses (DDP ranks, sweeps, kills)


def in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`python *argv` in this process (support.cli), which must succeed; its stdout."""
    done = run_command(argv, capsys)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_submitit_local_launcher_runs_every_job(prepared, tmp_path, capsys):
    sweep = tmp_path / "sweep"
    in_process(
        [
            "train.py",
            "-m",
            *small_overrides(prepared, "debug=fast", "logger=csv"),
            "hydra/launcher=submitit_local",
            "aug=none,light",
            f"hydra.sweep.dir={sweep}",
        ],
        capsys,
    )
    jobs = job_dirs(sweep)
    assert [p.name for p in jobs] == ["0", "1"]
    choices = [json.loads((job / "metrics.json").read_text())["choices"]["aug"] for job in jobs]
    assert choices == ["none", "light"]


def test_optuna_study_persists_resumes_and_compares_by_the_swept_values(prepared, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"

    def study(sweep: Path, trials: int) -> None:  # no -m: the preset is a sweep by itself
        in_process(
            [
                "train.py",
                *small_overrides(prepared, "debug=fast", "logger=none"),
                "hparams_search=optuna",
                f"hydra.sweeper.n_trials={trials}",
                f"hydra.sweeper.storage={storage}",
                f"hydra.sweep.dir={sweep}",
            ],
            capsys,
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
    # new parameters, not the first trial's again (the sampler's seed counts the stored trials)
    assert trials[2].params not in (trials[0].params, trials[1].params)
    # compare shows the rerun's own job from its files, the storage never opened
    shown = in_process(["-m", "nailseg", "compare", str(tmp_path / "more")], capsys)
    assert shown.splitlines()[2].startswith("| 0 | ") and "Optuna's best: " in shown, shown


def _exit_code(run_file: Path) -> int:
    (code,) = [
        r.exit.exit_code
        for r in complete_records(run_file)
        if r.WhichOneof("record_type") == "exit"
    ]
    return code


def test_each_job_gets_its_own_wandb_run_even_after_a_failed_job(failing_sweep):
    jobs = job_dirs(failing_sweep)
    assert read_failure(jobs[1]) is not None
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


def test_a_sweep_with_a_failed_job_runs_every_job_then_exits_non_zero_naming_it(failing_sweep):
    # the exit status itself (1) is asserted by the fixture; before, the sweep exited 0
    jobs = job_dirs(failing_sweep)
    assert [(job / "metrics.json").is_file() for job in jobs] == [True, False, True]
    last_line = (failing_sweep.parent / "stderr.txt").read_text().strip().splitlines()[-1]
    assert last_line.startswith("train.py: 1 of 3 jobs failed: ")
    assert f"{jobs[1]} (" in last_line and f"sweep_dir={failing_sweep}" in last_line


def test_each_job_keeps_its_wandb_cache_in_its_own_folder(failing_sweep):
    """W&B reads its environment once a process: every job after the first cached into the
    first job's folder (and W&B warned that the changes were ignored)."""
    for job in job_dirs(failing_sweep):
        assert list(job.glob("wandb/cache/wandb/logs/core-debug-*.log")), job.name


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


def test_a_second_sweep_into_a_sweep_folder_leaves_the_first_ones_jobs(prepared, tmp_path, capsys):
    """Two sweeps into one hydra.sweep.dir overwrote each other's jobs (compare then showed one
    job's scores under the other's overrides)."""
    sweep = tmp_path / "sweep"
    args = ["train.py", "-m", *small_overrides(prepared, "trainer.max_epochs=1", "logger=none", "test=false"), f"hydra.sweep.dir={sweep}"]  # fmt: skip
    in_process([*args, "aug=none,light"], capsys)
    jobs = job_dirs(sweep)
    before = {job: (job / "metrics.json").read_bytes() for job in jobs}
    again = run_command([*args, "aug=heavy,photo"], capsys)
    assert again.returncode == 1 and "Traceback" not in again.stderr, again.stderr[-3000:]
    assert again.stderr.strip().splitlines()[-1] == (
        f"train.py: NotOursError: hydra.sweep.dir={sweep}: {jobs[0]} holds a job of an earlier "
        "sweep: nothing was written; choose another hydra.sweep.dir (or hydra.sweep.subdir), or "
        "resume its jobs with ckpt_path=last"
    )
    assert {job: (job / "metrics.json").read_bytes() for job in jobs} == before
    # a sweep into subfolders of its own goes beside them (make cross-source's rows)
    in_process([*args, "aug=heavy", "hydra.sweep.subdir=row1-${hydra.job.num}"], capsys)
    assert json.loads((sweep / "row1-0" / "metrics.json").read_text())["choices"]["aug"] == "heavy"
