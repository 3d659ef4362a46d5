"""`python -m nailseg compare` on a real sweep of train.py with a failing job, and on sweep folders
as train.py leaves them: two sweeps into one folder, an Optuna sweep, FIFOs, a live sweep."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from support.cli import run_command

from nailseg.compare import summarise
from nailseg.io.folder import OwnedFolder

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_sweep_is_summarised_by_what_it_varied_failed_jobs_included(failing_sweep):
    rows = summarise(failing_sweep)
    assert list(rows["job"]) == ["0", "1", "2"]
    assert list(rows.columns[:2]) == ["job", "scheduler.total_steps"]  # only what varied
    assert list(rows["scheduler.total_steps"]) == ["null", "1", "null"]
    assert list(rows["status"].str[:6]) == ["ok", "failed", "ok"]
    assert "Tried to step" in rows["status"][1]
    assert rows.loc[[0, 2], "best"].notna().all() and rows.loc[[0, 2], "epochs"].tolist() == [1, 1]
    table = (failing_sweep / "compare.md").read_text()
    assert table.count("\n|") == 1 + 3 and table.count("| failed: ") == 1
    assert pd.read_csv(failing_sweep / "compare.csv", keep_default_na=False).shape == rows.shape
    assert (failing_sweep / "compare.png").is_file()


def compare(folder: Path | str, capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess:
    """`python -m nailseg compare FOLDER`, as a user runs it (in this process: `run_command`)."""
    return run_command(["-m", "nailseg", "compare", str(folder)], capsys)


@pytest.mark.slow
def test_the_command_takes_a_bare_folder_and_has_its_own_help(failing_sweep, capsys):
    proc = compare(failing_sweep, capsys)
    assert proc.returncode == 0 and "scheduler.total_steps" in proc.stdout, proc.stderr[-2000:]
    help_text = compare("--help", capsys).stdout
    assert "sweep_dir=DIR" in help_text and "dataset" not in help_text


def _job(sweep: Path, name: str, overrides: list[str], metrics: dict) -> Path:
    """A job folder as train.py leaves it in its sweep's folder: its overrides and its
    metrics.json, which records them."""
    OwnedFolder.claim(sweep, "sweep").release()
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (job / "metrics.json").write_text(json.dumps({"overrides": overrides, **metrics}))
    return job


def test_multi_gpu_jobs_are_scaled_against_the_one_gpu_job_of_their_setting(tmp_path):
    def speed(img_s: float, world_size: int) -> dict:
        summary = {"images_per_s": img_s, "data_wait_frac": 0.1}
        return {"fit": {"train/images_per_s": 1.0}, "throughput": summary, "world_size": world_size}

    _job(tmp_path, "0", ["trainer=gpu", "aug=light"], speed(100.0, 1))
    ddp = _job(tmp_path, "1", ["trainer=ddp", "trainer.devices=2", "aug=light"], speed(190.0, 2))
    _job(tmp_path, "2", ["trainer=ddp", "trainer.devices=2", "aug=heavy"], speed(150.0, 2))
    last_epoch_only = {"fit": {"train/images_per_s": 80.0, "train/data_wait_frac": 0.2}}
    _job(tmp_path, "3", ["trainer=gpu", "aug=none"], last_epoch_only)  # before the summary
    (ddp / "ledger").mkdir()
    for rank, rows in enumerate([[0, 2], [1, 3]]):
        entry = {"stage": "train", "epoch": 0, "rank": rank, "world_size": 2, "rows": rows}
        (ddp / "ledger" / f"train_epoch000_step0000002_rank{rank}.json").write_text(
            json.dumps(entry)
        )
    rows = summarise(tmp_path)
    assert rows["train_img_s"].tolist() == [100.0, 190.0, 150.0, 80.0]
    scaling = rows["scaling"]
    assert pd.isna(scaling[0]) and scaling[1] == pytest.approx(0.95)
    assert pd.isna(scaling[2])  # no one-GPU job with aug=heavy ran
    assert pd.isna(rows["ledger"][0]) and rows["ledger"][1] == "every row once in each of 1 epochs"
    assert "| 0.95 | every row once in each of 1 epochs |" in (tmp_path / "compare.md").read_text()


def test_a_users_own_failed_json_in_a_job_folder_is_not_read_as_a_failure(tmp_path):
    job = _job(tmp_path, "0", ["aug=light"], {"fit": {}, "throughput": None, "world_size": 1})
    (job / "failed.json").write_text('{"note": "my own list of failed photos"}')
    other = _job(tmp_path, "1", ["aug=heavy"], {"fit": {}, "throughput": None, "world_size": 1})
    (other / "failed.json").write_text("not json")
    assert summarise(tmp_path)["status"].tolist() == ["ok", "ok"]


@pytest.mark.slow
def test_a_folder_that_is_not_a_sweep_is_refused_in_one_line_naming_it(tmp_path, capsys):
    """The parent of sweeps (multirun/) ended in a traceback; so did a run folder or an empty one."""
    multirun = tmp_path / "multirun"
    for sweep in ("2026-01-02", "2026-01-03"):
        _job(multirun / sweep, "0", ["aug=light"], {"fit": {}, "world_size": 1})
    (tmp_path / "empty").mkdir()
    expected = "expected a sweep's folder (multirun/<time>) whose jobs are its subfolders"
    cases = {
        multirun: " holds sweeps, not jobs: pass one of them (2026-01-02, 2026-01-03)",
        multirun / "2026-01-02" / "0": f" is a single run's folder, not a sweep; {expected}",
        tmp_path / "empty": f": no job folders (subfolders with .hydra/) in it; {expected}",
        tmp_path / "missing": f": no such folder; {expected}",
    }
    for folder, says in cases.items():
        proc = compare(folder, capsys)
        assert proc.returncode == 1 and proc.stderr == f"nailseg compare: {folder}{says}\n"
        assert not (folder / "compare.md").exists()


@pytest.mark.slow
def test_the_table_leaves_out_empty_and_constant_columns_rounds_numbers_and_goes_past_a_broken_job(
    tmp_path, capsys
):
    def report(img_s: float, best: float) -> dict:
        summary = {"images_per_s": img_s, "data_wait_frac": 0.125}
        return {"throughput": summary, "world_size": 1, "best": {"value": best}, "epochs": 3}

    _job(tmp_path, "0", ["optimizer.lr=0.000123456789", "aug=light"], report(1234.5678, 0.876543))
    _job(tmp_path, "1", ["optimizer.lr=0.001", "aug=light"], report(98765.4321, 0.5))
    proc = compare(tmp_path, capsys)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines()[:6] == [
        "| job | optimizer.lr | train_img_s | best |",
        "|---|---|---|---|",
        "| 0 | 0.0001235 | 1235 | 0.8765 |",
        "| 1 | 0.001 | 98765 | 0.5 |",
        "",
        "same in every row: status=ok, data_wait_frac=0.125, world_size=1, epochs=3",
    ]
    csv = pd.read_csv(tmp_path / "compare.csv")  # the file keeps every column and digit
    assert csv["train_img_s"].tolist() == [1234.5678, 98765.4321] and "ledger" in csv

    (_job(tmp_path, "2", ["optimizer.lr=0.01", "aug=light"], {}) / "metrics.json").write_text("{")
    proc = compare(tmp_path, capsys)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith(f"nailseg compare: {tmp_path / '2'}: unreadable: metrics.json: ")
    assert proc.stderr.count("\n") == 1
    (broken,) = [line for line in proc.stdout.splitlines() if line.startswith("| 2 | 0.01 | ")]
    assert "| unreadable: metrics.json: JSONDecodeError: " in broken
    assert "| 1 | 0.001 | ok | 98765 | 0.125 | 1 | 0.5 | 3 |" in proc.stdout


def test_scores_are_shown_only_under_the_overrides_they_were_measured_with(tmp_path, capsys):
    """#45: a second sweep into the same hydra.sweep.dir rewrote job 0's overrides and died before
    its metrics.json: compare showed the first sweep's scores under the second sweep's overrides."""
    report = {"throughput": {"images_per_s": 50.0, "data_wait_frac": 0.1}, "best": {"value": 0.9}}
    first = _job(tmp_path, "0", ["aug=light"], report)
    _job(tmp_path, "1", ["aug=heavy"], report)
    (first / ".hydra" / "overrides.yaml").write_text("- aug=geometric\n")  # the second sweep's
    rows = summarise(tmp_path).set_index("job")
    assert rows.loc["0", "aug"] == "geometric" and pd.isna(rows.loc["0", "best"])
    assert rows.loc["0", "status"] == (
        "failed: no metrics.json of this job (the one there ran ['aug=light'])"
    )
    assert rows.loc["1", "aug"] == "heavy" and rows.loc["1", "best"] == 0.9
    shown = compare(tmp_path, capsys).stdout
    assert "| 0 | geometric | failed: no metrics.json of this job" in shown


@pytest.mark.slow
def test_compare_never_opens_the_optuna_storage_a_job_names(tmp_path, capsys):
    """#45: compare opened the storage a job's .hydra/hydra.yaml named: it created Optuna's tables
    in a user's SQLite database (other URLs load a driver and connect). It reads the jobs' files
    and optimization_results.yaml only."""
    database = tmp_path / "mine.db"
    with sqlite3.connect(database) as db:
        db.execute("CREATE TABLE notes (text)")
    before = database.read_bytes()
    sweep = tmp_path / "sweep"
    for name, lr in (("0", "0.01"), ("1", "0.001")):
        job = _job(sweep, name, [f"optimizer.lr={lr}"], {"best": {"value": float(lr)}})
        (job / ".hydra" / "hydra.yaml").write_text(
            "hydra:\n  runtime:\n    cwd: /\n  sweeper:\n"
            "    _target_: hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper\n"
            f"    storage: sqlite:///{database}\n    study_name: nailseg\n"
            "    params: {optimizer.lr: choice(0.01, 0.001)}\n"
        )
    (sweep / "optimization_results.yaml").write_text(
        "name: optuna\nbest_params:\n  optimizer.lr: 0.01\nbest_value: 0.01\n"
    )
    proc = compare(sweep, capsys)
    assert proc.returncode == 0, proc.stderr
    assert database.read_bytes() == before
    assert "Optuna's best: optimizer.lr=0.01 (0.01)" in proc.stdout
    assert "Optuna's best: optimizer.lr=0.01 (0.01)" in (sweep / "compare.md").read_text()
    assert "trial" not in pd.read_csv(sweep / "compare.csv")


class Hung(BaseException):
    """Raised in a command that waited too long (no `except Exception` of its catches it)."""


@pytest.fixture
def deadline() -> Iterator[None]:
    """A test that would hang fails after 30 s instead."""

    def expire(*_: object) -> None:
        raise Hung("compare waited on a FIFO")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["metrics.json", ".hydra/overrides.yaml", ".nailseg.json", "ledger/train_epoch000.json"]
)
def test_a_fifo_at_a_name_compare_reads_is_named_not_waited_on(tmp_path, deadline, name, capsys):
    """#45: a FIFO at a name compare reads in a job folder hung it."""
    report = {"throughput": {"images_per_s": 50.0, "data_wait_frac": 0.1}}
    job = _job(tmp_path, "0", ["aug=light"], report)
    _job(tmp_path, "1", ["aug=heavy"], report)
    (job / name).unlink(missing_ok=True)
    (job / name).parent.mkdir(exist_ok=True)
    os.mkfifo(job / name)
    proc = compare(tmp_path, capsys)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 0 |"))
    unreadable = name != ".nailseg.json"  # a marker nailseg did not write holds no failure
    assert ("unreadable" in row) == unreadable and ("is not a plain file" in row) == unreadable
    assert "| 1 | heavy |" in proc.stdout and "unreadable" not in proc.stdout.split("| 1 |")[1]


def test_a_sweep_still_running_is_refused_in_one_line(tmp_path, capsys):
    """The sweep's folder is held by train.py while its jobs run; compare does not read it
    half-written nor write into it."""
    _job(tmp_path, "0", ["aug=light"], {})
    _job(tmp_path, "1", ["aug=heavy"], {})
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the running sweep holds it
        proc = compare(tmp_path, capsys)
    finally:
        os.close(fd)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (
        f"nailseg compare: another nailseg command is using {tmp_path}: wait for it to finish, "
        "or choose another sweep_dir\n"
    )
    assert not (tmp_path / "compare.md").exists()
