"""The step trace: its summary's arithmetic on a known trace, and real fits traced on this CPU (one
that ends inside the traced epochs included)."""

from __future__ import annotations

import json

import lightning as L
import pytest
from lightning.pytorch.callbacks import RichProgressBar
from support.ddp import run_train
from support.train import small_overrides, train

from benchmarks.trace import PHASE, StepTrace, summarize


def _span(name: str, cat: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}


def test_idle_time_is_split_by_phase_and_by_the_hooks_running_then():
    """Two steps of 10 ms; the GPU works 0-8 and 12-18 ms: idle 8-12 (from step 1 into step 2,
    while a hook ran 9.5-11.5) and 18-20 (no hook); one device sync on another thread."""
    events = [
        _span(PHASE + "train_step", "user_annotation", 0, 10_000),
        _span(PHASE + "train_step", "user_annotation", 10_000, 10_000),
        _span("Bar.on_train_batch_start", "user_annotation", 9_500, 2_000),
        _span("gemm", "kernel", 0, 8_000, tid=7),
        _span("gemm", "kernel", 12_000, 6_000, tid=7),
        _span("cudaDeviceSynchronize", "cuda_runtime", 5_000, 100, tid=2),
    ]
    text = summarize(events)
    assert "window 20.0 ms, GPU busy 14.0 ms" in text
    row = next(line for line in text.splitlines() if line.startswith("train_step"))
    assert row.split() == ["train_step", "2", "20.0", "14.0", "6.0"]
    assert "GPU idle stretches over 0.3 ms: 2, 6.0 ms" in text
    assert "4.0 ms  train_step | Bar.on_train_batch_start" in text
    assert "2.0 ms  train_step | -" in text
    assert "4.00 at +8.0: Bar.on_train_batch_start 2.00" in text
    assert "cudaDeviceSynchronize (other threads)" in text


def test_hooks_are_named_while_tracing_and_given_back_after():
    bar, trace = RichProgressBar(), StepTrace(epochs=[0, 0])
    trainer = L.Trainer(callbacks=[bar, trace], logger=False, enable_checkpointing=False)
    trace._wrap_hooks(trainer)
    assert "on_train_batch_end" in vars(bar) and "save_checkpoint" in vars(trainer)
    assert "on_train_epoch_start" not in vars(trace)  # its own hooks stay as they are
    trace._unwrap_hooks()
    assert "on_train_batch_end" not in vars(bar) and "save_checkpoint" not in vars(trainer)


@pytest.mark.slow
def test_a_traced_fit_names_its_phases_hooks_and_stacks(prepared, tmp_path):
    run_dir = tmp_path / "run"
    train(
        prepared,
        run_dir,
        "trainer.max_epochs=3",
        "+callbacks.trace._target_=benchmarks.trace.StepTrace",
        "+callbacks.trace.epochs=[1,2]",
        "+callbacks.trace.stacks=['aten::addmm','Optimizer.step#AdamW.step']",
    )
    text = (run_dir / "trace.txt").read_text()
    rows = {line.split()[0]: line.split() for line in text.splitlines()[3:8] if line.strip()}
    assert rows["train_step"][1] == "6"  # 3 batches of the fixture's 12 photos, epochs 1 and 2
    assert rows["validation"][1] == "2"
    assert len(rows["train_step"]) == 3  # wall time only: no GPU here
    assert "Optimizer.step#AdamW.step [main thread]" in text  # stacks of the named events
    events = json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "ModelCheckpoint.on_train_epoch_end" for e in events) or any(
        e.get("name") == "Trainer.save_checkpoint" for e in events
    )


@pytest.mark.slow  # trains in a subprocess: a profiler left running crashed it at exit
def test_a_fit_ending_inside_the_traced_epochs_writes_them_and_says_so(prepared, tmp_path):
    run_dir = tmp_path / "run"
    overrides = small_overrides(
        prepared,
        "trainer.max_epochs=3",
        "logger=none",
        "test=false",
        "callbacks.time_to_target.target=0.0",  # met at epoch 0: the fit stops there
        "callbacks.time_to_target.stop=true",
        "+callbacks.trace._target_=benchmarks.trace.StepTrace",
        "+callbacks.trace.epochs=[0,1]",
    )
    run_train(*overrides, f"hydra.run.dir={run_dir}")  # asserts a clean exit
    cut = "window cut short: the fit ended after epoch 0, so only epochs 0..0 of 0..1 were traced"
    text = (run_dir / "trace.txt").read_text()
    assert text.startswith(cut + "\n")
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    assert rows["train_step"][1] == "3"  # epoch 0's 3 batches
    assert json.loads((run_dir / "trace.json").read_text())["traceEvents"]
    assert cut in (run_dir / "train.log").read_text()
