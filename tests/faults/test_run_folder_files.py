"""What training writes inside its run folder (metrics.json, checkpoints, the CSV log, ...) replaces
or removes only files nailseg recorded and that are unchanged: a user's file, or a link, where
nailseg's would go stays as it is and the run's summary names it."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from support.train import train

from nailseg.io.atomic import NotOursError
from nailseg.training import run_folder
from nailseg.training.checkpoint_io import AtomicCheckpointIO

ONE_EPOCH = ("trainer.max_epochs=1", "logger=none", "test=false", "scheduler=none")


def _summary(caplog: pytest.LogCaptureFixture) -> str:
    """The last run's summary (an earlier run's is captured too where the root logger is at INFO)."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("run summary")][-1]


@pytest.mark.slow
def test_a_users_metrics_json_and_last_ckpt_in_a_run_folder_stay_and_are_named(
    prepared, tmp_path, caplog
):
    run_dir = tmp_path / "run"
    train(prepared, run_dir, *ONE_EPOCH)
    (run_dir / "metrics.json").write_text("the user's notes")
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"the user's own checkpoint")
    with caplog.at_level(logging.INFO):
        train(prepared, run_dir, "trainer.max_epochs=2", *ONE_EPOCH[1:])
    assert (run_dir / "metrics.json").read_text() == "the user's notes"
    assert (run_dir / "checkpoints" / "last.ckpt").read_bytes() == b"the user's own checkpoint"
    summary = _summary(caplog)
    for kept in (run_dir / "metrics.json", run_dir / "checkpoints" / "last.ckpt"):
        assert f"kept, not nailseg's (so not written): {kept}" in summary
    # nailseg's own files there are still replaced: the best checkpoint is this fit's
    best = torch.load(run_dir / "checkpoints" / "epoch_000.ckpt", weights_only=True)
    assert best["global_step"] == 3


@pytest.mark.slow
def test_a_link_at_metrics_json_is_never_followed_nor_replaced(prepared, tmp_path, caplog):
    run_dir, outside = tmp_path / "run", tmp_path / "outside.json"
    train(prepared, run_dir, *ONE_EPOCH)
    outside.write_text("outside")
    (run_dir / "metrics.json").unlink()
    (run_dir / "metrics.json").symlink_to(outside)
    with caplog.at_level(logging.INFO):
        train(prepared, run_dir, *ONE_EPOCH)
    assert outside.read_text() == "outside" and (run_dir / "metrics.json").is_symlink()
    assert f"kept, not nailseg's (so not written): {run_dir / 'metrics.json'}" in _summary(caplog)


@pytest.mark.slow
def test_a_linked_checkpoint_folder_is_refused_before_the_fit(prepared, tmp_path):
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    train(prepared, run_dir, *ONE_EPOCH)
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "checkpoints").symlink_to(outside, target_is_directory=True)
    with pytest.raises(NotOursError, match=rf"{run_dir / 'checkpoints'} is a symbolic link"):
        train(prepared, run_dir, *ONE_EPOCH)
    assert os.listdir(outside) == []


@pytest.mark.slow
def test_a_users_csv_log_in_the_run_folder_is_refused_not_deleted(prepared, tmp_path):
    run_dir = tmp_path / "run"
    run_folder.hold(run_dir)  # a run folder nailseg made, before any logger reserved its folder
    run_folder.release(run_dir)
    (run_dir / "csv").mkdir()
    (run_dir / "csv" / "metrics.csv").write_text("step,mine\n0,1\n")
    with pytest.raises(NotOursError, match=r"csv lies where nailseg would write"):
        train(prepared, run_dir, *ONE_EPOCH[:1], "logger=csv", *ONE_EPOCH[2:])
    assert (run_dir / "csv" / "metrics.csv").read_text() == "step,mine\n0,1\n"


def test_a_checkpoint_lightning_removes_goes_only_while_it_is_nailsegs(tmp_path):
    io = AtomicCheckpointIO()
    ours, users = tmp_path / "epoch_000.ckpt", tmp_path / "epoch_001.ckpt"
    run_folder.hold(tmp_path)
    try:
        io.save_checkpoint({"epoch": 0}, ours)
        users.write_bytes(b"the user's")
        io.remove_checkpoint(users)
        io.remove_checkpoint(ours)
        assert not ours.exists() and users.read_bytes() == b"the user's"
        io.save_checkpoint({"epoch": 1}, users)
        assert users.read_bytes() == b"the user's"
    finally:
        run_folder.release(tmp_path)
