"""The import graph of posbench/ (scripts/import_graph.py): no cycle, no import from a lower layer
up (the package __init__, the Python API, aside), every module in a layer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "import_graph.py"


def load_script():
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_import_graph_has_no_cycle_and_no_upward_import():
    graph = load_script()
    edges, rows = graph.graph()
    assert len(rows) > 100  # the parser sees the imports at all
    assert graph.cycles(edges) == []
    assert graph.upward(rows) == []
    assert graph.unlayered(rows) == []


def test_the_script_finds_a_cycle():
    graph = load_script()
    assert graph.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
