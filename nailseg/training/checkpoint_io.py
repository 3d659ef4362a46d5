"""Checkpoints written the way every other output is: a temporary file in the checkpoint's own
folder, fsync'd, then renamed (nailseg/atomic.py), by a writer process fed from a background thread.

Lightning's own save goes through fsspec's transaction, which writes the temporary file to
`$TMPDIR` and moves it into place: atomic only when `$TMPDIR` shares the checkpoint's filesystem,
and never fsync'd, so a `kill -9` or a power cut during the move left a truncated `last.ckpt`.

Why in the background: a UNet-resnet34 checkpoint with its AdamW state is ~290 MB, and its
synchronous save took 0.39-0.43 s on the H200 machine; `last.ckpt` and a new best are saved every
epoch, so on the real photos (0.6 s of training an epoch) saving was a third of the fit's wall time.
Why a process and not a thread: see checkpoint_writer.py (the GIL).

How the state leaves the GPU matters as much: `torch.save` copies each CUDA tensor to pageable
host memory on the training's own stream, one blocking copy per tensor, and from a writer thread
those copies stalled the next epoch's steps (backward 20 -> 28 ms a step on the H200). So the
snapshot is taken here, before returning: every tensor's bytes are gathered in stream order into
one buffer per device (later steps cannot change it), and the CUDA one is copied into pinned host
memory on a separate stream, which the GPU's copy engines run beside the training kernels. The
background thread waits for that copy, writes the bytes to a staging file beside the checkpoint
(one write, without the GIL) and hands the writer process the file and the checkpoint's other
contents.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from nailseg.training.checkpoint_writer import Slot, TensorRef

STAGING_SUFFIX = ".snapshot"  # a checkpoint's bytes on their way to the writer process


class BackgroundCheckpointIO(AsyncCheckpointIO):
    """Atomic saves (`save_atomic`) by a writer process, in the order they were made, of a host
    snapshot taken at the save (`host_snapshot`); one background thread hands them over.

    Removals go through the same thread: ModelCheckpoint removes the previous best right after
    saving the new one, and a removal run at once could come before that file's own queued write,
    which would then bring it back. The first error of any queued save or removal is raised at
    the next call or when the strategy tears down; teardown (end of a fit, also after an error)
    waits for every queued write, so what follows a fit (the final test, a resume) reads whole
    files.
    """

    def __init__(self) -> None:
        super().__init__(TorchCheckpointIO())  # loads and removals
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._writer: subprocess.Popen[bytes] | None = None  # started by the first save

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        snapshot = host_snapshot(checkpoint, self._copy_stream)
        self._queue(self._hand_over, snapshot, Path(path))

    def remove_checkpoint(self, path: _PATH) -> None:
        self._queue(self.checkpoint_io.remove_checkpoint, path)

    def teardown(self) -> None:
        """Wait for every queued save, then let the writer process finish and end."""
        try:
            super().teardown()
        finally:
            writer, self._writer = self._writer, None
            if writer is not None:
                with contextlib.suppress(BrokenPipeError):  # it died: _hand_over raised that
                    writer.stdin.close()
                writer.wait()

    def _hand_over(self, snapshot: HostSnapshot, path: Path) -> None:
        """In the background thread: the snapshot's bytes into a staging file, then the save to
        the writer process; returns when the checkpoint is written."""
        staging = None
        if snapshot.parts:
            snapshot.synchronize()
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(f".{path.name}.{os.getpid()}{STAGING_SUFFIX}")
            with open(staging, "wb") as f:
                for part in snapshot.parts:
                    f.write(part.numpy())
            snapshot.parts.clear()
        writer = self._start_writer()
        try:
            pickle.dump((path, staging, snapshot.slots, snapshot.skeleton), writer.stdin)
            writer.stdin.flush()
            error = pickle.load(writer.stdout)
        except (BrokenPipeError, EOFError):
            if staging is not None:
                staging.unlink(missing_ok=True)
            raise RuntimeError(
                f"the checkpoint writer process exited (code {writer.wait()}) before writing {path}"
            ) from None
        if error is not None:
            raise RuntimeError(f"the checkpoint writer process could not write {path}:\n{error}")

    def _start_writer(self) -> subprocess.Popen[bytes]:
        if self._writer is None:
            package_root = str(Path(__file__).resolve().parents[2])
            python_path = os.environ.get("PYTHONPATH")
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [package_root, python_path])),
            }
            self._writer = subprocess.Popen(
                [sys.executable, "-m", "nailseg.training.checkpoint_writer"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
        return self._writer

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


@dataclass
class HostSnapshot:
    """A checkpoint's values at the save: `skeleton` (the checkpoint with each tensor replaced by
    its `TensorRef`), where each tensor's bytes lie (`slots`), the host buffers holding them in
    that order (`parts`), and what marks the end of their copies from the GPU (`copied`, with
    the device buffers it holds until then)."""

    skeleton: Any
    slots: list[Slot]
    parts: list[torch.Tensor]
    copied: torch.cuda.Event | None = None
    on_device: list[torch.Tensor] = field(default_factory=list)

    def synchronize(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        self.on_device.clear()  # copied: their memory can go back to the allocator


def host_snapshot(
    checkpoint: Any, copy_stream: Callable[[torch.device], torch.cuda.Stream]
) -> HostSnapshot:
    """`checkpoint`'s tensors gathered as bytes, at this point of each device's stream, into one
    buffer per device: CPU tensors at once; CUDA tensors on their device, then copied into pinned
    host memory on `copy_stream(device)` (see the module docstring). One device's tensors only,
    besides the CPU's, as a checkpoint of one rank holds."""
    tensors: list[torch.Tensor] = []

    def refer(tensor: torch.Tensor) -> TensorRef:
        tensors.append(_dense(tensor.detach()))
        return TensorRef(len(tensors) - 1)

    skeleton = apply_to_collection(checkpoint, torch.Tensor, refer)
    slots: list[Slot] = [None] * len(tensors)  # type: ignore[list-item]
    snapshot = HostSnapshot(skeleton, slots, parts=[])
    offset = 0
    for on_cuda in (True, False):
        chosen = [i for i, tensor in enumerate(tensors) if tensor.is_cuda == on_cuda]
        if not chosen:
            continue
        for i in chosen:
            tensor = tensors[i]
            nbytes = tensor.numel() * tensor.element_size()
            slots[i] = Slot(offset, nbytes, tensor.dtype, tuple(tensor.shape), tensor.stride())
            offset += nbytes
        gathered = torch.cat([_bytes(tensors[i]) for i in chosen])
        if not on_cuda:
            snapshot.parts.append(gathered)
            continue
        stream = copy_stream(gathered.device)
        stream.wait_stream(torch.cuda.current_stream(gathered.device))  # after the gathering
        host = torch.empty_like(gathered, device="cpu", pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(gathered, non_blocking=True)
            snapshot.copied = torch.cuda.Event()
            snapshot.copied.record(stream)
        snapshot.parts.append(host)
        snapshot.on_device.append(gathered)
    return snapshot


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a contiguous copy where its elements do not fill one block of memory."""
    if tensor.is_contiguous() or tensor.is_contiguous(memory_format=torch.channels_last):
        return tensor
    return tensor.contiguous()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's memory as a flat uint8 view, in memory order."""
    return tensor.as_strided((tensor.numel(),), (1,)).view(torch.uint8)
