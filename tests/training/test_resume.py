"""Resuming a fit (`ckpt_path=...`): which checkpoint and folder, a schedule that cannot be
continued, optimizer settings the resume would not apply, a job's earlier failure; what Ctrl-C
says, and an evaluation's own folder and W&B run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from support.cli import run_command
from support.train import compose_train, small_overrides, train
from support.wandb_records import run_id, run_record

from nailseg.model.checkpoint import CheckpointError
from nailseg.training import resume
from nailseg.training.build import build
from nailseg.training.run_folder import read_failure, record_failure, release


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder`, with its size and modification time."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_init_from_starts_a_new_fit_with_every_weight_of_the_checkpoint(trained_run, tmp_path):
    """What a finished run's hint offers: its whole net, the decoder's weights too (model.
    encoder_weights takes the encoder's only), fine-tuned in a new run folder."""
    prepared = trained_run.parents[2] / "prepared"
    cfg = compose_train(small_overrides(prepared, f"init_from={trained_run}"), tmp_path / "run")
    try:
        net = build(cfg).module.net
    finally:
        release(cfg.run_dir)
    saved = torch.load(trained_run, weights_only=True)["state_dict"]
    assert net.training and net.state_dict().keys() == {k[4:] for k in saved if k[:4] == "net."}
    assert all(torch.equal(v, saved[f"net.{k}"]) for k, v in net.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize(("scheduler", "length_key"), [("cosine", "T_max"), ("onecycle", "total_steps")])  # fmt: skip
def test_a_longer_fit_is_refused_before_anything_is_written(scheduler, length_key, prepared, tmp_path):  # fmt: skip
    # the schedule restored from the checkpoint spans its 1-epoch fit (3 steps); 2 epochs would
    # run it past its end: cosine climbs back up, one-cycle fails at step 4
    runs = tmp_path / "runs"
    common = [f"scheduler={scheduler}", "logger=csv", "test=false"]
    train(prepared, runs / "a", "trainer.max_epochs=1", *common)
    assert torch.load(runs / "a" / "checkpoints" / "last.ckpt")["lr_schedulers"][0][length_key] == 3
    before = _files(runs / "a")
    message = (
        r"a/checkpoints/last.ckpt: its LR schedule spans 3 optimizer steps \(trainer.max_epochs=1"
        r"\), this fit's would span 6 \(trainer.max_epochs=2\).*Resume with the checkpoint's "
        r"length.*or start a new run from its weights: init_from=.*last.ckpt"
    )
    with pytest.raises(CheckpointError, match=message):
        train(prepared, runs / "b", "trainer.max_epochs=2", "ckpt_path=last", *common)
    with pytest.raises(CheckpointError, match=r"spans 3 optimizer steps.* would span 2 .*max_steps=2"):  # fmt: skip
        train(prepared, runs / "b", "trainer.max_steps=2", "ckpt_path=last", *common)
    assert _files(runs / "a") == before and not (runs / "b").exists()


@pytest.mark.slow
def test_a_constant_lr_fit_may_be_extended(prepared, tmp_path):
    runs = tmp_path / "runs"
    common = ["scheduler=none", "logger=none", "test=false"]
    train(prepared, runs / "a", "trainer.max_epochs=1", *common)
    train(prepared, runs / "b", "trainer.max_epochs=2", "ckpt_path=last", *common)
    metrics = json.loads((runs / "a" / "metrics.json").read_text())
    assert (metrics["epochs"], metrics["global_step"]) == (2, 6)


@pytest.mark.slow
def test_a_resume_with_other_optimizer_settings_is_refused_naming_them(prepared, tmp_path):
    """Lightning restores the optimizer's and the schedule's settings from the checkpoint:
    `optimizer.lr=0.05` on a resume trained on at the checkpoint's lr, silently."""
    runs = tmp_path / "runs"
    common = ["scheduler=none", "logger=csv", "test=false"]
    train(prepared, runs / "a", "trainer.max_epochs=1", *common)
    before = _files(runs / "a")
    resumed = [*common, "trainer.max_epochs=2", "ckpt_path=last"]
    with pytest.raises(
        CheckpointError,
        match=r"a/checkpoints/last.ckpt was trained with other optimizer or schedule settings "
        r"\(optimizer.lr: checkpoint 0.001, config 0.05\): a resumed fit restores the "
        r"checkpoint's, so this config's would not take effect",
    ):
        train(prepared, runs / "b", *resumed, "optimizer.lr=0.05")
    with pytest.raises(
        CheckpointError,
        match=r"settings \(optimizer: checkpoint torch.optim.AdamW, config torch.optim.SGD\)",
    ):
        train(prepared, runs / "b", *resumed, "optimizer=sgd")
    with pytest.raises(
        CheckpointError,
        match=r"\(scheduler: checkpoint none, config torch.optim.lr_scheduler.CosineAnnealingLR\)",
    ):
        train(prepared, runs / "b", *resumed, "scheduler=cosine")
    assert _files(runs / "a") == before and not (runs / "b").exists()
    # how AdamW computes (one fused kernel or several) is not what: that resume trains on
    train(prepared, runs / "b", *resumed, "optimizer.fused=null")
    metrics = json.loads((runs / "a" / "metrics.json").read_text())
    assert (metrics["epochs"], metrics["global_step"]) == (2, 6)


def _trained_rows(run_dir: Path) -> dict[int, list[int]]:
    """Each epoch's training rows in the order trained, from the sample ledger (callbacks=audit)."""
    epochs: dict[int, list[int]] = {}
    for path in sorted((run_dir / "ledger").glob("train_*.json")):
        entry = json.loads(path.read_text())
        epochs.setdefault(entry["epoch"], []).extend(entry["rows"])
    return epochs


@pytest.mark.slow
def test_a_resumed_fit_trains_each_epoch_on_the_rows_the_uninterrupted_fit_did(prepared, tmp_path):
    # resumed from the checkpoint of epoch 1's end, the fit once trained epoch 2 on epoch 1's
    # shuffle (and so on, one behind): the loader took the epochs completed for the next epoch
    common = ["scheduler=none", "callbacks=audit", "logger=none", "test=false"]
    train(prepared, tmp_path / "straight", *common, "trainer.max_epochs=3")
    train(prepared, tmp_path / "resumed", *common, "trainer.max_epochs=2")
    train(prepared, tmp_path / "resumed", *common, "trainer.max_epochs=3", "ckpt_path=last")
    straight = _trained_rows(tmp_path / "straight")
    assert sorted(straight) == [0, 1, 2] and straight[1] != straight[2]  # shuffled apart
    assert _trained_rows(tmp_path / "resumed") == straight


@pytest.mark.slow
def test_a_rerun_in_its_own_folder_resumes_itself_and_forgets_its_failure(prepared, tmp_path):
    # `python train.py hydra.run.dir=runs/a ckpt_path=last`, with a newer run beside it, after
    # an attempt that failed (a sweep job's error in its marker, which compare reports)
    runs = tmp_path / "runs"
    common = ["trainer.max_epochs=1", "logger=none", "test=false"]
    train(prepared, runs / "a", *common)
    train(prepared, runs / "other", *common)
    try:
        raise RuntimeError("out of memory")
    except RuntimeError as err:
        record_failure(runs / "a", err)  # as run_job records it
    release(runs / "a")
    assert read_failure(runs / "a") == "RuntimeError: out of memory"
    other = _files(runs / "other")
    train(prepared, runs / "a", "ckpt_path=last", *common)
    metrics = json.loads((runs / "a" / "metrics.json").read_text())
    assert metrics["resumed_from"] == str(runs / "a" / "checkpoints" / "last.ckpt")
    assert read_failure(runs / "a") is None
    assert _files(runs / "other") == other


def test_a_broken_checkpoint_of_its_own_folder_is_refused_not_replaced_by_a_siblings(tmp_path):
    own = tmp_path / "runs" / "a" / "checkpoints" / "last.ckpt"
    sibling = tmp_path / "runs" / "other" / "checkpoints" / "last.ckpt"
    for path in (own, sibling):
        path.parent.mkdir(parents=True)
    own.write_bytes(b"truncated")
    torch.save({"state_dict": {}}, sibling)
    with pytest.raises(
        CheckpointError, match=rf"can be resumed: .*{own} is not a checkpoint"
    ) as err:
        resume.resolve("last", own.parents[1], sweep_job=False)
    assert str(sibling) not in str(err.value)


class CtrlC(L.Callback):
    """Ctrl-C as a user presses it: SIGINT to this process at the start of epoch 1."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.slow
def test_ctrl_c_prints_the_command_that_continues_the_run(prepared, tmp_path, capsys):
    run_dir, ctrl_c = tmp_path / "run", f"+callbacks.ctrl_c._target_={__name__}.CtrlC"
    command = ["train.py", *small_overrides(prepared, "trainer.max_epochs=2", "logger=none")]
    before = signal.getsignal(signal.SIGINT)
    done = run_command([*command, ctrl_c, f"hydra.run.dir={run_dir}"], capsys)
    assert signal.getsignal(signal.SIGINT) is before  # Lightning ignored it; the caller's is back
    assert done.returncode == 1
    (hint,) = [line for line in done.stdout.splitlines() if "interrupted; to continue: " in line]
    python, *given = hint.split("interrupted; to continue: ")[1].split()
    assert python == "python"
    assert given == [*command, ctrl_c, f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"]
    session = f"hydra.run.dir={tmp_path / 'session'}"  # where this session's own log goes
    again = run_command([*(g for g in given if g != ctrl_c), session], capsys)  # less the Ctrl-C
    assert again.returncode == 0 and again.stderr == "", again.stderr[-2000:]
    report = json.loads((run_dir / "metrics.json").read_text())
    assert report["resumed_from"] == given[-1].split("=", 1)[1] and report["epochs"] == 2


@pytest.mark.slow
def test_an_evaluation_has_its_own_folder_and_wandb_run(prepared, tmp_path, capsys):
    train(prepared, tmp_path / "run", "trainer.max_epochs=1", "logger=wandb", "test=false")
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    argv = ["train.py", "train=false", f"ckpt_path={ckpt}", f"dataset.root={prepared}",
            "loader.batch_size=4", "trainer=cpu", f"paths.log_dir={tmp_path / 'outputs'}"]  # fmt: skip
    done = run_command(argv, capsys)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    assert f"evaluating {ckpt}" in done.stdout and "resuming" not in done.stdout
    (eval_dir,) = (tmp_path / "outputs" / "eval").iterdir()
    assert json.loads((eval_dir / "metrics.json").read_text())["final"]["metrics"]
    (trained,) = (tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb")
    (evaluated,) = eval_dir.glob("wandb/offline-run-*/run-*.wandb")
    assert run_record(evaluated).job_type == "eval" and run_record(trained).job_type == "train"
    assert run_id(evaluated) != run_id(trained)


@pytest.mark.slow
def test_ckpt_path_last_on_a_finished_run_says_so_and_changes_nothing(prepared, tmp_path, capsys):
    runs, common = tmp_path / "runs", ["trainer.max_epochs=1", "logger=wandb", "test=false"]
    train(prepared, runs / "a", *common)
    report, last = runs / "a" / "metrics.json", runs / "a" / "checkpoints" / "last.ckpt"
    before = (report.read_bytes(), report.stat().st_mtime_ns, last.stat().st_mtime_ns)
    argv = ["train.py", *small_overrides(prepared, *common), "ckpt_path=last"]
    done = run_command([*argv, f"hydra.run.dir={runs / 'b'}"], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (report.read_bytes(), report.stat().st_mtime_ns, last.stat().st_mtime_ns) == before
    assert len(list((runs / "a").glob("wandb/offline-run-*"))) == 1  # no second W&B session
    (said,) = [line for line in done.stdout.splitlines() if "finished its fit" in line]
    assert said.endswith(
        f"{runs / 'a'} finished its fit (step 3): nothing to resume. To train it further, "
        f"ckpt_path={last} with more trainer.max_epochs and scheduler=none (a resumed schedule "
        f"keeps its length), or fine-tune its whole net in a new run: init_from={last}"
    )
