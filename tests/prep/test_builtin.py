"""The built-in synthetic dataset as train.py gets it (`prepare_builtin`): made on first use, made
again when its options change, and made once when many processes (DDP ranks) ask at the same time."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import shutil
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from support.prepared import write_prepared

from nailseg.config import CONF_DIR
from nailseg.prep.builtin import prepare_builtin
from nailseg.prep.format import BUILTIN_LOCK_FILE, read_table
from nailseg.prep.prepare import PrepareError
from nailseg.prep.synthetic import GROUPS

RANKS = 3


def _dataset(base: Path, n: int = 8, seed: int = 0):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            "prepare",
            overrides=[
                f"dataset.raw_dir={base / 'raw'}",
                f"dataset.root={base / 'prepared'}",
                f"dataset.synthetic.n={n}",
                f"dataset.synthetic.seed={seed}",
            ],
        )
    return cfg.dataset


def _rows(root: Path) -> list[str]:
    return sorted(
        row for split in ("train", "valid") for row in read_table(root / f"{split}.csv")["images"]
    )


def _prepared(root: Path) -> dict[str, bytes]:
    """The arrays and the split CSVs (the manifest holds the sources' times, which differ)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.suffix == ".npy" or p.name in ("train.csv", "valid.csv", "excluded.csv")
    }


def test_changed_options_make_and_prepare_the_set_again(tmp_path):
    assert prepare_builtin(_dataset(tmp_path, n=8))
    assert not prepare_builtin(_dataset(tmp_path, n=8))  # current: used as it is
    first = np.load(tmp_path / "prepared/images/studio/s0000.npy")
    assert prepare_builtin(_dataset(tmp_path, n=12))
    assert len(_rows(tmp_path / "prepared")) == 12
    assert prepare_builtin(_dataset(tmp_path, n=12, seed=1))
    assert not np.array_equal(np.load(tmp_path / "prepared/images/studio/s0000.npy"), first)
    assert prepare_builtin(_dataset(tmp_path, n=4, seed=1))  # smaller: the rest is pruned
    assert _rows(tmp_path / "prepared") == sorted(
        f"images/{GROUPS[i]}/s{i:04d}.npy" for i in range(4)
    )
    assert not (tmp_path / "prepared/images/studio/s0004.npy").exists()
    shutil.rmtree(tmp_path / "raw")  # the photos removed to save space: the root is still current
    assert not prepare_builtin(_dataset(tmp_path, n=4, seed=1))
    assert not (tmp_path / "raw").exists()


def test_a_root_prepared_without_a_synthetic_source_is_used_as_it_is(tmp_path):
    """Data written by hand (or by a nailseg that recorded no source) under a built-in dataset's
    root: nothing is generated, nothing in it touched."""
    root = write_prepared(tmp_path / "prepared")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert not prepare_builtin(_dataset(tmp_path))
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "raw").exists()


def _rank(dataset, start: Barrier, results: Queue) -> None:
    start.wait()
    try:
        results.put(("ok", prepare_builtin(dataset)))
    except BaseException as err:  # the test reports what failed in the rank
        results.put(("failed", f"{type(err).__name__}: {err}"))


def test_ranks_asking_at_once_wait_for_one_and_share_its_result(tmp_path):
    ctx = multiprocessing.get_context("fork")  # the ranks start at once, on this checkout's code
    dataset = _dataset(tmp_path / "shared")
    start, results = ctx.Barrier(RANKS), ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(dataset, start, results)) for _ in range(RANKS)]
    for rank in ranks:
        rank.start()
    outcomes = [results.get(timeout=120) for _ in ranks]
    for rank in ranks:
        rank.join()
    assert sorted(outcomes) == [("ok", False)] * (RANKS - 1) + [("ok", True)]
    assert prepare_builtin(_dataset(tmp_path / "alone"))
    assert _prepared(tmp_path / "shared/prepared") == _prepared(tmp_path / "alone/prepared")
    leftovers = [
        p.name
        for p in (tmp_path / "shared").rglob(".*")
        if p.name not in (".prepare.lock", BUILTIN_LOCK_FILE)
    ]
    assert leftovers == []  # no temp file of a rank left behind


def test_a_rank_waits_a_bounded_time_then_says_why(tmp_path):
    dataset = _dataset(tmp_path)
    root = Path(dataset.root)
    root.mkdir()
    ready, release = multiprocessing.get_context("fork").Event(), os.pipe()

    def hold_the_lock() -> None:  # another process, stuck while preparing
        fd = os.open(root / BUILTIN_LOCK_FILE, os.O_RDWR | os.O_CREAT)
        fcntl.lockf(fd, fcntl.LOCK_EX)
        ready.set()
        os.read(release[0], 1)

    holder = multiprocessing.get_context("fork").Process(target=hold_the_lock)
    holder.start()
    try:
        ready.wait(timeout=30)
        with pytest.raises(PrepareError, match=r"has not finished after 0\.3 s.*stuck"):
            prepare_builtin(dataset, wait_s=0.3)
        assert not Path(dataset.raw_dir).exists()  # nothing generated meanwhile
    finally:
        os.write(release[1], b"x")
        holder.join()
    assert prepare_builtin(dataset, wait_s=0.3)  # the lock freed: this one does the work
