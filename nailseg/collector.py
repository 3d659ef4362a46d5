"""Python's cyclic garbage collector kept off the objects that exist now (`gc.freeze`): a full
collection pauses a fit, and a forked child (DataLoader workers, a process pool) must never collect
and finalize what it inherited (a DALI pipeline's finalizer hangs or crashes in a worker)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects that exist on entry are left alone by the collector until exit; nested, the
    outermost exit unfreezes (`gc.unfreeze` unfreezes everything)."""
    outermost = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if outermost:
            gc.unfreeze()
