"""Checkpoints written the way every other output is: a temporary file in the checkpoint's own
folder, fsync'd, then renamed (nailseg/atomic.py), by a background thread.

Lightning's own save goes through fsspec's transaction, which writes the temporary file to
`$TMPDIR` and moves it into place: atomic only when `$TMPDIR` shares the checkpoint's filesystem,
and never fsync'd, so a `kill -9` or a power cut during the move left a truncated `last.ckpt`.

Why a thread: a UNet-resnet34 checkpoint with its AdamW state is ~290 MB, and its synchronous save
took 0.39-0.43 s on the H200 machine; `last.ckpt` and a new best are saved every epoch, so on the
real photos (0.6 s of training an epoch) saving was a third of the fit's wall time.

How the state leaves the GPU matters as much: `torch.save` copies each CUDA tensor to pageable
host memory on the training's own stream, one blocking copy per tensor, and from a writer thread
those copies stalled the next epoch's steps (backward 20 -> 28 ms a step on the H200). So the
snapshot is taken here, before returning: each CUDA tensor is cloned on the device in stream order
(later steps cannot change the clone), and the clones are copied into pinned host memory on a
separate stream, which the GPU's copy engines run beside the training kernels; the thread waits
for that copy, then writes host tensors only.

A run folder may be moved or copied: its checkpoints' ModelCheckpoint states still name the folder
they were written in, absolute. Lightning then restores no best score (another `dirpath`) but the
stale best checkpoint path, which the final evaluation would read from the old place. So a
checkpoint read here has those paths mapped into the folder it was read from (`relocate`). A best
checkpoint that is gone is forgotten with its score: a `kill -9` between saving a new best (the
old one removed) and `last.ckpt` left a `last.ckpt` naming the removed one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from nailseg.io.atomic import write_atomic


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose saves are atomic and durable on a local filesystem."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        write_atomic(path, lambda f: torch.save(checkpoint, f))

    def load_checkpoint(self, path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, *args, **kwargs)
        relocate(checkpoint, Path(path))
        return checkpoint


# the checkpoint files a ModelCheckpoint's state names, besides its `best_k_models`
_PATH_KEYS = ("best_model_path", "kth_best_model_path", "last_model_path")


def relocate(checkpoint: dict[str, Any], path: Path) -> None:
    """Map each ModelCheckpoint state of `checkpoint` (read from `path`) whose `dirpath` is another
    folder into `path`'s folder, when every file it names there is there: the run folder was
    moved or copied, and the resumed fit keeps its best score and best checkpoint. Lightning's
    own `dirpath` is the folder's real path, so the mapped one is too. A best checkpoint of this
    folder that is not there is forgotten, with its score (see the module docstring)."""
    here = os.path.realpath(path.parent)
    for state in (checkpoint.get("callbacks") or {}).values():
        before = state.get("dirpath") if isinstance(state, dict) else None
        if not isinstance(before, str):
            continue
        if before != here:
            _move(state, before, here)
        best = state.get("best_model_path")
        if state["dirpath"] == here and isinstance(best, str) and best and not os.path.isfile(best):
            state |= {"best_model_score": None, "best_model_path": "", "best_k_models": {}}
            state["kth_best_model_path"] = ""


def _move(state: dict[str, Any], before: str, here: str) -> None:
    """The paths of `state` in folder `before` as they are in `here`, if every one is there."""

    def moved(file: str) -> str:
        inside = os.path.dirname(file) == before
        return os.path.join(here, os.path.basename(file)) if inside else file

    best_k = state.get("best_k_models") or {}
    named = [state.get(key) for key in _PATH_KEYS] + list(best_k)
    mapped = {file: moved(file) for file in named if isinstance(file, str) and file}
    if not all(os.path.isfile(new) for old, new in mapped.items() if new != old):
        return
    state["dirpath"] = here
    state.update({key: mapped[state[key]] for key in _PATH_KEYS if state.get(key)})
    state["best_k_models"] = {mapped.get(file, file): v for file, v in best_k.items()}


class BackgroundCheckpointIO(AsyncCheckpointIO):
    """Atomic saves (`AtomicCheckpointIO`) in one background thread, in the order they were made,
    of a host snapshot taken at the save (`host_snapshot`).

    Removals go through the same thread: ModelCheckpoint removes the previous best right after
    saving the new one, and a removal run at once could come before that file's own queued write,
    which would then bring it back. The first error of any queued save or removal is raised at
    the next call or when the strategy tears down; teardown (end of a fit, also after an error)
    waits for every queued write, so what follows a fit (the final test, a resume) reads whole
    files.
    """

    def __init__(self) -> None:
        super().__init__(AtomicCheckpointIO())
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        snapshot, copied = host_snapshot(checkpoint, self._copy_stream)

        def write() -> None:
            if copied is not None:
                copied.synchronize()
            self.checkpoint_io.save_checkpoint(snapshot, path, storage_options)

        self._queue(write)

    def remove_checkpoint(self, path: _PATH) -> None:
        self._queue(self.checkpoint_io.remove_checkpoint, path)

    def _copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        return self._copy_streams[device]

    def _queue(self, work: Callable[..., None], *args: Any) -> None:
        self._ensure_setup()

        def run() -> None:
            try:
                work(*args)
            except BaseException as err:  # raised in the training thread, see save_checkpoint
                self._error = err

        self._executor.submit(run)
        if self._error:
            raise self._error


def host_snapshot(
    checkpoint: Any, copy_stream: Callable[[torch.device], torch.cuda.Stream]
) -> tuple[Any, HostCopies | None]:
    """`checkpoint` with every tensor replaced by a host copy of its value now, and what marks
    the end of the device-to-host copies (None: there were no CUDA tensors). CPU tensors are
    cloned at once; CUDA tensors are cloned on their device in stream order, then copied into
    pinned memory on `copy_stream(device)` (see the module docstring)."""
    clones: list[tuple[torch.Tensor, torch.Tensor]] = []

    def snapshot(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if not tensor.is_cuda:
            return tensor.clone()
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        clones.append((tensor.clone(), host))
        return host

    copied = apply_to_collection(checkpoint, torch.Tensor, snapshot)
    if not clones:
        return copied, None
    device = clones[0][0].device
    stream = copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # after the clones
    with torch.cuda.stream(stream):
        for clone, host in clones:
            host.copy_(clone, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return copied, HostCopies(done, clones)


@dataclass
class HostCopies:
    """The end of a snapshot's copies; holds the device clones until then."""

    done: torch.cuda.Event
    clones: list[tuple[torch.Tensor, torch.Tensor]]

    def synchronize(self) -> None:
        self.done.synchronize()
        self.clones.clear()  # copied: their device memory can go back to the allocator
