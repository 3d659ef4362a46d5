"""Shared fixtures: prepared data written the way `prepare.py` writes it, the real data, and what
several test modules read, made once for the whole test session: one trained run and one sweep
with a failing job."""

from __future__ import annotations

import fcntl
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.prepared import write_prepared

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# W&B reads every installed package's metadata at each run start; no test reads that list
os.environ.setdefault("WANDB__SAVE_REQUIREMENTS", "false")
# a suite started in the background of a shell without job control inherits Ctrl-C ignored (and
# passes it on to every command it starts); the Ctrl-C tests press it as a terminal would
signal.signal(signal.SIGINT, signal.default_int_handler)

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


def _once(
    factory: pytest.TempPathFactory, worker_id: str, name: str, make: Callable[[Path], object]
) -> Path:
    """The folder `name` that `make(folder)` filled, once for the whole test session: pytest-xdist's
    workers share it (the first to ask makes it under a lock, the others wait for it)."""
    if worker_id == "master":
        base = factory.mktemp(name)
        make(base)
        return base
    base = factory.getbasetemp().parent / name  # this session's, every worker's
    base.mkdir(exist_ok=True)
    with (base / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (base / ".made").is_file():
            make(base)
            (base / ".made").touch()
    return base


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The last checkpoint of one tiny UNet run (`make_run`: one epoch at 32², on
    `write_prepared`'s data in `<run>/../prepared`), trained once for the whole test session.
    Read it only: a test that writes beside a checkpoint takes a copy of its own (`own_run`)."""
    return _once(tmp_path_factory, worker_id, "trained_run", _train) / "run/checkpoints/last.ckpt"


def _train(base: Path) -> None:
    from support.inference import make_run  # here: pytest-xdist's controller imports no torch

    make_run(write_prepared(base / "prepared"), base / "run")


@pytest.fixture(scope="session")
def failing_sweep(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """`train.py -m` of three jobs with W&B; job 1 fails inside fit, after its W&B run started (a
    one-step schedule cannot take a second optimizer step), so the sweep exits with status 1.
    Returns the sweep folder; its stderr is in `stderr.txt` beside it. Run once for the whole
    test session."""
    return _once(tmp_path_factory, worker_id, "failing_sweep", _run_failing_sweep) / "sweep"


def _run_failing_sweep(base: Path) -> None:
    from support.ddp import run_train
    from support.train import small_overrides
    from wandb import env as wandb_env  # here: the GPU machine's tests run without wandb

    from nailseg.training.loggers import WANDB_DIRS

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
    (base / "stderr.txt").write_text(stderr)
