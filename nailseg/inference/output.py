"""The folder predict writes into, and why predict may write there.

Only a new folder, an empty one, or one whose `summary.json` predict wrote (its marker:
`nailseg.io.ownership`'s tool, kind `predict` and folder id), written first, marked unfinished.
Then `outputs.txt` lists every output the run is to write (and the earlier run's, until they are
gone), and the earlier run's are removed: a rerun, even one stopped part-way, leaves only its own
results. A file predict did not write (each output bears its run's stamp, its modification time,
as listed) is never removed or replaced: one where this run would write is refused. The folder
may not overlap the photos or the true masks, nor hold a symbolic link (one could lead the writes
into them). All of it is checked before the first write; one run writes a folder at a time
(`nailseg.io.lock`); a rerun removes a killed run's temporary files, for listed outputs only.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

from nailseg.errors import UserError
from nailseg.io.atomic import write_bytes, write_text
from nailseg.io.overlap import overlap
from nailseg.io.ownership import (
    ForeignFolderError,
    below,
    delete_listed,
    first_of,
    new_marker,
    read_marker,
    remove_temp_files,
    require_owned,
    stamped,
)
from nailseg.prep.format import new_stamp, stamp_of

SUMMARY = "summary.json"  # predict's marker, rewritten finished at the end
SCORES = "scores.csv"
OUTPUTS = "outputs.txt"  # what predict writes here besides its marker, with its stamp
OUTPUT_FOLDERS = ("masks", "overlays")
CREATOR = "nailseg.predict"
MARKER_KIND = "predict"
PREDICT_LOCK = ".predict.lock"  # held while predict writes here (nailseg.io.lock)
# what a run killed before its marker was in place leaves: the marker's temporary file, the lock
_OURS_IN_NEW_FOLDER = re.compile(rf"\.{re.escape(SUMMARY)}\.\d+\.tmp|{re.escape(PREDICT_LOCK)}")


class OutputError(UserError, RuntimeError):
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
        require_owned(output, SUMMARY, MARKER_KIND, _OURS_IN_NEW_FOLDER)
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


def claim(output: Path, report: dict[str, Any], outputs: list[str]) -> int:
    """The first writes (see the module docstring): `summary.json`, marked unfinished (so the
    folder is known as predict's), `outputs.txt` listing `outputs` (the paths this run is to
    write, with the stamp it returns, which each of them must be written with) and the earlier
    run's, then the earlier run's outputs removed. Raises OutputError, before any of it, when a
    file predict did not write lies where this run would write."""
    earlier = listed_outputs(output)
    in_the_way = [rel for rel in outputs if os.path.lexists(output / rel) and rel not in earlier]
    if in_the_way:
        raise OutputError(
            f"output={output}: {first_of(output, in_the_way)} lies where this run would write, "
            f"and predict did not write it (not listed in {OUTPUTS} with its stamp), so it is "
            "not replaced: nothing was written; move it, or choose a new output folder"
        )
    stamp = new_stamp()
    write_summary(output, report, finished=False)
    list_outputs(output, earlier | dict.fromkeys(outputs, stamp))
    delete_listed(output, {rel: stamped(stamp) for rel, stamp in earlier.items()})
    remove_temp_files(output, [*earlier, *outputs, SUMMARY, OUTPUTS])  # a killed run's, if any
    return stamp


def list_outputs(output: Path, stamps: dict[str, int]) -> None:
    """Write `outputs.txt`: a line `<stamp>\t<path>` for each output (names that are not UTF-8
    kept as their bytes)."""
    text = "".join(f"{stamp}\t{rel}\n" for rel, stamp in stamps.items())
    write_bytes(output / OUTPUTS, text.encode("utf-8", "surrogateescape"))


def listed_outputs(output: Path) -> dict[str, int]:
    """The outputs an earlier run listed that are still as it wrote them (path → stamp): lines of
    `outputs.txt` naming `scores.csv` or a file under `masks/` or `overlays/` (no `..`, no
    absolute path) that still bears the listed stamp; a file put in its place (a user's) bears
    another, and is not predict's."""
    try:
        text = (output / OUTPUTS).read_bytes().decode("utf-8", "surrogateescape")
    except FileNotFoundError:
        return {}
    ours = {}
    for line in text.splitlines():
        stamp, _, rel = line.partition("\t")
        parts = PurePosixPath(rel).parts
        safe = rel == SCORES or (len(parts) > 1 and parts[0] in OUTPUT_FOLDERS and below(rel))
        if safe and stamp.isdigit() and stamp_of(output / rel) == int(stamp):
            ours[rel] = int(stamp)
    return ours


def write_summary(output: Path, report: dict[str, Any], *, finished: bool) -> None:
    """The marker and report; the folder keeps the id its first run's marker gave it."""
    marker = read_marker(output, SUMMARY, MARKER_KIND) or new_marker(MARKER_KIND)
    identity = {key: marker[key] for key in ("tool", "kind", "id", "marker_version")}
    write_text(
        output / SUMMARY,
        json.dumps({**identity, "created_by": CREATOR, "finished": finished, **report}, indent=2),
    )
