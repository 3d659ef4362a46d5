"""How a fit's training epochs spend the device's time, from timestamps at the loop's hooks.

    python train.py ... '+callbacks.timeline._target_=benchmarks.timeline.GpuTimeline'

On a GPU the timestamps are CUDA events on the training stream, read once when the fit ends: the
time from one step's end event to the next step's start is time the GPU had none of the loop's
work queued, and nothing waits for the device meanwhile. On the CPU they are host clocks.

Rank 0 writes `RUN/timeline.csv` (a row per training epoch: `COLUMNS`, in ms: the epoch's
training time, its steps' sum, median and longest, the loop's own time between them, the host's
wait between steps, images/s), `RUN/timeline.txt` (the same with the `settled` medians) and
`RUN/timeline_steps.csv` (a row per step: its time, the device's gap before it, the host's wait,
and whether its values were logged).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L
import pandas as pd
import torch
from lightning.pytorch.trainer.states import TrainerFn

from nailseg.model.module import logs_step
from nailseg.training.callbacks import settled
from nailseg.training.run_folder import write_file

COLUMNS = [
    "epoch", "steps", "images", "train_ms", "steps_ms", "step_median_ms", "step_max_ms",
    "between_ms", "ramp_ms", "validation_ms", "host_wait_ms", "images_per_s",
]  # fmt: skip
STEP_COLUMNS = ["epoch", "global_step", "step_ms", "gap_ms", "host_wait_ms", "logged"]


@dataclass
class EpochMarks:
    """One training epoch's timestamps in ms from its start, and the host's records of it (its
    wait before each step: None after the epoch's start or a validation)."""

    steps: list[tuple[float, float]] = field(default_factory=list)
    validations: list[tuple[float, float]] = field(default_factory=list)
    end: float = 0.0
    host_waits: list[float | None] = field(default_factory=list)
    images: int = 0
    global_steps: list[int] = field(default_factory=list)
    logged: list[bool] = field(default_factory=list)


def epoch_row(epoch: int, marks: EpochMarks) -> dict[str, float]:
    """The epoch's row of `timeline.csv` (see the module docstring)."""
    spans = [end - start for start, end in marks.steps]
    train = marks.end - sum(end - start for start, end in marks.validations)
    return {
        "epoch": epoch,
        "steps": len(spans),
        "images": marks.images,
        "train_ms": train,
        "steps_ms": sum(spans),
        "step_median_ms": statistics.median(spans) if spans else 0.0,
        "step_max_ms": max(spans, default=0.0),
        "between_ms": train - sum(spans),
        "ramp_ms": marks.steps[0][0] if marks.steps else 0.0,
        "validation_ms": marks.end - train,
        "host_wait_ms": sum(wait for wait in marks.host_waits if wait is not None),
        "images_per_s": 1000.0 * marks.images / train if train > 0 else 0.0,
    }


def step_rows(epoch: int, marks: EpochMarks) -> list[dict[str, Any]]:
    """The epoch's rows of `timeline_steps.csv` (see the module docstring)."""
    ends = [0.0] + [end for _, end in marks.steps[:-1]]
    return [
        {
            "epoch": epoch,
            "global_step": step,
            "step_ms": end - start,
            "gap_ms": start - before,
            "host_wait_ms": wait,
            "logged": logged,
        }
        for (start, end), before, wait, step, logged in zip(
            marks.steps, ends, marks.host_waits, marks.global_steps, marks.logged, strict=True
        )
    ]


def table(rows: pd.DataFrame, clock: str) -> str:
    """The rows as text, then the medians over the epochs after the warm-up ones."""
    counted = settled(rows)
    median = counted.median(numeric_only=True).to_frame().T.assign(epoch="median")
    shown = pd.concat([rows.astype({"epoch": object}), median], ignore_index=True)
    first, last = counted.epoch.min(), counted.epoch.max()
    title = f"training epochs, ms ({clock}; median: epochs {first}-{last})"
    return f"{title}\n{shown.to_string(index=False, float_format=lambda v: f'{v:.1f}')}\n"


class GpuTimeline(L.Callback):
    """Timestamps at the training loop's hooks, summarised per epoch at the end of the fit
    (see the module docstring)."""

    def __init__(self) -> None:
        self._epochs: list[tuple[int, list[tuple[str, Any]], EpochMarks]] = []
        self._marks: list[tuple[str, Any]] = []
        self._steps = EpochMarks()  # the epoch's host-side records; `_read` adds the device's
        self._host_end: float | None = None
        self._device = torch.device("cpu")

    def _mark(self, name: str) -> None:
        if self._device.type == "cuda":
            stamp: Any = torch.cuda.Event(enable_timing=True)
            stamp.record(torch.cuda.current_stream(self._device))
        else:
            stamp = time.perf_counter()
        self._marks.append((name, stamp))

    def _in_training_epoch(self, trainer: L.Trainer) -> bool:
        return bool(self._marks) and trainer.state.fn == TrainerFn.FITTING

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._device = pl_module.device

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._marks, self._steps, self._host_end = [], EpochMarks(), None
        self._mark("epoch")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        host_end, step = self._host_end, trainer.global_step
        self._steps.host_waits.append(
            None if host_end is None else 1000.0 * (time.perf_counter() - host_end)
        )
        self._steps.global_steps.append(step)
        self._steps.logged.append(logs_step(trainer, step))
        self._mark("step")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        self._mark("step_end")
        self._steps.images += len(batch["image"])
        self._host_end = time.perf_counter()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._in_training_epoch(trainer) and not trainer.sanity_checking:
            self._mark("validation")
            self._host_end = None  # the wait after validation is not a wait between steps

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._in_training_epoch(trainer) and not trainer.sanity_checking:
            self._mark("validation_end")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark("end")
        self._epochs.append((trainer.current_epoch, self._marks, self._steps))
        self._marks = []

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not self._epochs:
            return
        epochs = [(epoch, self._read(marks, steps)) for epoch, marks, steps in self._epochs]
        rows = pd.DataFrame([epoch_row(epoch, marks) for epoch, marks in epochs], columns=COLUMNS)
        steps = pd.DataFrame(
            [row for epoch, marks in epochs for row in step_rows(epoch, marks)],
            columns=STEP_COLUMNS,
        )
        clock = "CUDA events" if self._device.type == "cuda" else "host clock"
        texts = {
            "timeline.csv": rows.to_csv(index=False, float_format="%.3f"),
            "timeline_steps.csv": steps.to_csv(index=False, float_format="%.3f"),
            "timeline.txt": table(rows, clock),
        }
        for name, text in texts.items():
            write_file(Path(trainer.default_root_dir) / name, text.encode())

    def _read(self, marks: list[tuple[str, Any]], steps: EpochMarks) -> EpochMarks:
        """One epoch's timestamps as ms from its start (on a GPU, this waits for the events), with
        the host-side records of `steps`."""
        (_, start), *rest = marks
        if self._device.type == "cuda":
            rest[-1][1].synchronize()
            times = [(name, start.elapsed_time(stamp)) for name, stamp in rest]
        else:
            times = [(name, 1000.0 * (stamp - start)) for name, stamp in rest]
        epoch = replace(steps, steps=[], validations=[], end=times[-1][1])
        opened: dict[str, float] = {}
        for name, ms in times[:-1]:
            if name in ("step", "validation"):
                opened[name] = ms
            else:  # step_end or validation_end closes what its name opened
                kind = name.removesuffix("_end")
                (epoch.steps if kind == "step" else epoch.validations).append(
                    (opened.pop(kind), ms)
                )
        return epoch
