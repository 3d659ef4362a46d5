"""Where a fit's time goes: a PyTorch-profiler trace of chosen training epochs with the host's
phases named, summarised as when the GPU sat idle and what the host was doing then.

    python train.py ... '+callbacks.trace._target_=benchmarks.trace.StepTrace'
        [+callbacks.trace.epochs=[4,5]] [+callbacks.trace.stacks=[cudaDeviceSynchronize]]

Writes `RUN/trace.json` (Chrome trace format) and `RUN/trace.txt`: each host phase's wall and GPU
time; the GPU's idle stretches by phase and by the hooks and saves overlapping them; the runtime
calls that wait for the device, by thread; with `stacks`, the Python stacks of those calls.
Profiling slows the host, so it shows where idle time falls, not how much a plain run loses. A
fit that ends inside the window writes what it traced, saying so.
"""

from __future__ import annotations

import collections
import json
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.autograd.profiler import record_function

from nailseg.training.run_folder import write_file

log = logging.getLogger(__name__)
PHASE = "phase:"  # the host-phase annotations' prefix
GPU_WORK = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_EVENTS = frozenset({"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"})
WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")
MIN_GAP_US = 300  # idle stretches shorter than this are launch latency, not lost time
HOOKS = (
    "on_train_epoch_start", "on_train_batch_start", "on_train_batch_end", "on_train_epoch_end",
    "on_validation_start", "on_validation_batch_end", "on_validation_epoch_end",
    "on_validation_end", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad",
)  # fmt: skip


