"""Checkpoints written atomically through the run folder (a user's file in the way is neither
replaced nor removed), by a background thread from a host snapshot taken at the save. A moved or
copied run folder resumes with its best: ModelCheckpoint's absolute paths are mapped into the
folder the checkpoint was read from (`relocate`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from nailseg.training.run_folder import remove_file, write_file


class AtomicCheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO whose saves are atomic and durable, and that replaces or removes only
    the run's own files."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        write_file(path, lambda f: torch.save(checkpoint, f))

    def remove_checkpoint(self, path: _PATH) -> None:
        remove_file(path)

    def load_checkpoint(self, path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, *args, **kwargs)
        relocate(checkpoint, Path(path))
        return checkpoint


# the checkpoint files a ModelCheckpoint's state names, besides its `best_k_models`
_PATH_KEYS = ("best_model_path", "kth_best_model_path", "last_model_path")


def relocate(checkpoint: dict[str, Any], path: Path) -> None:
    """Map each ModelCheckpoint state whose `dirpath` is another folder into `path`'s, when every
    file it names is there; a best checkpoint that is not there is forgotten, with its score."""
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
    """`AtomicCheckpointIO`'s saves and removals in one thread, in order (a removal must not
    precede that file's queued write); a failure raises at the next call or at teardown."""

    def __init__(self) -> None:
        super().__init__(AtomicCheckpointIO())
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        snapshot, copied = host_snapshot(checkpoint, self._copy_stream)

        def write() -> None:
            if copied is not None:
                copied()
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
) -> tuple[Any, Callable[[], None] | None]:
    """`checkpoint` with every tensor replaced by a host copy of its value now, and the wait for
    the copies (None: no CUDA tensors), made on a side stream: a blocking copy stalls training."""
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

    def wait() -> None:
        done.synchronize()
        clones.clear()  # copied: their device memory can go back to the allocator

    return copied, wait
