"""Time to target across sessions (the checkpoint carries it; a rerun of a finished fit keeps
what it measured) and from when a job's clock counts."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from support.train import train

from nailseg.training import callbacks

COMMON = ("logger=none", "test=false", "scheduler=none")  # a constant LR: a fit may be extended
MEASURED = ("fit", "throughput", "time_to_target", "startup")


def _report(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.mark.slow
def test_a_target_reached_before_a_resume_is_reported_as_it_was(prepared, tmp_path):
    run_dir, target = tmp_path / "a", "callbacks.time_to_target.target=0.0"
    train(prepared, run_dir, "trainer.max_epochs=1", target, *COMMON)
    reached, startup = _report(run_dir)["time_to_target"], _report(run_dir)["startup"]
    assert reached["epoch"] == 0
    # the start-up's parts: to the job's `run`, to the fit's start, to the first step's end
    assert startup["imports_s"] + startup["build_s"] == pytest.approx(reached["startup_s"])
    assert startup["imports_s"] > 0 and startup["build_s"] > 0
    assert 0 < startup["first_step_s"] < reached["seconds"] - reached["startup_s"]
    train(prepared, run_dir, "trainer.max_epochs=2", target, "ckpt_path=last", *COMMON)
    extended = _report(run_dir)
    assert extended["epochs"] == 2 and extended["time_to_target"] == reached
    # the same again: its fit has ended, so this session trains nothing and measures nothing
    train(prepared, run_dir, "trainer.max_epochs=2", target, "ckpt_path=last", *COMMON)
    rerun = _report(run_dir)
    assert rerun["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt")
    assert (rerun["global_step"], rerun["epochs"]) == (extended["global_step"], 2)
    assert extended["fit"] and extended["throughput"]
    assert {k: rerun[k] for k in MEASURED} == {k: extended[k] for k in MEASURED}


@pytest.mark.slow
def test_a_target_reached_after_a_resume_counts_the_earlier_session(prepared, tmp_path):
    # a target the first session never met, lowered for the second: met at its first validation
    train(prepared, tmp_path / "run", "trainer.max_epochs=1", "callbacks.time_to_target.target=1.01",
          *COMMON)  # fmt: skip
    assert _report(tmp_path / "run")["time_to_target"] is None
    train(prepared, tmp_path / "run", "trainer.max_epochs=2", "callbacks.time_to_target.target=0.0",
          "ckpt_path=last", *COMMON)  # fmt: skip
    reached = _report(tmp_path / "run")["time_to_target"]
    assert (reached["epoch"], reached["global_step"]) == (1, 6)
    # epoch 0's training is the first session's, and counts in the second's total
    assert 0 < reached["first_epoch_train_s"] < reached["train_s"]
    assert reached["seconds"] >= reached["startup_s"] + reached["train_s"] + reached["val_s"] - 1e-6


@pytest.mark.slow
def test_with_stop_a_resumed_fit_that_had_reached_its_target_trains_no_further(prepared, tmp_path):
    stop = ("callbacks.time_to_target.target=0.0", "callbacks.time_to_target.stop=true")
    train(prepared, tmp_path / "run", "trainer.max_epochs=3", *stop, *COMMON)
    stopped = _report(tmp_path / "run")
    train(prepared, tmp_path / "run", "trainer.max_epochs=3", *stop, "ckpt_path=last", *COMMON)
    rerun = _report(tmp_path / "run")
    assert (rerun["epochs"], rerun["global_step"]) == (stopped["epochs"], stopped["global_step"])
    assert rerun["resumed_from"] is not None
    assert {k: rerun[k] for k in MEASURED} == {k: stopped[k] for k in MEASURED}


@pytest.mark.slow
def test_a_jobs_clock_starts_before_it_prepares_its_data(monkeypatch, tmp_path):
    # a later job of a sweep in one process: its clock starts when the job does, so the built-in
    # data it prepares (and the data, model and loggers it builds) count as its start-up
    monkeypatch.setattr(callbacks, "_job_started", 0.0)
    root = tmp_path / "synthetic" / "prepared"  # the built-in set's own, under paths.data_dir
    called = time.time()
    train(root, tmp_path / "run", f"paths.data_dir={tmp_path}", "dataset.synthetic.n=16",
          "trainer.max_epochs=1", "callbacks.time_to_target.target=0.0", *COMMON)  # fmt: skip
    ended = time.time()
    started = callbacks._job_started  # the job's clock: set when `run` began, after composing
    prepared_at = max(p.stat().st_mtime for p in root.rglob("*") if p.is_file())
    reached = _report(tmp_path / "run")["time_to_target"]
    assert called <= started < prepared_at
    # file times come from the kernel's coarse clock, up to a tick (4 ms) behind time.time()
    assert reached["startup_s"] >= prepared_at - started - 0.01
    assert reached["seconds"] <= ended - started
    # preparing its data is part of the job's build, not of its imports
    startup = _report(tmp_path / "run")["startup"]
    assert startup["build_s"] >= prepared_at - callbacks._run_entered - 0.01
    assert startup["imports_s"] < startup["build_s"]
