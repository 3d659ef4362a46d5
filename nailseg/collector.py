"""Python's cyclic garbage collector kept off the objects that exist now (`gc.freeze`), for two
reasons nailseg has:

- A fit: a full collection walks every tracked object, ~620,000 once torch, Lightning, Hydra and
  the run are built: 350-430 ms on the 2-core CPU, and on the H200 one such pause of 290-440 ms
  fell inside a training epoch of most 10-epoch fits (docs/BENCHMARKS.md, eighth session).
- A fork (DataLoader workers, prepare's process pool): a forked child collects the garbage it
  inherited, and runs its finalizers there. A DALI pipeline left in a reference cycle by an
  earlier loader was destroyed in a torch DataLoader worker, whose copy of DALI's threads does
  not exist: the worker hung in DALI's executor destructor, or died of a segmentation fault
  (tests/data: 2 of 4 fresh-clone CI runs). Frozen before the fork, what the child inherits is
  never collected there; the parent unfreezes at once.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects that exist on entry are left alone by the collector until exit; what is made
    meanwhile is collected as usual. Nested (a worker forked during a fit), the outermost exit
    unfreezes: `gc.unfreeze` unfreezes everything."""
    outermost = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        yield
    finally:
        if outermost:
            gc.unfreeze()
