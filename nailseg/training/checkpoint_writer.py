"""The checkpoint writer process: `python -m nailseg.training.checkpoint_writer`, started by
`BackgroundCheckpointIO` (checkpoint_io.py) and fed through its stdin.

Why a process: `torch.save` of a UNet-resnet34 checkpoint pickles ~1,000 tensors and hands each
record's bytes to Python's file object, holding the GIL most of 0.3 s. From a thread of the
training process (two saves an epoch, `last.ckpt` and a new best) that took the GIL from the
thread launching the training steps all epoch long: on the H200, device steps that overlapped a
save ran 3-5 ms (10%) longer (docs/BENCHMARKS.md, eighth session). Here the pickling and writing
run in another interpreter.

Protocol, one pickled request per save on stdin, one pickled reply on stdout:
request `(path, staging, slots, skeleton)`: `staging` is a file (a Path; None when the checkpoint
holds no tensor) holding every tensor's bytes in
memory order (written by the training process, deleted here once read), `slots` where each tensor
lies in it, `skeleton` the checkpoint with each tensor replaced by its `TensorRef`; reply None, or
the error as text. EOF on stdin ends the process after the last request.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from nailseg.atomic import write_atomic


@dataclass(frozen=True)
class TensorRef:
    """Stands for the checkpoint's `index`-th tensor in a request's skeleton."""

    index: int


@dataclass(frozen=True)
class Slot:
    """Where a tensor's bytes lie in the staging file, in its own memory order, and its layout."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def save_atomic(checkpoint: Any, path: str | os.PathLike[str]) -> None:
    """`torch.save` through nailseg.atomic: a temporary sibling, fsync, rename."""
    write_atomic(path, lambda f: torch.save(checkpoint, f))


def rebuild(skeleton: Any, slots: list[Slot], staging: Path | None) -> Any:
    """The checkpoint: each `TensorRef` of `skeleton` replaced by its tensor, read from `staging`
    (None: there are no tensors) into storage of its own, as `torch.save` stores a tensor."""
    if staging is None:
        return skeleton
    total = sum(slot.nbytes for slot in slots)
    data = torch.from_file(str(staging), shared=False, size=total, dtype=torch.uint8)
    tensors = [
        data[s.offset : s.offset + s.nbytes].clone().view(s.dtype).as_strided(s.shape, s.stride)
        for s in slots
    ]
    return apply_to_collection(skeleton, TensorRef, lambda ref: tensors[ref.index])


def serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """Answer requests until stdin closes (see the module docstring)."""
    while True:
        try:
            path, staging, slots, skeleton = pickle.load(requests)
        except EOFError:
            return
        reply = None
        try:
            try:
                checkpoint = rebuild(skeleton, slots, staging)
            finally:
                if staging is not None:
                    staging.unlink(missing_ok=True)
            save_atomic(checkpoint, path)
        except Exception:
            reply = traceback.format_exc()
        pickle.dump(reply, replies)
        replies.flush()


def main() -> None:
    # Ctrl-C reaches the whole process group: the training process then tears down, which
    # waits for the writes queued here; this process ends when its stdin closes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    replies, sys.stdout = sys.stdout.buffer, sys.stderr  # stdout carries replies only
    serve(sys.stdin.buffer, replies)


if __name__ == "__main__":
    # run as the imported module, so the classes requests name (TensorRef, Slot) are this
    # module's, not copies of them in __main__
    from nailseg.training import checkpoint_writer

    checkpoint_writer.main()
