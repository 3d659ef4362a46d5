"""Only nailseg/io/ creates, replaces or deletes a file or folder: every other module of nailseg
writes through it, so atomic writes, link refusal and ownership are kept in one place."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nailseg"
IO = PACKAGE / "io"
# functions of os and shutil, and methods of a path (or an open file), that create, replace or
# delete a path
MODULES = {
    "os": {"remove", "unlink", "rename", "renames", "replace", "rmdir", "removedirs", "mkdir"}
    | {"makedirs", "symlink", "link", "truncate", "mkfifo"},
    "shutil": {"rmtree", "copy", "copy2", "copyfile", "copytree", "move"},
    "tempfile": {"mkdtemp", "mkstemp", "TemporaryDirectory", "NamedTemporaryFile"},
    "dataclasses": set(),  # dataclasses.replace copies a dataclass
}
METHODS = {
    "unlink",
    "rename",
    "replace",
    "rmdir",
    "mkdir",
    "write_text",
    "write_bytes",
    "touch",
} | {
    "symlink_to",
    "hardlink_to",
}
WRITE_MODES = set("wax+")
WRITE_FLAGS = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"}


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    if isinstance(call.func, ast.Name):
        return call.func.id
    return None


def _mode(call: ast.Call, position: int) -> str | None:
    """The mode string an open call passes (positionally at `position`, or as `mode=`)."""
    args = [
        *call.args[position : position + 1],
        *(k.value for k in call.keywords if k.arg == "mode"),
    ]
    for arg in args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value
    return None


def _writes(call: ast.Call) -> str | None:
    """Why `call` writes to the filesystem, None when it does not."""
    name = _called_name(call)
    if isinstance(call.func, ast.Attribute):
        owner = call.func.value.id if isinstance(call.func.value, ast.Name) else None
        if owner in MODULES:
            if name in MODULES[owner]:
                return f"{owner}.{name}()"
        # str.replace takes two arguments, where Path.replace and Path.rename take one
        elif name in METHODS and not (name in ("replace", "rename") and len(call.args) != 1):
            return f".{name}()"
    if name == "open":
        position = (
            0 if isinstance(call.func, ast.Attribute) else 1
        )  # Path.open(mode) / open(p, mode)
        mode = _mode(call, position)
        if mode and WRITE_MODES & set(mode):
            return f"open(..., {mode!r})"
        flags = {n.attr for n in ast.walk(call) if isinstance(n, ast.Attribute)} & WRITE_FLAGS
        if flags:
            return f"open with {', '.join(sorted(flags))}"
    return None


def _violations() -> list[str]:
    found = []
    for module in sorted(PACKAGE.rglob("*.py")):
        if IO in module.parents:
            continue
        tree = ast.parse(module.read_text(), filename=str(module))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (why := _writes(node)):
                found.append(f"{module.relative_to(PACKAGE.parent)}:{node.lineno}: {why}")
    return found


def test_only_nailseg_io_creates_replaces_or_deletes_files():
    assert _violations() == []


def test_the_check_finds_each_kind_of_write(tmp_path):
    """The check itself: each way of writing is caught, and reads and str.replace are not."""
    source = """
import os, shutil
from pathlib import Path
p = Path("x")
p.unlink(); p.rename("y"); p.replace("y"); os.replace("a", "b"); os.remove("a"); p.rmdir()
items.remove(1); replace(record, a=1); data.copy(); write_text(p, "atomic, from nailseg.io")
shutil.rmtree("d"); p.write_text("t"); p.write_bytes(b"b"); p.mkdir(); os.makedirs("d")
open("f", "w"); open("f", mode="a"); p.open("r+"); os.open("f", os.O_WRONLY | os.O_CREAT)
open("f"); open("f", "rb"); p.open(); "a".replace("a", "b"); p.read_text()
dataclasses.replace(record)
"""
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    caught = [why for call in calls if (why := _writes(call))]
    assert len(caught) == 15, caught
