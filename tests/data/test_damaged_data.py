"""Prepared data that is not as prepare writes it is refused in one line naming the file, never
trained on, never hung on (issue #45), whether the main process or a loader worker meets it; a
prepared root is held with a reader's lock while a training reads it."""

from __future__ import annotations

import fcntl
import os
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from support.cli import run_command
from support.loaders import make_loader, spec
from support.prepared import write_prepared
from support.train import small_overrides

from nailseg.data.datamodule import NailDataModule
from nailseg.data.loaders.base import DataError
from nailseg.data.loaders.torch_workers import TorchLoader
from nailseg.io.folder import BusyError, OwnedFolder, is_live, lock_shared


def _damage(root: Path, how: str) -> str:
    """Damage the prepared root as `how` says; returns what the refusal must name."""
    rows = pd.read_csv(root / "train.csv", dtype=str, keep_default_na=False)
    image, mask = root / rows["images"][3], root / rows["masks"][3]
    if how == "mask-255":
        np.save(mask, np.load(mask) * 255)
        return f"{mask}: a mask holds values [0, 255]"
    if how == "truncated":
        image.write_bytes(image.read_bytes()[:-100])
        return f"{image}: "
    if how == "shape":
        np.save(mask, np.zeros((40, 48, 3), np.uint8))
        return f"{mask}: expected a C-order uint8 HxWx1 array"
    if how == "fifo":
        image.unlink()
        os.mkfifo(image)
        return f"{image} is not a plain file"
    if how == "fifo-csv":
        (root / "valid.csv").unlink()
        os.mkfifo(root / "valid.csv")
        return f"{root / 'valid.csv'} is not a plain file"
    outside = {"absolute": str(image), "dotdot": "../elsewhere/x.npy"}[how]
    rows.loc[3, "masks"] = outside
    rows.to_csv(root / "train.csv", index=False)
    return f"{root / 'train.csv'}: masks {outside!r} is not a path inside {root}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "how", ["mask-255", "truncated", "shape", "fifo", "fifo-csv", "absolute", "dotdot"]
)
def test_train_refuses_damaged_prepared_data_in_one_line(how, tmp_path, capsys):
    """Masks of 0 and 255 trained silently; a truncated npy or a mask of three channels failed
    with a traceback; a FIFO at a file's name hung; a CSV row could name any file."""
    root = write_prepared(tmp_path / "prepared")
    named = _damage(root, how)
    run_dir = f"hydra.run.dir={tmp_path / 'run'}"
    argv = ["train.py", *small_overrides(root, "logger=none", "loader=torch", run_dir)]
    done = run_command(argv, capsys)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert last.startswith("train.py: DataError: ") and named in last, last


@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_damaged_mid_training_is_named_in_one_line(workers, tmp_path):
    """What a loader worker meets reaches the training as the worker's one line, not as torch's
    copy of the worker's traceback."""
    root = write_prepared(tmp_path / "prepared")
    loader = make_loader("torch", root, spec(), batch_size=4, num_workers=workers)
    mask = Path(loader.records.masks[5])
    np.save(mask, np.load(mask) * 255)  # a mask the up-front sample read before the damage
    try:  # not pytest.raises: its record of the traceback would keep the workers alive
        list(loader)
        message = "no error"
    except DataError as err:
        message = str(err)
    loader.close()
    assert message.startswith(f"{mask}: a mask holds values [0, 255]") and "\n" not in message


def _datamodule(root: Path) -> NailDataModule:
    settings = {"batch_size": 4, "device": "cpu", "seed": 0, "num_workers": 0}
    settings |= {"pin_memory": False, "persistent_workers": False, "prefetch": 2}
    return NailDataModule(root, (32, 32), partial(TorchLoader, **settings), spec(), "auto", [], 1.0)


@pytest.mark.slow
def test_a_training_holds_its_prepared_root_against_prepare(tmp_path):
    """prepare rewrote or pruned a root while a training read it (the training died): now the
    training holds a reader's lock from the start to its teardown, which prepare's claim, and
    `make clean`, respect; a training refuses a root prepare is writing."""
    root = write_prepared(tmp_path / "prepared")
    datamodule = _datamodule(root)
    assert is_live(root)
    with pytest.raises(BusyError, match="another nailseg command is using"):
        OwnedFolder.claim(root, "prepare", key="output_dir")  # prepare's claim
    datamodule.teardown("fit")
    assert not is_live(root)
    datamodule.setup("test")
    assert is_live(root)
    datamodule.teardown("test")

    writer = os.open(root, os.O_RDONLY)  # prepare writing: its lock is exclusive
    fcntl.flock(writer, fcntl.LOCK_EX)
    try:
        with pytest.raises(BusyError, match=r"choose another dataset\.root"):
            _datamodule(root)
    finally:
        os.close(writer)
    os.close(lock_shared(root, "dataset.root"))  # nothing left held
