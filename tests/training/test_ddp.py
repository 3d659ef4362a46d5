"""DDP on CPU (2 gloo processes through Lightning's launcher, re-running the real `train.py`),
with the default callbacks, progress bar included.

One sweep of two DDP jobs is shared by the tests: `trainer=ddp` as the README runs it (its DDP
options given as a strategy object) ends, and `trainer=cpu trainer.devices=2` reaches DDP
through Lightning's default strategy; each job runs its own config in its own dir (Lightning
alone would make rank 1 re-run the whole sweep, in a second sweep dir), rank-0-only outputs,
every training row seen once per epoch across ranks (the sample ledger), every validation row
counted once, and the DDP validation Dice equal to a single-process validation of the same
weights. SIGTERM ends a DDP job stuck in a collective, every process of it.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from PIL import Image
from support.ddp import ddp_overrides, finish, job_dirs, processes_left, start_train
from support.loaders import spec, trainer_stand_in
from support.prepared import write_prepared
from support.processes import session_processes
from support.train import compose_train
from support.wandb_records import history

from nailseg.data.datamodule import NailDataModule
from nailseg.prep.format import read_table, write_table
from nailseg.training.build import build
from nailseg.training.jobs import GRACE_S, Terminated, isolated_job
from nailseg.training.ledger import train_rows_once

pytestmark = pytest.mark.slow  # trains in subprocesses (DDP ranks, sweeps, kills)

N_TRAIN, N_VALID, BATCH, EPOCHS = 13, 5, 2, 2


def read_ledger(ledger: Path, stage: str) -> dict[tuple[int, int], list[int]]:
    """{(epoch, rank): rows} of one stage."""
    entries = [json.loads(p.read_text()) for p in ledger.glob(f"{stage}_*.json")]
    return {(e["epoch"], e["rank"]): e["rows"] for e in entries}


def logged(run_dir: Path, key: str) -> list[float]:
    """Every value of `key` the run's W&B history holds, in order."""
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return [row[key] for row in history(run_file) if key in row]


# each job's own config, a user's experiment (hydra.searchpath) named by what it runs: `trainer=ddp`
# as the README runs it, DDP's own options (static graph, 1 MB gradient buckets) given as a
# strategy object; and `trainer=cpu` on 2 devices, which reaches DDP through Lightning's default
# strategy (none given). Each also puts its sample ledger in a folder of its own.
EXPERIMENTS = {
    "strategy_object": (
        "ddp",
        {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": {
                "_target_": "lightning.pytorch.strategies.DDPStrategy",
                "static_graph": True,
                "bucket_cap_mb": 1,
            },
        },
    ),
    "default_strategy": ("cpu", {"devices": 2}),
}


@dataclass(frozen=True)
class DdpJob:
    run_dir: Path
    ledger: Path  # the job's sample ledger, where its own config puts it
    stdout: str  # what the sweep printed while this job ran (rank 0's progress bar)


@dataclass(frozen=True)
class DdpSweep:
    root: Path  # the prepared data
    sweep_dirs: list[Path]  # the dated sweep dirs made (rank 1 re-running the sweep makes a 2nd)
    jobs: list[Path]  # the run dirs in the first sweep dir, in EXPERIMENTS' order
    ledgers: list[Path]  # each job's ledger, in EXPERIMENTS' order
    stdout: str  # what the sweep printed, Hydra's `#<job> : <overrides>` lines included
    left: list[int]  # processes naming the sweep's folder that outlived it

    def job(self, experiment: str) -> DdpJob:
        """The job of one experiment; its stdout from Hydra's line that launched it."""
        index = list(EXPERIMENTS).index(experiment)
        printed = self.stdout.split(f"#{index} : ")[1].split(f"#{index + 1} : ")[0]
        return DdpJob(self.jobs[index], self.ledgers[index], printed)


