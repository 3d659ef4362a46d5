"""docs/DESIGN.md is the true map: it names every module of the package, and only modules that
exist."""

from __future__ import annotations

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
