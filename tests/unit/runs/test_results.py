"""results.json's builder and writer: one builder for every evaluator, every write through
:class:`posbench.runs.rundir.RunDir`, and ``runs/`` modules that hold what their names say."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from posbench.runs.results import SCHEMA_VERSION, build_results, read_results
from posbench.runs.rundir import RunDir

ROOT = Path(__file__).resolve().parents[3]
TRAIN = {"tokens": 8, "steps": 1, "final_loss": 1.0, "tokens_per_second": 1.0, "wall_seconds": 1.0, "device": "cpu"}


def test_an_evaluation_part_is_built_in_the_file_order_and_completed_with_train() -> None:
    part = build_results(method="rope", seed=0, train_context=32, eval=[], task={"name": "copy"})
    assert list(part) == ["schema_version", "method", "seed", "train_context", "eval", "task", "created"]
    assert part["schema_version"] == SCHEMA_VERSION and "versions" not in part and "train" not in part
    whole = build_results(method="rope", seed=0, train_context=32, eval=[], train=TRAIN)
    assert whole["train"] == TRAIN and "posbench" in whole["versions"]
    with pytest.raises(ValueError, match="train.device"):
        build_results(method="rope", seed=0, train_context=32, eval=[],
                      train={k: v for k, v in TRAIN.items() if k != "device"})


def test_every_evaluator_builds_its_results_with_the_one_builder() -> None:
    for module in ("evaluation/loss.py", "evaluation/tasks.py"):
        source = (ROOT / "posbench" / module).read_text()
        assert "build_results(" in source and '"schema_version"' not in source, module


def _calls(name: str) -> list[str]:
    """``path:line`` of every plain call ``name(...)`` (not a method call) in posbench/."""
    found = []
    for path in (ROOT / "posbench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_results_write_goes_through_the_run_directory() -> None:
    assert [c for c in _calls("write_results") if not c.startswith("posbench/runs/rundir.py")] == []


def test_runs_modules_re_export_nothing() -> None:
    """A name is imported from the module that defines it (no facades): every name a runs module
    lists in ``__all__`` is defined there."""
    for path in (ROOT / "posbench" / "runs").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    for alias in node.names}
        listed = [elt.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                  for elt in node.value.elts]
        assert not set(listed) & imported, f"{path.name} re-exports {sorted(set(listed) & imported)}"


def test_a_results_write_inside_the_results_lock_takes_the_same_lock(tmp_path) -> None:
    """``posbench eval`` reads, merges and writes under one hold of the lock: the write re-enters it."""
    rundir = RunDir(tmp_path)
    results = build_results(method="rope", seed=0, train_context=32, eval=[], train=TRAIN)
    with rundir.results_lock():
        rundir.write_results(results)
    assert read_results(tmp_path)["method"] == "rope"