@pytest.fixture(scope="module")
def ddp_sweep(tmp_path_factory) -> DdpSweep:
    """`train.py -m` of the EXPERIMENTS, each job 2 CPU processes with the default callbacks, the
    sample ledger and W&B, under the default-style dated sweep dir."""
    tmp = tmp_path_factory.mktemp("ddp")
    root = write_prepared(tmp / "prepared", n_train=N_TRAIN, n_valid=N_VALID)
    conf, sweeps = tmp / "conf", tmp / "multirun"
    ledgers = [tmp / f"ledger_{name}" for name in EXPERIMENTS]
    (conf / "experiment").mkdir(parents=True)
    for (name, (trainer, keys)), ledger in zip(EXPERIMENTS.items(), ledgers, strict=True):
        experiment = {
            "defaults": [{"override /trainer": trainer}],
            "trainer": keys,
            "callbacks": {"ledger": {"dirpath": str(ledger)}},
        }
        text = "# @package _global_\n" + yaml.safe_dump(experiment, sort_keys=False)
        (conf / "experiment" / f"{name}.yaml").write_text(text)
    overrides = [o for o in ddp_overrides(root) if not o.startswith("trainer=")]
    try:
        stdout, _ = finish(
            start_train(
                "-m",
                *overrides,
                f"hydra.searchpath=[file://{conf}]",
                f"experiment={','.join(EXPERIMENTS)}",
                f"trainer.max_epochs={EPOCHS}",
                "callbacks=audit",
                "logger=wandb",
                f"hydra.sweep.dir={sweeps}/${{now:%Y-%m-%d_%H-%M-%S-%f}}",
            )
        )
    finally:
        left = processes_left(str(tmp))
    sweep_dirs = sorted(sweeps.iterdir())
    return DdpSweep(root, sweep_dirs, job_dirs(sweep_dirs[0]), ledgers, stdout, left)


