"""The folder predict writes into, and why predict may write there.

predict writes only into a folder it made: a new one, an empty one, or one whose `summary.json`
it wrote (its marker). That marker is written first, marked unfinished, and an earlier run's
`scores.csv` is removed with it, so a run that stops part-way never leaves the last run's results
describing masks they were not computed from. The folder may not overlap the photos or the true
masks, nor hold a symbolic link (predict never makes one: a link inside it could lead the writes
into the photos or the true masks). All of it is checked before the first write.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from nailseg.atomic import write_text
from nailseg.paths import overlap
from nailseg.prep.format import ForeignFolderError, require_owned

SUMMARY = "summary.json"  # predict's marker, rewritten finished at the end
SCORES = "scores.csv"
CREATOR = "nailseg.predict"
# what every summary.json predict wrote holds, unfinished ones and earlier versions' included
# (each since the first, 2f98124): a user's summary.json rarely has all three
_MARKER_KEYS = frozenset({"checkpoint", "images", "threshold"})
_OURS_IN_NEW_FOLDER = re.compile(rf"\.{re.escape(SUMMARY)}\.\d+\.tmp")


class OutputError(RuntimeError):
    """The output folder is not one predict may write into: the message says why."""


def check_output(output: Path, inputs: list[Path], masks: Path | None) -> None:
    """Raise OutputError unless predict may write into `output` (see the module docstring)."""
    named = [("input", path) for path in inputs] + ([("masks", masks)] if masks else [])
    for name, path in named:
        if overlap(output, path):
            raise OutputError(
                f"output={output} and {name}={path} overlap (one is, or is inside, the other): "
                "nothing was written; choose an output folder apart from the photos and masks"
            )
    try:
        require_owned(output, SUMMARY, _MARKER_KEYS, _OURS_IN_NEW_FOLDER)
    except ForeignFolderError as err:
        raise OutputError(f"output={output}: {err}") from err
    link = _first_link(output)
    if link is not None:
        raise OutputError(
            f"output={output} holds a symbolic link, {link} (to {os.readlink(link)}), which "
            "predict never makes: writes through it could land anywhere. Nothing was written; "
            "remove it or choose a new output folder"
        )


def _first_link(folder: Path) -> Path | None:
    """A symbolic link under `folder` (links are not followed), None when there is none; the
    file types come from the folder listings, so this costs no stat a file."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return None
    for entry in entries:
        if entry.is_symlink():
            return Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            found = _first_link(Path(entry.path))
            if found is not None:
                return found
    return None


def claim(output: Path, report: dict[str, Any]) -> None:
    """The first write: `summary.json`, marked unfinished (so the folder is known as predict's),
    and the last run's `scores.csv` removed."""
    write_summary(output, report, finished=False)
    (output / SCORES).unlink(missing_ok=True)


def write_summary(output: Path, report: dict[str, Any], *, finished: bool) -> None:
    write_text(
        output / SUMMARY,
        json.dumps({"created_by": CREATOR, "finished": finished, **report}, indent=2),
    )
