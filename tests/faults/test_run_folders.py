"""Run folders: one training writes a folder at a time, a checkpoint kept elsewhere is only read, a
moved or copied run resumes with its best, a resume must be on the run's data, and
`ckpt_path=last` takes the newest run that can be resumed, or names each it could not."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import time
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
import torch
from support.cli import run_command
from support.ddp import TIMEOUT_S, finish, start_train
from support.prepared import write_prepared
from support.train import small_overrides, train

from nailseg.io.atomic import NotOursError
from nailseg.io.clean import clean
from nailseg.io.folder import OwnedFolder
from nailseg.model.checkpoint import CARD_KEY, CheckpointError

ONE_EPOCH = ("trainer.max_epochs=1", "logger=none", "test=false", "scheduler=none")
HOLD_S = 60  # the longest the first train.py holds its folder


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _hold(run_dir: Path, held: Event, release: Event) -> None:
    """What the first train.py holds (rank 0) until `release` is set."""
    with OwnedFolder.claim(run_dir, "run"):
        held.set()
        release.wait(HOLD_S)


@pytest.mark.slow
def test_a_second_train_into_a_held_folder_is_refused_at_once(prepared, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "a"
    # the first train.py: another process (the lock is a process's), forked from this one
    fork = multiprocessing.get_context("fork")
    held, release = fork.Event(), fork.Event()
    first = fork.Process(target=_hold, args=(run_dir, held, release))
    first.start()
    try:
        assert held.wait(HOLD_S), "the first train.py never held its folder"
        args = small_overrides(prepared, *ONE_EPOCH, f"hydra.run.dir={run_dir}")
        done = run_command(["train.py", *args], capsys)  # the second, in this process
    finally:
        release.set()
        first.join(HOLD_S)
    stderr = done.stderr
    assert done.returncode == 1 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"train.py: BusyError: another nailseg command is using {run_dir}: wait for it to "
        "finish, or choose another hydra.run.dir"
    )
    assert os.listdir(run_dir) == [".nailseg.json"]  # the holder's marker, nothing else


@pytest.mark.slow
def test_train_py_refuses_a_bad_card_in_one_line(prepared, tmp_path, capsys):
    train(prepared, tmp_path / "runs" / "a", *ONE_EPOCH)
    ckpt = tmp_path / "runs" / "a" / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint[CARD_KEY]["model"]["encoder_name"] = "tu-hf-hub:timm/resnet18.a1_in1k"
    torch.save(checkpoint, ckpt)
    before = _files(tmp_path / "runs" / "a")
    args = small_overrides(prepared, *ONE_EPOCH, f"ckpt_path={ckpt}")
    for mode in ("train=true", "train=false"):
        session = tmp_path / mode.replace("=", "_")
        done = run_command(["train.py", *args, mode, f"hydra.run.dir={session}"], capsys)
        stderr = done.stderr
        assert done.returncode == 1 and "Traceback" not in stderr, stderr
        assert (
            stderr.strip()
            .splitlines()[-1]
            .startswith(f"train.py: CheckpointError: {ckpt}: card key model.encoder_name=")
        )
        assert not (session / "checkpoints").exists()
    assert _files(tmp_path / "runs" / "a") == before


@pytest.mark.slow
def test_a_checkpoint_outside_a_run_folder_is_only_read(prepared, tmp_path):
    train(prepared, tmp_path / "runs" / "a", *ONE_EPOCH)
    somewhere = tmp_path / "somewhere"
    OwnedFolder.claim(somewhere, "run").release()  # a run folder, of another run
    (somewhere / "checkpoints").mkdir()
    shutil.copy(tmp_path / "runs" / "a" / "checkpoints" / "last.ckpt", somewhere / "checkpoints" / "x.ckpt")  # fmt: skip
    (somewhere / "metrics.json").write_text("the user's own")
    before = _files(somewhere)
    ckpt = somewhere / "checkpoints" / "x.ckpt"
    train(prepared, tmp_path / "runs" / "b", "trainer.max_epochs=2", *ONE_EPOCH[1:], f"ckpt_path={ckpt}")  # fmt: skip
    assert _files(somewhere) == before
    metrics = json.loads((tmp_path / "runs" / "b" / "metrics.json").read_text())
    assert metrics["resumed_from"] == str(ckpt) and metrics["epochs"] == 2
    assert (tmp_path / "runs" / "b" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
def test_a_moved_run_folder_keeps_its_best_and_a_copy_is_never_written(prepared, tmp_path):
    # a constant metric: the first epoch stays the best, unless the resume forgets it
    constant = ("optimized_metric=val/samples", "optimized_mode=max")
    again = ("ckpt_path=last", "trainer.max_epochs=2", *ONE_EPOCH[1:], *constant)
    train(prepared, tmp_path / "a", *ONE_EPOCH, *constant)
    shutil.copytree(tmp_path / "a", tmp_path / "copied")
    shutil.move(tmp_path / "a", tmp_path / "moved")
    train(prepared, tmp_path / "moved", *again)
    best = json.loads((tmp_path / "moved" / "metrics.json").read_text())["best"]
    assert best["checkpoint"] == str(tmp_path / "moved" / "checkpoints" / "epoch_000.ckpt")
    assert best["value"] == 5.0  # the valid split's rows
    assert sorted(p.name for p in (tmp_path / "moved" / "checkpoints").iterdir()) == [
        "epoch_000.ckpt",
        "last.ckpt",
    ]
    before = _files(tmp_path / "copied")
    with pytest.raises(NotOursError, match="is a copy of a nailseg run folder"):
        train(prepared, tmp_path / "copied", *again)
    assert _files(tmp_path / "copied") == before


@pytest.mark.slow
def test_resuming_on_other_data_is_refused_naming_it(prepared, tmp_path):
    runs = tmp_path / "runs"
    train(prepared, runs / "a", *ONE_EPOCH)
    before = _files(runs / "a")
    again = ("trainer.max_epochs=2", *ONE_EPOCH[1:], "ckpt_path=last")
    copy = shutil.copytree(prepared, tmp_path / "copy")
    with pytest.raises(CheckpointError, match=rf"another dataset .*checkpoint {prepared}.* config {copy}"):  # fmt: skip
        train(copy, runs / "b", *again)
    (prepared / "valid.csv").write_text("\n".join((prepared / "valid.csv").read_text().splitlines()[:-1]))  # fmt: skip
    with pytest.raises(CheckpointError, match=r"another dataset .*valid [0-9a-f]{12}.*valid [0-9a-f]{12}"):  # fmt: skip
        train(prepared, runs / "b", *again)
    assert _files(runs / "a") == before and not (runs / "b").exists()


@pytest.mark.slow
def test_last_takes_the_newest_run_that_can_resume_or_names_each_it_cannot(tmp_path):
    prepared = write_prepared(tmp_path / "prepared")
    runs = tmp_path / "runs"
    train(prepared, runs / "small", *ONE_EPOCH)
    train(prepared, runs / "wide", *ONE_EPOCH, "model.options.decoder_channels=[32,16,8]")
    again = ("trainer.max_epochs=2", *ONE_EPOCH[1:], "ckpt_path=last")
    train(prepared, runs / "next", *again)  # the newest, `wide`, is another model
    assert json.loads((runs / "small" / "metrics.json").read_text())["epochs"] == 2
    assert json.loads((runs / "wide" / "metrics.json").read_text())["epochs"] == 1

    with pytest.raises(CheckpointError) as refused:
        train(prepared, runs / "next", *again, "dataset.image_size=[64,64]")
    message = str(refused.value)
    assert message.startswith(f"ckpt_path=last: no run under {runs} can be resumed: ")
    for run in ("small", "wide"):
        assert f"{runs / run / 'checkpoints' / 'last.ckpt'} was trained with another" in message
    assert "\n" not in message


# issue #45: training's folders are claimed before Hydra, Lightning or a logger writes there


@pytest.mark.slow
def test_make_clean_spares_a_live_training_and_a_note_moved_into_its_folder(prepared, tmp_path):
    """`make clean` deleted a live training's files (it lost its best checkpoint and died), and
    afterwards a note moved into the run folder meanwhile (its ctime changed during the job)."""
    outputs, note = tmp_path / "outputs", tmp_path / "note.txt"
    run_dir = outputs / "train" / "run"
    args = small_overrides(prepared, "trainer.max_epochs=30", *ONE_EPOCH[1:])
    job = start_train(*args, f"hydra.run.dir={run_dir}")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (run_dir / "checkpoints" / "last.ckpt").is_file():
            assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()
            time.sleep(0.2)
        note.write_text("mine")
        os.rename(note, run_dir / "note.txt")  # moved in while it trains
        cleaned = clean(outputs)
        assert cleaned.removed == 0 and run_dir in cleaned.skipped
        assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    finally:
        finish(job)  # it trains to its end
    assert json.loads((run_dir / "metrics.json").read_text())["epochs"] == 30
    clean(outputs)
    assert os.listdir(run_dir) == ["note.txt"] and (run_dir / "note.txt").read_text() == "mine"


def _sweep_args(mode: str, folder: Path, tmp_path: Path) -> list[str]:
    return {
        "single": [f"hydra.run.dir={folder}"],
        "sweep": ["aug=none,light", f"hydra.sweep.dir={folder}"],
        "optuna": [
            "hparams_search=optuna",
            "hydra.sweeper.n_trials=1",
            f"hydra.sweeper.storage=sqlite:///{tmp_path / 'optuna.db'}",
            f"hydra.sweep.dir={folder}",
        ],
    }[mode]


def _stamped(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["single", "sweep", "optuna"])
def test_train_refuses_a_users_folder_in_one_line_before_any_write(mode, prepared, tmp_path, capsys):  # fmt: skip
    """Given a user's folder, train.py overwrote `.hydra/*.yaml`, `multirun.yaml` and
    `optimization_results.yaml` there and appended to `train.log`, naming none of them."""
    mine = tmp_path / "mine"
    (mine / ".hydra").mkdir(parents=True)
    for name in ("train.log", ".hydra/config.yaml", "multirun.yaml", "optimization_results.yaml"):
        (mine / name).write_text("the user's")
    before = _stamped(mine)
    flag = ["-m"] if mode == "sweep" else []
    args = [*flag, *small_overrides(prepared, *ONE_EPOCH), *_sweep_args(mode, mine, tmp_path)]
    done = run_command(["train.py", *args], capsys)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    key = "hydra.run.dir" if mode == "single" else "hydra.sweep.dir"
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(f"train.py: ForeignFolderError: {key}={mine} is not a folder nailseg made")
    )
    assert _stamped(mine) == before and not (tmp_path / "optuna.db").exists()


@pytest.mark.slow
@pytest.mark.parametrize("link", ["train.log", ".hydra", "csv", "wandb", "tensorboard"])
def test_training_never_writes_through_a_link_in_its_run_folder(link, prepared, tmp_path, capsys):
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    OwnedFolder.claim(run_dir, "run").release()  # a run folder nailseg made
    if link == "train.log":
        outside.write_text("the user's")
    else:
        outside.mkdir()
    (run_dir / link).symlink_to(outside)
    logger = f"logger={link}" if link in ("csv", "wandb", "tensorboard") else "logger=none"
    args = small_overrides(prepared, *ONE_EPOCH, logger, f"hydra.run.dir={run_dir}")
    done = run_command(["train.py", *args], capsys)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{run_dir / link} is a symbolic link" in done.stderr.strip().splitlines()[-1]
    if link == "train.log":
        assert outside.read_text() == "the user's"
    else:
        assert os.listdir(outside) == []


@pytest.mark.slow
def test_last_never_resumes_into_a_copy_of_a_run(prepared, tmp_path):
    """A `cp -a` backup ties with its run on modification time and sorts after it: it was
    resumed, its last.ckpt replaced and its best checkpoint deleted."""
    runs = tmp_path / "runs"
    train(prepared, runs / "a", *ONE_EPOCH)
    subprocess.run(["cp", "-a", str(runs / "a"), str(runs / "a-backup")], check=True)
    before = _stamped(runs / "a-backup")
    train(prepared, runs / "next", "trainer.max_epochs=2", *ONE_EPOCH[1:], "ckpt_path=last")
    assert json.loads((runs / "a" / "metrics.json").read_text())["epochs"] == 2
    assert _stamped(runs / "a-backup") == before


@pytest.mark.slow
def test_a_resume_leaves_a_hard_linked_snapshot_of_its_run_as_it_was(prepared, tmp_path, capsys):
    runs, snapshot = tmp_path / "runs", tmp_path / "snapshot"
    args = small_overrides(prepared, "logger=csv", "test=false", "scheduler=none")
    first = run_command(["train.py", *args, "trainer.max_epochs=1", f"hydra.run.dir={runs / 'a'}"], capsys)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    subprocess.run(["cp", "-al", str(runs / "a"), str(snapshot)], check=True)
    before = _stamped(snapshot)
    again = [*args, "trainer.max_epochs=2", "ckpt_path=last", f"hydra.run.dir={runs / 'b'}"]
    resumed = run_command(["train.py", *again], capsys)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((runs / "a" / "metrics.json").read_text())["epochs"] == 2
    assert _stamped(snapshot) == before
