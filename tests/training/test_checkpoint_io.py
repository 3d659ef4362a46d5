"""Checkpoints are written by a background thread: whole files, in the order saves and removals
were made, every write finished when the fit ends, errors not lost."""

from __future__ import annotations

import threading

import pytest
import torch

from nailseg.training import checkpoint_io, run_folder
from nailseg.training.checkpoint_io import BackgroundCheckpointIO


@pytest.fixture(autouse=True)
def _run_folder(tmp_path):
    """Checkpoints are written only into a run folder this process holds."""
    run_folder.hold(tmp_path)
    yield
    run_folder.release(tmp_path)


@pytest.fixture
def release(monkeypatch) -> threading.Event:
    """Every checkpoint write waits until the returned event is set."""
    event = threading.Event()
    write = checkpoint_io.AtomicCheckpointIO.save_checkpoint

    def held_write(self, checkpoint, path, storage_options=None):
        event.wait(10)
        write(self, checkpoint, path, storage_options)

    monkeypatch.setattr(checkpoint_io.AtomicCheckpointIO, "save_checkpoint", held_write)
    return event


def test_the_file_holds_the_state_at_the_save_and_teardown_waits_for_it(tmp_path, release):
    io, weight = BackgroundCheckpointIO(), torch.zeros(3)
    io.save_checkpoint({"weight": weight}, tmp_path / "a.ckpt")
    weight += 1  # training goes on while the write waits
    assert not (tmp_path / "a.ckpt").exists()
    release.set()
    io.teardown()
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["weight"].tolist() == [0, 0, 0]


def test_a_removal_waits_for_the_files_own_queued_write(tmp_path, release):
    # ModelCheckpoint saves a new best, then removes the previous one: had the removal run at
    # once (Lightning's AsyncCheckpointIO does), the previous file's queued write would bring
    # it back after it was removed
    io = BackgroundCheckpointIO()
    io.save_checkpoint({"epoch": 0}, tmp_path / "epoch_000.ckpt")
    io.save_checkpoint({"epoch": 1}, tmp_path / "epoch_001.ckpt")
    io.remove_checkpoint(tmp_path / "epoch_000.ckpt")
    release.set()
    io.teardown()
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["epoch_001.ckpt"]


def test_a_failed_write_is_raised_not_lost(tmp_path):
    io = BackgroundCheckpointIO()
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the checkpoint folder should be")
    with pytest.raises(OSError):  # at the next call or at teardown, whichever comes first
        io.save_checkpoint({"epoch": 0}, blocker / "last.ckpt")
        io.teardown()
    assert blocker.read_text() == "a file where the checkpoint folder should be"
