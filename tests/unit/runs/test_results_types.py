"""The typed dicts of posbench.runs.results_types match what the producers really write: every key of a
real results.json (a trained text run) and of real task entries is declared, and every required
key is present, recursively through the nested pieces."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

import pytest
import torch
from helpers import results_of, run_eval

from posbench.evaluation.tasks import answer_scores, task_entry
from posbench.model.transformer import ModelConfig, build_model
from posbench.runs.results_types import IntervalSummary, LossEntry, Results, TaskEntry
from posbench.tasks import TEST, make_task

C = 32


def mismatches(value: Any, declared: Any, where: str) -> list[str]:
    """Keys of ``value`` that ``declared`` (a type, possibly nesting TypedDicts) does not declare,
    and its required keys that ``value`` lacks."""
    if typing.is_typeddict(declared):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {type(value).__name__}"]
        hints = typing.get_type_hints(declared)
        found = [f"{where}.{k}: not declared in {declared.__name__}" for k in value if k not in hints]
        found += [f"{where}.{k}: required by {declared.__name__}, missing" for k in declared.__required_keys__
                  if k not in value]
        for key in value.keys() & hints.keys():
            found += mismatches(value[key], hints[key], f"{where}.{key}")
        return found
    origin, args = typing.get_origin(declared), typing.get_args(declared)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return []
        inner = [a for a in args if a is not type(None)]
        return mismatches(value, inner[0], where) if len(inner) == 1 else []
    if origin is list and args:
        return [m for i, item in enumerate(value) for m in mismatches(item, args[0], f"{where}[{i}]")]
    if origin is dict and len(args) == 2:
        return [m for k, item in value.items() for m in mismatches(item, args[1], f"{where}[{k!r}]")]
    return []


def test_checker_sees_an_undeclared_and_a_missing_key():
    summary = {"mean": 0.5, "low": 0.4, "high": 0.6, "n": 3, "kind": "bootstrap", "half_width": 0.1}
    assert mismatches(summary, IntervalSummary, "s") == []
    assert mismatches({**summary, "extra": 1}, IntervalSummary, "s") == ["s.extra: not declared in IntervalSummary"]
    entry = {"split": "validation", "length": 2, "num_sequences": 1, "loss_by_position": [1.0, 2.0],
             "bands": {"0-1": 1.0}, "tokens_per_second": 1.0, "seconds": 1.0, "windowed": {"stride": 1}}
    found = mismatches(entry, LossEntry, "e")
    assert "e.windowed.seconds: required by WindowedCurve, missing" in found
    assert "e.windowed.loss_by_position: required by WindowedCurve, missing" in found


def test_a_trained_text_run_results_json_is_declared(trained_run):
    run_dir = trained_run("eval.extension=[none,rerope]")  # eval.lengths=[64], C = 32
    results = json.loads((run_dir / "results.json").read_text())
    assert mismatches(results, Results, "results") == []
    # what the test walked through: a full entry with its nested blocks, and a rerope entry
    plain, rerope = (e for e in results["eval"] if e["length"] == 64)
    assert {"windowed", "cost", "effective_length", "sequence_bands"} <= plain.keys()
    assert "extension_options" in rerope and "train" in results and "environment" in results


def test_entries_posbench_eval_adds_are_declared(trained_run):
    """After posbench eval: an entry added at a new length, a variant (other windows) and the
    keys it stamps on every entry (data, checkpoint_step, precision)."""
    run_dir = trained_run("method=rope")  # the default method: the rope run other tests train too
    run_eval(run_dir, "eval.lengths=[64,96]", "eval.num_sequences=2")
    results = results_of(run_dir)
    assert mismatches(results, Results, "results") == []
    assert any(e.get("added") for e in results["eval"]) and results["eval_variants"][0]["variant"]
    assert {"data", "checkpoint_step", "precision"} <= results["eval_variants"][0].keys()


def test_task_entries_are_declared():
    """A copy entry straight from task_entry (exact match, string length), before the pass stamps it."""
    task = make_task({"name": "copy", "num_symbols": 8}, C)
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=task.vocab_size, d_model=32, n_layers=2, n_heads=4), "rope")
    batch = task.sequences(TEST, 2 * C, 6)
    correct, loss = answer_scores(model, batch, 4, torch.device("cpu"))
    entry = task_entry(task, batch, correct, loss, length=2 * C, train_context=C)
    assert {"exact_match", "string_length", "by_string_length"} <= entry.keys()
    assert mismatches(json.loads(json.dumps(entry)), TaskEntry, "entry") == []


@pytest.mark.parametrize("overrides", [
    ("task=flipflop", "eval.lengths=[32,64]", "eval.extension=[none,self_extend]"),  # lookback, extension options
    ("task=life", "method=axial_rope", "trainer.context=16", "eval.lengths=[16,64]",
     "eval.extension=[none,linear]"),  # a grid task: rings, extension per axis
])
def test_a_trained_task_run_results_json_is_declared(trained_run, overrides):
    results = json.loads((trained_run(*overrides) / "results.json").read_text())
    assert mismatches(results, Results, "results") == []
    assert results["eval"] == [] and "learnt_at_c" in results["task"]
    assert any("extension_options" in e or "extension_per_axis" in e for e in results["task"]["entries"])
