"""Paired differences of task accuracy between methods (tasks_paired.md)."""

from __future__ import annotations

import math

import pytest

from posbench.report.task_pairs import task_pairs, task_pairs_markdown
from posbench.report.tasks import task_tables
from posbench.runs.run_record import RunRecord

C = 64
T_975_1 = 12.706204736174707  # Student-t quantile 0.975 with 1 degree of freedom (tables)


def run(tmp_path, method: str, seed: int, accuracy: dict[int, float], learnt: bool = True) -> RunRecord:
    """A grid task run whose accuracy at each length is given (the entries hold only what the
    tables read)."""
    entries = [{"split": "test", "length": length, "extension": "none", "answers": 10,
                "accuracy": {"mean": value, "low": value, "high": value, "n": 10, "kind": "bootstrap",
                             "half_width": 0.0}, "by_position": {}, "baselines": {"chance": 1 / 3}}
               for length, value in accuracy.items()]
    return RunRecord(tmp_path / f"{method}-s{seed}", {
        "method": method, "seed": seed, "train_context": C, "eval": [], "train": {"steps": 600},
        "task": {"name": "same_line", "options": {"seed": 0}, "metrics": ["accuracy"], "chance": 1 / 3,
                 "entries": entries,
                 "learnt_at_c": {"learnt": learnt, "value": accuracy[64] if learnt else 0.4, "threshold": 0.95}}})


def test_pairs_are_by_seed_over_the_seeds_both_learnt(tmp_path):
    a = {0: {64: 1.0, 256: 0.9}, 1: {64: 1.0, 256: 0.8}, 2: {64: 1.0, 256: 0.7}}
    b = {0: {64: 1.0, 256: 0.5}, 1: {64: 1.0, 256: 0.6}, 2: {64: 0.4, 256: 0.9}}  # s2 not learnt at C
    runs = [run(tmp_path, "axial_rope", s, v) for s, v in a.items()]
    runs += [run(tmp_path, "learned_2d", s, v, learnt=s != 2) for s, v in b.items()]
    rows = task_pairs(task_tables(runs))
    (row,) = [r for r in rows if r.where == "16x16"]
    assert (row.a, row.b, row.seeds) == ("axial_rope", "learned_2d", (0, 1))
    diffs = [0.9 - 0.5, 0.8 - 0.6]  # seed 2 left out: learned_2d did not learn the task at C
    mean = sum(diffs) / 2
    half = T_975_1 * abs(diffs[0] - diffs[1]) / math.sqrt(2) / math.sqrt(2)
    assert row.difference.mean == pytest.approx(mean)
    assert (row.difference.low, row.difference.high) == pytest.approx((mean - half, mean + half))
    assert row.verdict == "not distinguishable"  # 2 seeds: t(1) is wide
    text = task_pairs_markdown(rows)
    assert "| 16x16 | axial_rope | learned_2d | +0.300 |" in text and "| 0,1 | not distinguishable |" in text


def test_one_common_seed_is_no_verdict(tmp_path):
    runs = [run(tmp_path, "axial_rope", 0, {64: 1.0, 256: 0.9}), run(tmp_path, "nope", 0, {64: 1.0, 256: 0.2})]
    rows = task_pairs(task_tables(runs))
    assert rows and all(r.difference is None and r.verdict.startswith("no interval") for r in rows)


def test_a_clear_difference_is_called(tmp_path):
    runs = [run(tmp_path, "a", s, {64: 1.0, 256: 0.9 + 0.01 * s}) for s in range(3)]
    runs += [run(tmp_path, "b", s, {64: 1.0, 256: 0.5 + 0.01 * s}) for s in range(3)]
    (row,) = [r for r in task_pairs(task_tables(runs)) if r.where == "16x16"]
    assert row.verdict == "A above B" and row.difference.mean == pytest.approx(0.4)


def test_flipflop_and_copy_are_paired_on_their_length_true_tests_too(tmp_path):
    """The standard flip-flop test's lookback does not grow with length and the standard copy
    test mixes string length with position: verdicts past C must also come from the sparse, far
    and shifted tests (they were paired on the standard test alone)."""
    def task_run(task, tests, method, seed, value):
        entries = [{"split": "test", "length": length, "extension": "none", "answers": 10, "test_set": test,
                    "accuracy": {"mean": value if length > C else 1.0, "low": None, "high": None, "n": 10,
                                 "kind": "bootstrap", "half_width": 0.0}, "by_position": {}, "baselines": {}}
                   for test in tests for length in (C, 2 * C)]
        return RunRecord(tmp_path / f"{task}-{method}-s{seed}", {
            "method": method, "seed": seed, "train_context": C, "eval": [], "train": {"steps": 600},
            "task": {"name": task, "options": {"seed": 0}, "metrics": ["accuracy"], "chance": 0.5, "entries": entries,
                     "learnt_at_c": {"learnt": True, "value": 1.0, "threshold": 0.9}}})

    for task, tests in (("flipflop", ["standard", "sparse", "far"]), ("copy", ["standard", "shifted"])):
        runs = [task_run(task, tests, m, s, v + 0.01 * s) for m, v in (("alibi", 0.9), ("rope", 0.6)) for s in range(3)]
        rows = [r for r in task_pairs(task_tables(runs)) if r.where.endswith("L=128 (2C)")]
        assert [r.where for r in rows] == ["L=128 (2C)"] + [f"{t} L=128 (2C)" for t in tests[1:]]
        assert all((r.a, r.b, r.verdict) == ("rope", "alibi", "A below B") for r in rows)  # the listing order
        assert all(r.difference.mean == pytest.approx(-0.3) for r in rows)
