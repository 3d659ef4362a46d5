"""Run folders: one training writes a folder at a time, a checkpoint kept elsewhere is only read, a
moved or copied run resumes with its best, a resume must be on the run's data, and
`ckpt_path=last` takes the newest run that can be resumed, or names each it could not."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
import torch
from support.cli import run_command
from support.prepared import write_prepared
from support.train import small_overrides, train

from nailseg.io.atomic import NotOursError
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
