"""docs/DESIGN.md is the true map: it names every module of the package, and only modules that
exist; the import graph runs one way, from the commands down to io/ and the root utilities."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nailseg"


def test_the_design_map_names_every_module_and_only_those():
    rows = re.findall(r"^\| `([\w/]+\.py)` \|", (ROOT / "docs" / "DESIGN.md").read_text(), re.M)
    modules = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }
    assert len(rows) == len(set(rows)), "a module is in the map twice"
    assert sorted(modules - set(rows)) == [], "modules the map leaves out"
    assert sorted(set(rows) - modules) == [], "the map names modules that do not exist"


def test_the_design_names_every_benchmark_outside_the_package():
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    note = text[text.index("**benchmarks/ (outside the package)**") :]
    modules = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if f"`{m}`" not in note] == [], "benchmarks the note leaves out"


# the package's rooms, lowest first: each imports only from its own room and the layers below it
LAYERS = [
    {"__init__", "errors", "device", "lifetime", "collector", "tables", "progress"},
    {"config", "io"},
    {"viz", "synth"},
    {"prep"},
    {"data"},
    {"model"},
    {"training", "inference"},
    {"compare", "bench"},
    {"train", "prepare", "__main__"},
]


def _imports() -> dict[str, set[str]]:
    """Each module's imports of the package's modules, those inside functions included."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_each_room_imports_only_rooms_below_it_and_no_module_imports_in_a_cycle():
    layer = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
    graph = _imports()
    assert sorted({_room(m) for m in graph} - set(layer)) == [], "rooms LAYERS leaves out"
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if _room(a) != _room(b) and layer[_room(b)] >= layer[_room(a)]
    )
    assert upward == [], "imports of a room in the same layer or above"
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError(f"an import cycle: {' -> '.join(path[path.index(module) :])}")
        if module not in done:
            for target in sorted(graph[module]):
                visit(target, [*path, module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])
