"""Run folders as nailseg's own: a Hydra callback marks each job's (and sweep's) folder with
`.nailseg.json` and records there every file the job wrote, for `make clean`.

A file is the job's when its status changed (`st_ctime`, which no user tool can set back) after
this process started; a folder whose marker nailseg did not write is left alone, with a warning.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from nailseg.io.ownership import (
    NotOursError,
    Record,
    new_marker,
    read_marker,
    recorded,
    write_marker,
)

log = logging.getLogger(__name__)

RUN_MARKER = ".nailseg.json"
MARKER_NAMES = (RUN_MARKER, "prepare.json", "synthetic.json", "summary.json")  # a folder's own
_CLOCK_SLACK_NS = 20_000_000  # file times come from the kernel's coarse clock, a tick behind


class OwnRunFolders(Callback):
    """Marks and records the folders Hydra makes for a run or a sweep (see the module docstring)."""

    def __init__(self) -> None:
        self.start_ns = time.time_ns() - _CLOCK_SLACK_NS

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._record(Path(config.hydra.sweep.dir), "sweep")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._record(Path(config.hydra.sweep.dir), "sweep")

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._record(Path(config.hydra.runtime.output_dir), "run")

    def on_job_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._record(Path(config.hydra.runtime.output_dir), "run")

    def _record(self, folder: Path, kind: str) -> None:
        try:
            record_written(folder, kind, self.start_ns)
        except NotOursError as err:
            log.warning("%s: nothing recorded there, so make clean leaves it", err)


def record_written(folder: Path, kind: str, since_ns: int) -> None:
    """Mark `folder` as nailseg's `kind` (keeping its id) and record the files written there since
    `since_ns` (see the module docstring) beside the recorded ones still as they were."""
    if not folder.is_dir():
        return
    marker = read_marker(folder, RUN_MARKER, kind) or new_marker(kind)
    files = {rel: r for rel, r in recorded(marker).items() if Record.of(folder / rel) == r}
    for rel, st in _own_files(folder):
        if st.st_ctime_ns >= since_ns:
            files[rel] = Record(st.st_size, st.st_mtime_ns, st.st_ino)
    marker["files"] = {rel: record.as_list() for rel, record in sorted(files.items())}
    write_marker(folder, RUN_MARKER, marker)


def _own_files(folder: Path, rel: str = "") -> Iterator[tuple[str, os.stat_result]]:
    """(path below `folder`, lstat) of each plain file, not descending into a folder of its own
    (one with a marker: a sweep's job, a prepared root), nor following links."""
    for entry in os.scandir(folder / rel if rel else folder):
        path = f"{rel}{entry.name}"
        if entry.is_dir(follow_symlinks=False):
            if not any(os.path.lexists(Path(entry.path) / name) for name in MARKER_NAMES):
                yield from _own_files(folder, f"{path}/")
        elif entry.is_file(follow_symlinks=False) and path != RUN_MARKER:
            yield path, entry.stat(follow_symlinks=False)
