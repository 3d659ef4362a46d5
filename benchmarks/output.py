"""The folder a benchmark writes into: its own (an `OwnedFolder` of kind `bench`), or refused.

A benchmark writes only into a folder that is new or empty, or one it made before; a user's
folder, or a file of the user's where an output goes, is refused in one line naming it before
anything is written. Its outputs are written through the folder (atomic, journaled), so a rerun
replaces them and `make clean` removes them, and nothing else.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from nailseg.io.atomic import NotOursError
from nailseg.io.folder import OwnedFolder
from nailseg.io.overlap import overlap

SCRATCH = ".scratch"  # in the benchmark's folder: emptied before and after each use


@contextmanager
def scratch(folder: OwnedFolder) -> Iterator[Path]:
    """An empty folder inside the benchmark's `folder`, removed after the block; its name is
    reserved in the folder's journal, so what a killed run leaves there is `make clean`'s."""
    path = folder.reserve(SCRATCH)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path)


def claim_output(cfg: DictConfig, outputs: list[str], command: str) -> OwnedFolder:
    """`cfg.output_dir` as the benchmark's own folder, every one of `outputs` free in it; exits
    with one line naming what is in the way (an overlap with `cfg.input_dir` where it has one)
    before anything is written."""
    out = Path(cfg.output_dir)
    given = cfg.get("input_dir")
    if given is not None and overlap(out, Path(given)):
        sys.exit(
            f"{command}: output_dir={out} and input_dir={given} overlap (one is, or is inside, "
            "the other): nothing was written; choose an output folder apart from the photos"
        )
    try:
        folder = OwnedFolder.claim(out, "bench", key="output_dir")
        folder.check_free(outputs)
    except NotOursError as err:
        sys.exit(f"{command}: {err}")
    return folder