def test_each_job_runs_its_own_config_in_its_own_dir(ddp_sweep):
    assert len(ddp_sweep.sweep_dirs) == 1  # rank 1 re-ran its job only, not the whole sweep
    assert [p.name for p in ddp_sweep.jobs] == ["0", "1"]
    for name, (trainer, _) in EXPERIMENTS.items():
        job = ddp_sweep.job(name)
        assert (job.run_dir / "metrics.json").is_file()
        assert (job.run_dir / "train_ddp_process_1.log").is_file()
        metrics = json.loads((job.run_dir / "metrics.json").read_text())
        assert metrics["choices"]["trainer"] == trainer
        # rank 1 got this job's overrides: its ledger is where this job's config puts it
        ranks = {json.loads(p.read_text())["rank"] for p in job.ledger.glob("train_*.json")}
        assert ranks == {0, 1}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_one_run_dir_written_by_rank_zero(ddp_sweep, experiment):
    run_dir = ddp_sweep.job(experiment).run_dir
    for path in ("metrics.json", "checkpoints/last.ckpt", ".hydra/config.yaml"):
        assert (run_dir / path).is_file(), path
    assert len(list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 1  # rank 0's run only
    assert (run_dir / "train_ddp_process_1.log").is_file()  # rank 1's Python log, same dir
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["epochs"] == EPOCHS
    assert metrics["global_step"] == EPOCHS * (N_TRAIN // 2 // BATCH)  # steps per rank


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_training_row_is_seen_once_per_epoch_across_ranks(ddp_sweep, experiment):
    job = ddp_sweep.job(experiment)
    ledger = read_ledger(job.ledger, "train")
    assert sorted(ledger) == [(e, r) for e in range(EPOCHS) for r in (0, 1)]
    share = N_TRAIN // 2  # equal shares; the one row left over is dropped (a new one each epoch)
    for epoch in range(EPOCHS):
        rank0, rank1 = ledger[epoch, 0], ledger[epoch, 1]
        assert len(rank0) == len(rank1) == share
        assert not set(rank0) & set(rank1)  # no row on two ranks
        assert len(set(rank0) | set(rank1)) == 2 * share <= N_TRAIN  # no row twice on one rank
        assert set(rank0) | set(rank1) <= set(range(N_TRAIN))
    assert logged(job.run_dir, "train/samples") == [2 * share] * EPOCHS
    # the verdict `python -m nailseg compare` reports for a job's ledger
    assert train_rows_once(job.ledger) == f"every row once in each of {EPOCHS} epochs"
    metrics = json.loads((job.run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    per_epoch = metrics["throughput"]["per_epoch"]  # summed over the ranks, as logged
    assert [e["images_per_s"] for e in per_epoch] == pytest.approx(
        logged(job.run_dir, "train/images_per_s")
    )


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_validation_row_is_counted_once_with_uneven_batches(ddp_sweep, experiment):
    job = ddp_sweep.job(experiment)
    ledger = read_ledger(job.ledger, "val")
    for epoch in range(EPOCHS):
        # rows r::2: rank 0 runs two batches ([0, 2], [4]), rank 1 one ([1, 3]) -- no padding
        assert ledger[epoch, 0] == [0, 2, 4] and ledger[epoch, 1] == [1, 3]
    assert logged(job.run_dir, "val/samples") == [N_VALID] * EPOCHS
    test = read_ledger(
        job.ledger, "test"
    )  # the final evaluation on valid: once more, each row once
    rows = sorted(row for rank_rows in test.values() for row in rank_rows)
    assert len(test) == 2 and rows == list(range(N_VALID))


def test_ddp_validation_dice_equals_single_process_on_the_same_weights(ddp_sweep, tmp_path):
    root, run_dir = (
        ddp_sweep.root,
        ddp_sweep.job("default_strategy").run_dir,
    )  # fp32, as the single process
    ddp_dice = json.loads((run_dir / "metrics.json").read_text())["fit"]["val/dice"]
    built = build(compose_train(ddp_overrides(root, "logger=none"), tmp_path / "single"))
    last = run_dir / "checkpoints" / "last.ckpt"  # the weights the last validation ran on
    (single,) = built.trainer.validate(
        built.module, datamodule=built.datamodule, ckpt_path=last, weights_only=True
    )
    assert single["val/samples"] == N_VALID
    assert single["val/dice"] == pytest.approx(ddp_dice, abs=1e-6)


def test_ddp_options_through_a_strategy_object(ddp_sweep):
    """The other rank starts as with `ddp` (re-running this job) and every training row is still
    seen once per epoch across the ranks."""
    job = ddp_sweep.job("strategy_object")
    config = yaml.safe_load((job.run_dir / ".hydra" / "config.yaml").read_text())
    assert config["trainer"]["strategy"]["_target_"] == "lightning.pytorch.strategies.DDPStrategy"
    assert (job.run_dir / "metrics.json").is_file()
    assert (job.run_dir / "train_ddp_process_1.log").is_file()
    seen = read_ledger(job.ledger, "train")
    share = N_TRAIN // 2
    for epoch in range(EPOCHS):
        rank0, rank1 = seen[epoch, 0], seen[epoch, 1]
        assert len(rank0) == len(rank1) == share and not set(rank0) & set(rank1)


def test_trainer_ddp_with_the_default_callbacks_ends(ddp_sweep):
    """Rank 0's progress display (a line per epoch, stdout being a pipe) reads the logged values
    at each epoch's end. Lightning's bar computed them there, a collective on rank 0 alone, so the
    fit hung at its first epoch's end."""
    job = ddp_sweep.job("strategy_object")
    assert f"epoch {EPOCHS - 1}/{EPOCHS - 1}: " in job.stdout and ", val/dice " in job.stdout
    metrics = json.loads((job.run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["epochs"] == EPOCHS
    assert len(metrics["throughput"]["per_epoch"]) == EPOCHS  # its all-reduce, every epoch
    assert metrics["final"]["metrics"]["val_best/samples"] == N_VALID
    assert (job.run_dir / "checkpoints" / "last.ckpt").is_file()
    assert len(list(job.run_dir.glob("wandb/offline-run-*/run-*.wandb"))) == 1
    # rank 0 draws from its own validation rows (0, 2 and 4 of 5): 3 columns of 32 + 2 pixels
    assert Image.open(sorted(job.run_dir.glob("overlays/epoch_*.png"))[-1]).width == 2 + 3 * 34


def test_ddp_through_lightnings_default_strategy_runs_each_job_once(ddp_sweep):
    # trainer=cpu trainer.devices=2 and no trainer.strategy: Lightning's "auto" starts rank 1 as
    # a script; it re-ran its job only, not the sweep in a dir of its own, and outlived no job
    assert len(ddp_sweep.sweep_dirs) == 1
    assert ddp_sweep.left == [], f"processes left running: {ddp_sweep.left}"
    run_dir = ddp_sweep.job("default_strategy").run_dir
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    assert config["trainer"]["strategy"] is None and config["trainer"]["devices"] == 2
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["choices"]["trainer"] == "cpu" and metrics["world_size"] == 2
    assert (run_dir / "train_ddp_process_1.log").is_file()


class _Loader:
    """Stands in for a loader backend: records how it was built and whether it was closed."""

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.closed = kwargs, False

    def set_epoch(self, epoch: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _datamodule(prepared: Path, rank: int, world_size: int) -> NailDataModule:
    datamodule = NailDataModule(
        prepared, (32, 32), functools.partial(_Loader), spec(), "auto", mix=[], weight=1.0
    )
    datamodule.trainer = trainer_stand_in(rank, world_size)
    return datamodule


def test_eval_split_smaller_than_the_world_fails_on_every_rank(prepared):
    # 5 valid rows: with 8 ranks, ranks 5..7 would have no batch, skip Lightning's evaluation loop
    # and leave the others waiting in the epoch-end sync; every rank refuses alike instead
    for rank in (0, 7):
        with pytest.raises(ValueError, match=r"valid split has 5 rows for 8 ranks"):
            _datamodule(prepared, rank, 8).val_dataloader()
    assert _datamodule(prepared, 4, 5).val_dataloader().kwargs["world_size"] == 5  # one row each


def test_a_final_split_smaller_than_the_world_is_refused_before_the_fit(tmp_path):
    # 2 test rows for 4 ranks: once refused only when the final evaluation began, after the fit
    root = write_prepared(tmp_path / "prepared", n_train=12, n_valid=5)
    write_table(root / "test.csv", read_table(root / "valid.csv").iloc[:2])
    overrides = ddp_overrides(
        root, "trainer.devices=4", "trainer.strategy=ddp", "logger=none", batch_size=1
    )
    with pytest.raises(ValueError, match=r"the test split has 2 rows for 4 ranks"):
        build(compose_train(overrides, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_loaders_are_closed_when_replaced_and_at_teardown(prepared):
    datamodule = _datamodule(prepared, 0, 1)
    train, val, test = (
        datamodule.train_dataloader(),
        datamodule.val_dataloader(),
        datamodule.test_dataloader(),
    )
    reloaded = datamodule.val_dataloader()  # trainer.reload_dataloaders_every_n_epochs
    assert val.closed and not (train.closed or test.closed or reloaded.closed)
    datamodule.teardown("fit")
    assert train.closed and test.closed and reloaded.closed


def test_sigterm_ends_a_ddp_job_stuck_in_a_collective(tmp_path):
    """Both ranks wait inside torch.distributed for each other (support.ddp.Deadlock), where no
    Python signal handler runs: SIGTERM to train.py alone ends it, with a failing status, and
    every process of the job within seconds."""
    root = write_prepared(tmp_path / "prepared", n_train=N_TRAIN, n_valid=N_VALID)
    with (tmp_path / "output.txt").open("w") as output:
        job = start_train(
            *ddp_overrides(
                root,
                "trainer.devices=2",
                "trainer.strategy=ddp",
                "logger=none",
                "+callbacks.deadlock._target_=support.ddp.Deadlock",
                f"+callbacks.deadlock.dirpath={tmp_path}",
                f"hydra.run.dir={tmp_path / 'run'}",
            ),
            output=output,
        )
    try:
        deadline = time.monotonic() + 240
        while len(list(tmp_path.glob("rank*.pid"))) < 2:
            assert job.poll() is None, (tmp_path / "output.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the ranks never reached their first batch"
            time.sleep(0.1)
        time.sleep(1.0)  # both inside their receive
        job.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        returncode = job.wait(timeout=GRACE_S + 30)
        ended = time.monotonic() - sent
        while (left := session_processes(job.pid)) and time.monotonic() < sent + GRACE_S + 35:
            time.sleep(0.1)
    finally:
        for pid in session_processes(job.pid):
            os.kill(pid, signal.SIGKILL)
        job.wait()
    assert returncode != 0 and ended < GRACE_S + 10, (returncode, ended)
    assert left == {}, f"left behind: {left}"


def test_sigterm_in_a_job_raises_terminated_and_the_job_restores_the_handlers():
    """In-process: SIGTERM inside a job is raised as Ctrl-C is (Lightning's interrupt handling
    then runs); after the job, SIGTERM's handler and the signal wake-up fd are the caller's."""
    handler, wakeup = signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    with pytest.raises(Terminated), isolated_job():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACE_S)  # the handler raises at once, well before the watcher's deadline
    assert signal.getsignal(signal.SIGTERM) is handler
    assert signal.set_wakeup_fd(wakeup) == wakeup


def test_a_ddp_rank_that_fails_is_named_in_one_line_with_its_error(tmp_path):
    """Rank 1 failing ended train.py with rank 0's gloo trace of 80 lines ("Connection closed by
    peer") and rank 1's own trace among them."""
    root = write_prepared(tmp_path / "prepared", n_train=N_TRAIN, n_valid=N_VALID)
    job = start_train(
        *ddp_overrides(
            root,
            "trainer.devices=2",
            "trainer.strategy=ddp",
            "logger=none",
            "+callbacks.fail._target_=support.ddp.FailOnRank",
            "+callbacks.fail.rank=1",
            f"hydra.run.dir={tmp_path / 'run'}",
        )
    )
    stderr = finish(job, returncode=1)[1]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "train.py: RankFailed: DDP rank 1: RuntimeError: rank 1's own error"
    )
