"""The folder a benchmark writes into: its own, or refused.

A benchmark writes only into a folder that is new or empty, which it marks first, or one it
marked before (`.nailseg.json`, kind `bench`: `nailseg.io.ownership`'s marker); a folder holding
anything else without that marker is the user's, refused, named, before anything is written.
Inside its folder it replaces only the files its marker records as written and unchanged: a file
of the user's where an output would go is refused, named, and stays. The outputs are recorded
once written, so `make clean` removes them and nothing else.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from nailseg.io.atomic import NotOursError
from nailseg.io.folder import MARKER as RUN_MARKER
from nailseg.io.ownership import claim_files, record_files, require_owned

KIND = "bench"
# what a first run killed while writing its marker leaves in the new folder
_OURS_IN_NEW_FOLDER = re.compile(rf"\.{re.escape(RUN_MARKER)}\.\d+\.tmp")


def claim_output(folder: Path, outputs: Iterable[str]) -> None:
    """Make `folder` the benchmark's before its first write: raises `ForeignFolderError` when it
    is the user's, `NotOursError` when a file at one of `outputs` (paths below it) is not one the
    marker records; marks a new folder."""
    outputs = list(outputs)
    require_owned(folder, RUN_MARKER, KIND, _OURS_IN_NEW_FOLDER)
    claim_files(folder, RUN_MARKER, KIND, outputs)
    record_files(folder, RUN_MARKER, KIND, [])


def record_outputs(folder: Path, outputs: Iterable[str]) -> None:
    """Record `outputs`, just written, in the marker: the benchmark's to replace or remove."""
    record_files(folder, RUN_MARKER, KIND, outputs)


@contextmanager
def refused_in_one_line(command: str) -> Iterator[None]:
    """A refusal to write (`NotOursError`: a user's folder or file) ends `command` with one line
    naming it, not a traceback."""
    try:
        yield
    except NotOursError as err:
        sys.exit(f"{command}: {err}")
