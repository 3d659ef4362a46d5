"""Checkpoints are written by a writer process fed from a background thread: whole files holding
what `torch.save` of the checkpoint would hold, in the order saves and removals were made, every
write finished when the fit ends, errors not lost."""

from __future__ import annotations

import pytest
import torch

from nailseg.training.checkpoint_io import BackgroundCheckpointIO


def test_the_file_holds_the_state_at_the_save_and_teardown_waits_for_it(tmp_path):
    io, weight = BackgroundCheckpointIO(), torch.zeros(3)
    io.save_checkpoint({"weight": weight}, tmp_path / "a.ckpt")
    weight += 1  # training goes on while the writer process starts and writes
    io.teardown()
    assert torch.load(tmp_path / "a.ckpt", weights_only=True)["weight"].tolist() == [0, 0, 0]
    assert [p.name for p in tmp_path.iterdir()] == ["a.ckpt"]  # no staging file left


def test_the_file_holds_what_torch_save_would(tmp_path):
    checkpoint = {
        "state_dict": {
            "conv": torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last),
            "half": torch.randn(7).to(torch.bfloat16),
            "index": torch.arange(5),
            "flag": torch.tensor(True),
            "transposed": torch.randn(4, 3).t(),  # not one block of memory
            "empty": torch.zeros(0, 3),
        },
        "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.1}]}],
        "epoch": 3,
        "name": "last",
    }  # fmt: skip
    io = BackgroundCheckpointIO()
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    io.teardown()
    torch.save(checkpoint, tmp_path / "expected.ckpt")
    written = torch.load(tmp_path / "a.ckpt", weights_only=True)
    expected = torch.load(tmp_path / "expected.ckpt", weights_only=True)
    assert written.keys() == expected.keys()
    assert written["optimizer_states"] == expected["optimizer_states"]
    assert (written["epoch"], written["name"]) == (3, "last")
    for key, tensor in expected["state_dict"].items():
        got = written["state_dict"][key]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(got, tensor), key
        if key != "transposed":  # a dense layout is kept (channels-last weights stay so)
            assert got.stride() == tensor.stride(), key


def test_a_removal_waits_for_the_files_own_queued_write(tmp_path):
    # ModelCheckpoint saves a new best, then removes the previous one: had the removal run at
    # once (Lightning's AsyncCheckpointIO does), the previous file's queued write would bring
    # it back after it was removed (the writer process is still starting here)
    io = BackgroundCheckpointIO()
    io.save_checkpoint({"epoch": 0, "w": torch.zeros(2)}, tmp_path / "epoch_000.ckpt")
    io.save_checkpoint({"epoch": 1, "w": torch.ones(2)}, tmp_path / "epoch_001.ckpt")
    io.remove_checkpoint(tmp_path / "epoch_000.ckpt")
    io.teardown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch_001.ckpt"]


def test_a_failed_write_is_raised_not_lost(tmp_path):
    io = BackgroundCheckpointIO()
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the checkpoint folder should be")
    with pytest.raises(OSError):  # at the next call or at teardown, whichever comes first
        io.save_checkpoint({"epoch": 0, "w": torch.zeros(2)}, blocker / "last.ckpt")
        io.teardown()
    assert blocker.read_text() == "a file where the checkpoint folder should be"


def test_a_write_that_fails_in_the_writer_process_is_raised_naming_the_file(tmp_path):
    target = tmp_path / "last.ckpt"
    target.mkdir()  # a folder where the file should go: the rename into place fails
    io = BackgroundCheckpointIO()
    io.save_checkpoint({"epoch": 0, "w": torch.zeros(2)}, target)
    with pytest.raises(RuntimeError, match=f"could not write {target}"):
        io.teardown()
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary files left


def test_a_writer_process_that_died_is_raised_not_waited_for(tmp_path):
    io = BackgroundCheckpointIO()
    io.save_checkpoint({"epoch": 0}, tmp_path / "a.ckpt")
    io._executor.submit(lambda: None).result()  # the first save is written
    io._writer.kill()  # as the kernel's OOM killer would
    io.save_checkpoint({"epoch": 1}, tmp_path / "b.ckpt")
    with pytest.raises(RuntimeError, match="writer process exited"):
        io.teardown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]
