"""The folder predict writes into, and why predict may write there.

predict writes only into a folder it made: a new one, an empty one, or one whose `summary.json`
it wrote (its marker). That marker is written first, marked unfinished. With it, `outputs.txt`
lists every mask and overlay the run is to write (and those of the run before, until they are
gone), and then the earlier run's listed outputs and its `scores.csv` are removed. So a rerun
leaves only its own results: no mask of a photo since removed, no overlay of a run with other
settings, and no scores describing masks they were not computed from, even when it stops
part-way. A file predict did not list (a user's, even under `masks/`) stays, and so do the masks
of a folder an older predict wrote (it listed none). The folder may not overlap the photos or
the true masks, nor hold a symbolic link (predict never makes one: a link inside it could lead
the writes into the photos or the true masks). All of it is checked before the first write.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

from nailseg.atomic import write_bytes, write_text
from nailseg.paths import overlap
from nailseg.prep.format import ForeignFolderError, delete_listed, require_owned

SUMMARY = "summary.json"  # predict's marker, rewritten finished at the end
SCORES = "scores.csv"
OUTPUTS = "outputs.txt"  # the masks and overlays predict writes here, one relative path a line
OUTPUT_FOLDERS = ("masks", "overlays")
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


def claim(output: Path, report: dict[str, Any], outputs: list[str]) -> None:
    """The first writes (see the module docstring): `summary.json`, marked unfinished (so the
    folder is known as predict's), `outputs.txt` listing `outputs` (the paths this run is to
    write) and the earlier run's, then the earlier run's outputs and `scores.csv` removed."""
    earlier = _listed(output)
    write_summary(output, report, finished=False)
    list_outputs(output, [*dict.fromkeys(earlier + outputs)])
    delete_listed(output, earlier)
    (output / SCORES).unlink(missing_ok=True)


def list_outputs(output: Path, outputs: list[str]) -> None:
    """Write `outputs.txt` (names that are not UTF-8 kept as their bytes)."""
    text = "".join(f"{rel}\n" for rel in outputs)
    write_bytes(output / OUTPUTS, text.encode("utf-8", "surrogateescape"))


def _listed(output: Path) -> list[str]:
    """The outputs an earlier run listed: the lines of `outputs.txt` that name a file under
    `masks/` or `overlays/` (no `..`, no absolute path); none without the file."""
    try:
        text = (output / OUTPUTS).read_bytes().decode("utf-8", "surrogateescape")
    except FileNotFoundError:
        return []
    listed = []
    for line in text.splitlines():
        parts = PurePosixPath(line).parts
        safe = len(parts) > 1 and parts[0] in OUTPUT_FOLDERS and ".." not in parts
        if safe and not line.startswith("/") and (output / line).is_file():
            listed.append(line)
    return listed


def write_summary(output: Path, report: dict[str, Any], *, finished: bool) -> None:
    write_text(
        output / SUMMARY,
        json.dumps({"created_by": CREATOR, "finished": finished, **report}, indent=2),
    )