class StepTrace(L.Callback):
    """Profiles training epochs `epochs[0]`..`epochs[1]` (0-based, validation included) and
    writes the trace and its summary into the run folder (see the module docstring)."""

    def __init__(self, epochs: Sequence[int] = (4, 5), stacks: Sequence[str] = ()) -> None:
        if len(epochs) != 2 or not 0 <= epochs[0] <= epochs[1]:
            raise ValueError(
                f"callbacks.trace.epochs={list(epochs)}: give [first, last], first <= last"
            )
        self.first, self.last = int(epochs[0]), int(epochs[1])
        self.stacks = [str(name) for name in stacks]
        self._profiler: torch.profiler.profile | None = None
        self._phase: record_function | None = None
        self._wrapped: list[tuple[Any, str]] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.first and self._profiler is None:
            self._wrap_hooks(trainer)
            _sync()
            self._profiler = torch.profiler.profile(
                activities=_activities(), with_stack=bool(self.stacks)
            )
            self._profiler.__enter__()
        self._enter("epoch_start")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._enter("train_step")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._enter("after_step")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._enter("validation")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._enter("after_validation")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._enter(None)  # the checkpoint saves that follow fall between phases
        if trainer.current_epoch == self.last and self._profiler is not None:
            self._finish(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A fit that ended inside the window: what was traced, said to be cut short (a profiler
        left running would crash the process at exit)."""
        if self._profiler is None:
            return
        ended = trainer.current_epoch - 1  # the epochs completed, counted from 0
        cut = (
            f"window cut short: the fit ended after epoch {ended}, so only epochs "
            f"{self.first}..{ended} of {self.first}..{self.last} were traced"
        )
        log.warning("StepTrace: %s", cut)
        self._finish(trainer, cut + "\n\n")

    def on_exception(self, trainer: L.Trainer, *args: Any) -> None:
        if self._profiler is not None:
            self._stop()

    def _finish(self, trainer: L.Trainer, note: str = "") -> None:
        """Stop tracing once the device's queued work is done (so it is in the trace), and write
        the trace and its summary, `note` first."""
        _sync()
        self._write(self._stop(), Path(trainer.default_root_dir), note)

    def _stop(self) -> torch.profiler.profile:
        """End the trace: the open phase closed, the profiler stopped, the hooks given back."""
        assert self._profiler is not None
        profiler, self._profiler = self._profiler, None
        self._enter(None)
        profiler.__exit__(None, None, None)
        self._unwrap_hooks()
        return profiler

    def _enter(self, phase: str | None) -> None:
        """Close the open phase and, while profiling, open `phase` (None: none)."""
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None
        if phase is not None and self._profiler is not None:
            self._phase = record_function(PHASE + phase)
            self._phase.__enter__()

    def _wrap_hooks(self, trainer: L.Trainer) -> None:
        """Name every other callback's hooks and the checkpoint saves in the trace."""
        for callback in trainer.callbacks:
            if callback is self:
                continue
            for hook in HOOKS:
                if getattr(type(callback), hook) is not getattr(L.Callback, hook):
                    self._wrap(callback, hook, f"{type(callback).__name__}.{hook}")
        self._wrap(trainer, "save_checkpoint", "Trainer.save_checkpoint")

    def _wrap(self, owner: Any, name: str, label: str) -> None:
        method = getattr(owner, name)

        def named(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return method(*args, **kwargs)

        setattr(owner, name, named)  # an instance attribute over the class's method
        self._wrapped.append((owner, name))

    def _unwrap_hooks(self) -> None:
        for owner, name in self._wrapped:
            delattr(owner, name)
        self._wrapped.clear()

    def _write(self, profiler: torch.profiler.profile, run_dir: Path, note: str = "") -> None:
        with tempfile.TemporaryDirectory() as scratch:
            exported = Path(scratch) / "trace.json"
            profiler.export_chrome_trace(str(exported))
            data = exported.read_bytes()  # read once: a trace is large
        events = json.loads(data)["traceEvents"]
        write_file(run_dir / "trace.json", data)
        write_file(run_dir / "trace.txt", (note + summarize(events, self.stacks)).encode())


def _activities() -> list[torch.profiler.ProfilerActivity]:
    cuda = [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    return [torch.profiler.ProfilerActivity.CPU, *cuda]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def summarize(events: list[dict[str, Any]], stacks: Sequence[str] = ()) -> str:
    """trace.txt from a Chrome trace's events (times in µs; see the module docstring)."""
    spans = [e for e in events if e.get("ph") == "X"]
    phases = [e for e in spans if e.get("cat") == "user_annotation" and e["name"].startswith(PHASE)]
    if not phases:
        return "no traced phases (did the fit reach the traced epochs?)\n"
    busy = _union((e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in GPU_WORK)
    start = min(e["ts"] for e in phases)
    end = max(e["ts"] + e["dur"] for e in phases)
    labels = [
        e for e in spans if e.get("cat") == "user_annotation" and not e["name"].startswith(PHASE)
    ]
    main_thread = phases[0]["tid"]
    gpu = f"GPU busy {_overlap(start, end, busy) / 1e3:.1f} ms" if busy else "no GPU work traced"
    lines = [
        f"window {(end - start) / 1e3:.1f} ms, {gpu}",
        "",
        f"{'phase':22s} {'count':>6s} {'wall ms':>10s}"
        + (f" {'GPU busy ms':>12s} {'GPU idle ms':>12s}" if busy else ""),
    ]
    by_phase: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in phases:
        row = by_phase[e["name"].removeprefix(PHASE)]
        row[0] += 1
        row[1] += e["dur"]
        row[2] += _overlap(e["ts"], e["ts"] + e["dur"], busy)
    for name, (count, wall, on_gpu) in sorted(by_phase.items(), key=lambda kv: -kv[1][1]):
        lines.append(
            f"{name:22s} {count:6d} {wall / 1e3:10.1f}"
            + (f" {on_gpu / 1e3:12.1f} {(wall - on_gpu) / 1e3:12.1f}" if busy else "")
        )
    if busy:
        lines += _gaps(
            start, end, busy, phases, labels, [e for e in spans if e.get("cat") in HOST_EVENTS]
        )
    lines += _waits(spans, main_thread)
    if stacks:
        lines += _stacks(spans, stacks, main_thread)
    return "\n".join(lines) + "\n"


def _gaps(
    start: float,
    end: float,
    busy: list[tuple[float, float]],
    phases: list[dict[str, Any]],
    labels: list[dict[str, Any]],
    host: list[dict[str, Any]],
) -> list[str]:
    """The GPU's idle stretches in [start, end): summed by where they fall, the longest listed."""
    gaps, last = [], start
    for begin, finish in busy:
        if begin - last > MIN_GAP_US and begin > start:
            gaps.append((last, min(begin, end)))
        last = max(last, finish)
    if end - last > MIN_GAP_US:
        gaps.append((last, end))
    gaps = [(a, b) for a, b in gaps if b > a]
    total = sum(b - a for a, b in gaps) / 1e3
    lines = [
        "",
        f"GPU idle stretches over {MIN_GAP_US / 1e3:g} ms: {len(gaps)}, {total:.1f} ms; "
        "by phase | hooks and saves overlapping them:",
    ]
    where: collections.Counter[str] = collections.Counter()
    for a, b in gaps:
        phase = next(
            (p["name"].removeprefix(PHASE) for p in phases if p["ts"] <= a < p["ts"] + p["dur"]),
            "between phases",
        )
        names = sorted({e["name"] for e in labels if e["ts"] < b and e["ts"] + e["dur"] > a})
        where[f"{phase} | {', '.join(names) or '-'}"] += b - a
    lines += [f"{us / 1e3:9.1f} ms  {key}" for key, us in where.most_common(15)]
    lines += ["", "longest idle stretches, with the longest host events inside them (ms):"]
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:10]:
        inside = sorted(
            (
                e
                for e in host
                if e["ts"] < b and e["ts"] + e["dur"] > a and not e["name"].startswith(PHASE)
            ),
            key=lambda e: -min(e["ts"] + e["dur"], b) + max(e["ts"], a),
        )[:5]
        described = "; ".join(f"{e['name'][:50]} {e['dur'] / 1e3:.2f}" for e in inside)
        lines.append(f"{(b - a) / 1e3:8.2f} at +{(a - start) / 1e3:.1f}: {described or '-'}")
    return lines


def _waits(spans: list[dict[str, Any]], main_thread: Any) -> list[str]:
    """The runtime calls that can make the host wait for the device: count and time, by thread."""
    table: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in spans:
        if e.get("cat") == "cuda_runtime" and e["name"] in WAITS:
            row = table[(e["name"], "main thread" if e["tid"] == main_thread else "other threads")]
            row[0] += 1
            row[1] += e["dur"]
    lines = ["", "runtime calls that wait for the device (calls, ms):"]
    lines += [
        f"{count:7d} {us / 1e3:9.2f}  {name} ({thread})"
        for (name, thread), (count, us) in sorted(table.items())
    ]
    return lines if table else [*lines, "      none"]


def _stacks(spans: list[dict[str, Any]], names: Sequence[str], main_thread: Any) -> list[str]:
    """Each event named in `names` with the Python frames around it on its thread, grouped."""
    frames: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in spans:
        if e.get("cat") == "python_function":
            frames[e["tid"]].append(e)
    grouped: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for e in spans:
        if e["name"] not in names or e.get("cat") == "python_function":
            continue
        around = sorted(
            (f for f in frames[e["tid"]] if f["ts"] <= e["ts"] <= f["ts"] + f["dur"]),
            key=lambda f: f["ts"],
        )
        stack = " <- ".join(f["name"][:70] for f in reversed(around[-8:])) or "(no Python frames)"
        thread = "main thread" if e["tid"] == main_thread else f"thread {e['tid']}"
        grouped[(e["name"], thread, stack)] += 1
    lines = ["", "stacks:"]
    lines += [
        f"{count:6d} {name} [{thread}]: {stack}"
        for (name, thread, stack), count in grouped.most_common(20)
    ]
    return lines


def _union(intervals: Any) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _overlap(a: float, b: float, merged: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged if y > a and x < b)
