"""GpuTimeline: the per-epoch arithmetic on known timestamps, and a real fit through train.py's path."""

from __future__ import annotations

import pandas as pd
import pytest
from support.train import train

from benchmarks.timeline import (
    COLUMNS,
    STEP_COLUMNS,
    EpochMarks,
    GpuTimeline,
    epoch_row,
    step_rows,
    table,
)


def test_an_epoch_with_a_validation_between_its_steps_is_split_into_its_parts():
    """Host clocks in seconds (the CPU's stamps): ramp 2 ms, steps of 10 and 14 ms, a validation
    of 30 ms between them, 1 ms after the last step."""
    stamps = [("epoch", 1.000), ("step", 1.002), ("step_end", 1.012), ("validation", 1.013),
              ("validation_end", 1.043), ("step", 1.045), ("step_end", 1.059), ("end", 1.060)]  # fmt: skip
    host = EpochMarks(images=8, host_waits=[None, 0.5], global_steps=[4, 5], logged=[False, True])
    marks = GpuTimeline()._read(stamps, host)
    assert [pytest.approx(span) for span in marks.steps] == [(2, 12), (45, 59)]
    assert [pytest.approx(span) for span in marks.validations] == [(13, 43)]
    row = epoch_row(3, marks)
    assert row["train_ms"] == pytest.approx(30)  # 60 ms, less the validation's 30
    assert row["steps_ms"] == pytest.approx(24) and row["step_max_ms"] == pytest.approx(14)
    assert row["between_ms"] == pytest.approx(6) and row["ramp_ms"] == pytest.approx(2)
    assert row["validation_ms"] == pytest.approx(30) and row["host_wait_ms"] == 0.5
    assert row["images_per_s"] == pytest.approx(8 / 0.030)
    steps = pd.DataFrame(step_rows(3, marks))
    assert steps.global_step.tolist() == [4, 5] and steps.logged.tolist() == [False, True]
    assert steps.step_ms.tolist() == pytest.approx([10, 14])
    assert steps.gap_ms.tolist() == pytest.approx([2, 33])  # the ramp; then across the validation
    assert steps.host_wait_ms.isna().tolist() == [True, False]


@pytest.mark.slow
def test_a_fit_writes_one_row_per_epoch(prepared, tmp_path):
    run_dir = tmp_path / "run"
    train(
        prepared,
        run_dir,
        "trainer.max_epochs=3",
        "+callbacks.timeline._target_=benchmarks.timeline.GpuTimeline",
    )
    rows = pd.read_csv(run_dir / "timeline.csv")
    assert list(rows.columns) == COLUMNS and rows.epoch.tolist() == [0, 1, 2]
    assert (rows.steps == 3).all() and (rows.images == 12).all()  # the fixture's 12 photos
    assert (rows.validation_ms > 0).all() and (rows.between_ms >= 0).all()
    assert (rows.ramp_ms <= rows.between_ms).all()
    assert (rows.step_median_ms <= rows.step_max_ms).all()
    steps = pd.read_csv(run_dir / "timeline_steps.csv")
    assert list(steps.columns) == STEP_COLUMNS and steps.global_step.tolist() == list(range(9))
    assert steps.groupby("epoch").step_ms.sum().to_numpy() == pytest.approx(rows.steps_ms, abs=0.01)
    assert steps.host_wait_ms.isna().tolist() == [True, False, False] * 3  # each epoch's first
    text = (run_dir / "timeline.txt").read_text()
    assert "host clock; median: epochs 2-2" in text and text.splitlines()[-1].split()[0] == "median"


def test_a_resumed_fit_leaves_its_own_first_two_epochs_out_of_the_medians():
    rows = pd.DataFrame(
        [epoch_row(e, EpochMarks(steps=[(1, 1 + e)], end=10 + e)) for e in (5, 6, 7)]
    )
    text = table(rows, "host clock")
    assert "median: epochs 7-7" in text
    assert text.splitlines()[-1].split()[:2] == ["median", "1.0"]  # epoch 7's one step


@pytest.mark.slow
@pytest.mark.parametrize(("every", "expected"), [(2, [1, 3, 5, 7]), (0, [])])
def test_the_steps_marked_logged_are_those_whose_loss_the_loggers_got(
    every, expected, prepared, tmp_path
):
    # log_every_n_steps=0 (no step logging) once failed the timeline with a division by zero
    run_dir = tmp_path / "run"
    train(prepared, run_dir, "trainer.max_epochs=3", f"trainer.log_every_n_steps={every}", "logger=csv", "test=false", "+callbacks.timeline._target_=benchmarks.timeline.GpuTimeline")  # fmt: skip
    steps = pd.read_csv(run_dir / "timeline_steps.csv")
    metrics = pd.read_csv(run_dir / "csv" / "metrics.csv")
    no_column = "train/loss_step" not in metrics  # no step was logged
    logged = [] if no_column else metrics.dropna(subset=["train/loss_step"]).step.tolist()
    assert logged == expected
    assert steps.global_step[steps.logged].tolist() == expected
