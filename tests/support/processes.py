"""The processes a command leaves, seen through Linux's /proc."""

from __future__ import annotations

from pathlib import Path


def session_processes(session: int) -> dict[int, str]:
    """The live processes of a session, pid → command line (zombies, dead already, left out)."""
    alive = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == session and fields[0] != "Z":  # field 6 of stat: the session
            alive[int(stat.parent.name)] = cmdline
    return alive
