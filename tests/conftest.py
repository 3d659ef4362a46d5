"""Shared fixtures: prepared data written the way `prepare.py` writes it, the real data, and one
sweep with a failing job that several test modules read."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ddp import run_train
from support.prepared import write_prepared
from support.train import small_overrides

from nailseg.training.loggers import WANDB_DIRS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# W&B reads every installed package's metadata at each run start; no test reads that list
os.environ.setdefault("WANDB__SAVE_REQUIREMENTS", "false")

REAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "nails"
OWN_FOLDERS = ("outputs", "multirun", "data")  # where the project's own runs and data go


@pytest.fixture(scope="session", autouse=True)
def the_checkout_stays_as_it_was() -> Iterator[None]:
    """No test writes into the project's own runs, sweeps or data: each run goes to its tmp_path."""
    root = Path(__file__).resolve().parents[1]

    def listing() -> set[Path]:
        return {p for name in OWN_FOLDERS for p in (root / name).glob("*/*")}

    before = listing()
    yield
    assert sorted(listing() - before) == [], "tests wrote into the checkout"


@pytest.fixture
def real_data() -> Path:
    """The real photos in ../shared/data/nails; skips where a fresh clone has no ../shared."""
    if not (REAL_DATA / "Images").is_dir():
        pytest.skip(
            f"real nail data not found at {REAL_DATA} (../shared is absent in a fresh clone)"
        )
    return REAL_DATA


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    return write_prepared(tmp_path / "prepared")


@pytest.fixture(scope="session")
def failing_sweep(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """`train.py -m` of three jobs with W&B; job 1 fails inside fit, after its W&B run started (a
    one-step schedule cannot take a second optimizer step), so the sweep exits with status 1.
    Returns the sweep folder; its stderr is in `stderr.txt` beside it. Run once for the whole
    test session: pytest-xdist's workers share it (the first to ask runs it, the others wait)."""
    if worker_id == "master":
        return _run_failing_sweep(tmp_path_factory.mktemp("failing_sweep"))
    base = tmp_path_factory.getbasetemp().parent / "failing_sweep"  # this session's, every worker's
    base.mkdir(exist_ok=True)
    with (base / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / "stderr.txt").is_file():
            _run_failing_sweep(base)
    return base / "sweep"


def _run_failing_sweep(base: Path) -> Path:
    from wandb import env as wandb_env  # here: the GPU machine's tests run without wandb

    overrides = small_overrides(
        write_prepared(base / "prepared"),
        "logger=wandb",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "test=false",
        "scheduler=onecycle",
        "scheduler.total_steps=null,1,null",
    )
    # W&B as a user's sweep starts it: its own service and folders, not those an earlier test in
    # this process left in the environment (in-process runs point the folders into their own)
    with pytest.MonkeyPatch.context() as env:
        for var in (wandb_env.SERVICE, *WANDB_DIRS):
            env.delenv(var, raising=False)
        stderr = run_train("-m", *overrides, f"hydra.sweep.dir={base / 'sweep'}", returncode=1)
    (base / "stderr.txt").write_text(stderr)  # last: the mark of a finished sweep
    return base / "sweep"
