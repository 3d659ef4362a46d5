"""The built-in synthetic dataset as train.py gets it (`prepare_builtin`): made on first use, made
again when its options change, made once when many processes (DDP ranks) ask at the same time, and
only in its own folders (under `paths.data_dir`): a folder the user names is never filled."""

from __future__ import annotations

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
from nailseg.io.folder import OWN_NAMES, OwnedFolder
from nailseg.prep.builtin import makes, missing_data, prepare_builtin
from nailseg.prep.format import read_table
from nailseg.prep.prepare import PrepareError, run
from nailseg.synth.scene import GROUPS

RANKS = 3


def _prepare_cfg(base: Path, n: int = 8, seed: int = 0, *named: str):
    """prepare.py's config with the data under `base` (paths.data_dir): the built-in set's own
    folders are base/synthetic/raw and base/synthetic/prepared, unless `named` names others."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(
            "prepare",
            overrides=[
                f"paths.data_dir={base}",
                f"dataset.synthetic.n={n}",
                f"dataset.synthetic.seed={seed}",
                *named,
            ],
        )


def _dataset(base: Path, n: int = 8, seed: int = 0, *named: str):
    return _prepare_cfg(base, n, seed, *named).dataset


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


@pytest.mark.slow
def test_changed_options_make_and_prepare_the_set_again(tmp_path):
    assert prepare_builtin(_dataset(tmp_path, n=8))
    assert not prepare_builtin(_dataset(tmp_path, n=8))  # current: used as it is
    first = np.load(tmp_path / "synthetic/prepared/images/studio/s0000.npy")
    assert prepare_builtin(_dataset(tmp_path, n=12))
    assert len(_rows(tmp_path / "synthetic/prepared")) == 12
    assert prepare_builtin(_dataset(tmp_path, n=12, seed=1))
    assert not np.array_equal(
        np.load(tmp_path / "synthetic/prepared/images/studio/s0000.npy"), first
    )
    close = np.load(tmp_path / "synthetic/prepared/images/desk/s0001.npy")
    assert prepare_builtin(_dataset(tmp_path, 12, 1, "dataset.synthetic.framing=wild"))
    wild = np.load(tmp_path / "synthetic/prepared/images/desk/s0001.npy")
    assert close.shape == wild.shape and not np.array_equal(close, wild)
    assert prepare_builtin(_dataset(tmp_path, n=4, seed=1))  # smaller: the rest is pruned
    assert _rows(tmp_path / "synthetic/prepared") == sorted(
        f"images/{GROUPS[i]}/s{i:04d}.npy" for i in range(4)
    )
    assert not (tmp_path / "synthetic/prepared/images/studio/s0004.npy").exists()
    shutil.rmtree(
        tmp_path / "synthetic/raw"
    )  # the photos removed to save space: the root is still current
    assert not prepare_builtin(_dataset(tmp_path, n=4, seed=1))
    assert not (tmp_path / "synthetic/raw").exists()


def test_a_root_prepared_without_a_synthetic_source_is_used_as_it_is(tmp_path):
    """Data written by hand (or by a nailseg that recorded no source) under a built-in dataset's
    root: nothing is generated, nothing in it touched."""
    root = write_prepared(tmp_path / "synthetic/prepared")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert not prepare_builtin(_dataset(tmp_path))
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "synthetic/raw").exists()


def _rank(dataset, start: Barrier, results: Queue) -> None:
    start.wait()
    try:
        results.put(("ok", prepare_builtin(dataset)))
    except BaseException as err:  # the test reports what failed in the rank
        results.put(("failed", f"{type(err).__name__}: {err}"))


@pytest.mark.slow
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
    assert _prepared(tmp_path / "shared/synthetic/prepared") == _prepared(
        tmp_path / "alone/synthetic/prepared"
    )
    leftovers = [p.name for p in (tmp_path / "shared").rglob(".*") if p.name not in OWN_NAMES]
    assert leftovers == []  # no temp file of a rank left behind


@pytest.mark.slow
def test_a_rank_waits_a_bounded_time_then_says_why(tmp_path):
    dataset = _dataset(tmp_path)
    root = Path(dataset.root)
    root.mkdir(parents=True)
    ready, release = multiprocessing.get_context("fork").Event(), os.pipe()

    def hold_the_lock() -> None:  # another process, stuck while preparing
        OwnedFolder.claim(root, "prepare")
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


@pytest.mark.parametrize("named", ["dataset.root", "dataset.raw_dir"])
def test_a_folder_the_user_names_is_never_filled(tmp_path, named):
    """`train.py dataset.root=/some/typo` generated the synthetic set and prepared it there."""
    data, mine = tmp_path / "data", tmp_path / "mine"
    dataset = _dataset(data, 8, 0, f"{named}={mine}")
    assert not makes(dataset) and not prepare_builtin(dataset)
    assert list(tmp_path.iterdir()) == []  # neither the named folder nor the set's own ones
    assert missing_data(dataset).endswith(
        f"to make it here: `python prepare.py dataset=synthetic dataset.synthetic.n=8 {named}={mine}"
        + ("`" if named == "dataset.root" else f" dataset.root={data}/synthetic/prepared`")
    )


@pytest.mark.slow
def test_a_set_asked_for_by_name_elsewhere_is_used_as_made_never_remade(tmp_path):
    data, mine = tmp_path / "data", tmp_path / "mine"
    # python prepare.py dataset=synthetic dataset.root=MINE: the user asks for the set there
    run(_prepare_cfg(data, 8, 0, f"dataset.root={mine}"))
    assert missing_data(_dataset(data, 8, 0, f"dataset.root={mine}")) is None
    other = _dataset(data, 12, 0, f"dataset.root={mine}")
    assert not prepare_builtin(other) and len(_rows(mine)) == 8
    assert missing_data(other) == (
        f"dataset.root={mine} holds another synthetic set than n=12, seed=0, and train.py makes "
        f"the synthetic set only in its own folders ({data}/synthetic/raw, "
        f"{data}/synthetic/prepared); to make it here: `python prepare.py dataset=synthetic "
        f"dataset.synthetic.n=12 dataset.root={mine}`"
    )
