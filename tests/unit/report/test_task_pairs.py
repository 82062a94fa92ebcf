"""Paired differences of task accuracy between methods (tasks_paired.md)."""

from __future__ import annotations

import math

import pytest

from posbench.evaluation.tasks import learnt_at_c, learnt_on_test
from posbench.report.task_pairs import task_pairs, task_pairs_markdown
from posbench.report.tasks import tables_markdown, task_tables
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
    assert row.verdict == "A gains on B past C" and row.difference.mean == pytest.approx(0.4)
    assert row.change.mean == pytest.approx(0.4)  # both at 1.0 at C: the whole gap opened past C


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
        assert all((r.a, r.b, r.verdict) == ("rope", "alibi", "A falls behind B past C") for r in rows)  # listing order
        assert all(r.difference.mean == pytest.approx(-0.3) and r.change.mean == pytest.approx(-0.3) for r in rows)


def copy_run(tmp_path, method: str, seed: int, standard: dict[int, float], shifted: dict[int, float]) -> RunRecord:
    """A copy run with the standard and shifted tests at the given accuracies by length; its
    recorded verdict reads the standard test, as training writes it."""
    entries = [{"split": "test", "length": length, "extension": "none", "answers": 10, "test_set": test,
                "accuracy": {"mean": value, "low": value, "high": value, "n": 10, "kind": "bootstrap",
                             "half_width": 0.0}, "by_position": {}, "baselines": {"chance": 1 / 16}}
               for test, values in (("standard", standard), ("shifted", shifted)) for length, value in values.items()]
    task = {"name": "copy", "options": {"seed": 0, "learnt_at_c": 0.9}, "metrics": ["accuracy"], "chance": 1 / 16,
            "entries": entries}
    task["learnt_at_c"] = learnt_at_c(task, C)
    return RunRecord(tmp_path / f"{method}-s{seed}", {"method": method, "seed": seed, "train_context": C, "eval": [],
                                                      "train": {"steps": 600}, "task": task})


def test_each_test_set_is_gated_on_its_own_accuracy_at_c(tmp_path):
    """learned copies the standard test at C but not the shifted one (0.2 at C): its gap to alibi
    on the shifted test is there at C already, so it makes no claim past C there. The old gate
    read the standard test for every test set and called the gap at 2C an effect past C."""
    runs = [copy_run(tmp_path, "alibi", s, {C: 1.0, 2 * C: 0.9}, {C: 0.95, 2 * C: 0.9 - 0.01 * s}) for s in range(3)]
    runs += [copy_run(tmp_path, "learned", s, {C: 0.99, 2 * C: 0.5}, {C: 0.2, 2 * C: 0.15 + 0.01 * s})
             for s in range(3)]
    assert all(r.results["task"]["learnt_at_c"]["learnt"] for r in runs)  # the standard test's verdict
    assert learnt_on_test(runs[3].results["task"], C, "shifted") == {
        "test_set": "shifted", "length": C, "metric": "accuracy", "threshold": 0.9, "value": 0.2, "learnt": False}
    assert learnt_on_test(runs[0].results["task"], C, "shifted")["learnt"]
    table = task_tables(runs)[0]
    assert [r.seed for r in table.learnt("learned")] == [0, 1, 2]  # the reference (standard) test
    assert table.learnt("learned", "shifted") == [] and len(table.not_learnt("learned", "shifted")) == 3
    rows = task_pairs([table])
    assert [r.where for r in rows if r.where.startswith("shifted")] == []  # no common seed learnt on shifted
    (standard,) = [r for r in rows if r.where == "L=128 (2C)"]
    assert (standard.a, standard.b) == ("learned", "alibi") and standard.difference.mean == pytest.approx(0.5 - 0.9)
    text = tables_markdown([table])
    shifted = text[text.index("### test set `shifted`"):]
    assert "| learned | 0 | - | - | - |" in shifted and "s0 (0.200 < 0.9)" in shifted
    assert "| alibi | 3 | 0.950 ± 0.000 |" in shifted


def test_the_change_from_c_is_a_paired_difference_in_differences(tmp_path):
    """A gap that is there at C and stays past C is a difference at every length but no change
    from C: the past-C verdict reads the change."""
    at_c = {0: (0.95, 0.85), 1: (0.96, 0.84), 2: (0.97, 0.89)}  # seed -> (A, B) at C: A - B 0.10, 0.12, 0.08
    at_2c = {0: (0.90, 0.79), 1: (0.91, 0.79), 2: (0.92, 0.83)}  # A - B 0.11, 0.12, 0.09
    runs = [run(tmp_path, "a", s, {C: at_c[s][0], 4 * C: at_2c[s][0]}) for s in range(3)]
    runs += [run(tmp_path, "b", s, {C: at_c[s][1], 4 * C: at_2c[s][1]}) for s in range(3)]
    for r in runs:  # the grid fixture records no test set: learnt at C is read from its entries
        r.results["task"]["learnt_at_c"] = {"learnt": True, "value": 1.0, "threshold": 0.8}
    rows = task_pairs(task_tables(runs))
    (at, past) = [r for r in rows if r.where in ("8x8", "16x16")]
    assert not at.past and at.change is None and at.verdict == "A above B"
    diffs = [0.11 - 0.10, 0.12 - 0.12, 0.09 - 0.08]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, 2 df)
    assert past.difference.low > 0  # A - B at 4C alone looks like an effect past C
    assert past.change.mean == pytest.approx(mean)
    assert (past.change.low, past.change.high) == pytest.approx((mean - half, mean + half))
    assert past.verdict == "not distinguishable"  # the change from C contains 0
    text = task_pairs_markdown(rows)
    assert f"| 16x16 | a | b | +0.107 | [{past.difference.low:+.3f}, {past.difference.high:+.3f}] | +0.007 | " in text
    assert "| 8x8 | a | b | +0.100 | [" in text and "|  |  | 0,1,2 | A above B |" in text


def test_a_test_set_no_seed_learnt_says_so_in_its_panels(tmp_path):
    from posbench.report.tasks import task_figure

    runs = [copy_run(tmp_path, "alibi", s, {C: 1.0, 2 * C: 0.9}, {C: 0.5, 2 * C: 0.4}) for s in range(2)]
    fig = task_figure(task_tables(runs)[0])
    notes = [[t.get_text() for t in ax.texts] for ax in fig.axes]
    assert notes == [[], ["no seed learnt this test set at C:\nno claim past C (tasks.md lists each seed)"]]
    assert [len(ax.lines) > 2 for ax in fig.axes] == [True, True]  # the standard panel draws alibi
    # on the test set no seed learnt, each seed is drawn alone and marked, never as an average
    seeds = [line.get_label() for line in fig.axes[1].get_lines() if line.get_label().startswith("alibi")]
    assert seeds == ["alibi s0: not learnt at C (0.500 < 0.9)", "alibi s1: not learnt at C (0.500 < 0.9)"]
    assert "alibi" in [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
