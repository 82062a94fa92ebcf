"""Paired differences of task accuracy between methods, by seed (``tasks_paired.md``).

For every task table, every pair of groups (A, B) and every length, A minus B of the plain
model's accuracy on each test set the task pairs on (``PAIRED_TESTS``: flip-flop's standard,
sparse and far tests, copy's standard and shifted ones, an image task's protocols; a row names a
test set other than the standard one, ``sparse L=512 (8C)``),
paired by seed over the seeds that learnt *that test set* at C in *both* groups (a run not learnt
at C on a test set makes no claim past C on it; :func:`posbench.evaluation.tasks.learnt_on_test`),
with a Student-t interval over the per-seed differences
(:func:`posbench.evaluation.stats.paired_difference`).

Past C a row also reports the **change from C**, a paired difference-in-differences: per seed
``(A - B at L) - (A - B at C)``, with its t-interval over the same seeds. A gap that is already
there at C is no effect of the length; past C the verdict reads the change. A pair needs two
common learnt seeds: one seed gives no interval and is listed as such, never as a verdict.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

from posbench.evaluation.stats import Interval, paired_difference, t_interval
from posbench.report.tasks import TaskTable, plain_entries
from posbench.tasks.base import STANDARD

METRIC = "accuracy"


@dataclass(frozen=True)
class TaskPair:
    """One row: ``a`` minus ``b`` on ``task`` at ``length`` (its name ``where``), over ``seeds``;
    past C (``past``) also ``change``, the paired change of A - B from C (None at and below C)."""

    task: str
    where: str
    a: str
    b: str
    seeds: tuple[int, ...]
    difference: Interval | None
    change: Interval | None = None
    past: bool = False

    @property
    def verdict(self) -> str:
        """At or below C on the difference; past C on its change from C."""
        d = self.change if self.past else self.difference
        if d is None or d.low is None or d.high is None or len(self.seeds) < 2:
            return "no interval (fewer than 2 common learnt seeds)"
        if d.low > 0:
            return "A gains on B past C" if self.past else "A above B"
        if d.high < 0:
            return "A falls behind B past C" if self.past else "A below B"
        return "not distinguishable"


def accuracy_by_seed(table: TaskTable, label: str, length: int, test: str = STANDARD) -> dict[int, float]:
    """seed -> the accuracy at ``length`` on test set ``test`` of the group's runs that learnt that
    test set at C."""
    out = {}
    for run in table.learnt(label, test):
        entry = plain_entries(run, METRIC, test).get(length)
        if entry is not None and entry[METRIC].get("mean") is not None:
            out[run.seed] = float(entry[METRIC]["mean"])
    return out


def task_pairs(tables: Sequence[TaskTable]) -> list[TaskPair]:
    """Every pair of groups of every table at every length of each paired test set (groups in
    table order); ``where`` names a test set other than the standard one. Past C, over the seeds
    that hold both lengths, the change from C (:func:`change_from_c`)."""
    rows = []
    for table in tables:
        for test, length in itertools.product(table.paired_tests, table.lengths):
            values = {label: accuracy_by_seed(table, label, length, test) for label in table.groups}
            at_c = {label: accuracy_by_seed(table, label, table.context, test) for label in table.groups}
            where = table.length_name(length) if test == STANDARD else f"{test} {table.length_name(length)}"
            past = length > table.context
            for a, b in itertools.combinations(table.groups, 2):
                common = tuple(sorted(set(values[a]) & set(values[b])))
                if not common:
                    continue
                diff = paired_difference(values[a], values[b]) if len(common) >= 2 else None
                change = change_from_c(values[a], values[b], at_c[a], at_c[b]) if past else None
                rows.append(TaskPair(table.label, where, a, b, common, diff, change, past))
    return rows


def change_from_c(a: dict[int, float], b: dict[int, float], a_at_c: dict[int, float],
                  b_at_c: dict[int, float]) -> Interval | None:
    """The paired difference-in-differences ``(A - B at L) - (A - B at C)`` over the seeds that
    hold all four values (``seed -> accuracy``): a t-interval with >= 2 such seeds, else None."""
    seeds = [s for s in a if s in b and s in a_at_c and s in b_at_c]
    if len(seeds) < 2:
        return None
    return t_interval([(a[s] - b[s]) - (a_at_c[s] - b_at_c[s]) for s in seeds])


def _interval_text(d: Interval | None) -> tuple[str, str]:
    if d is None or d.low is None or d.high is None:
        return ("-" if d is None else f"{d.mean:+.3f}"), "-"
    return f"{d.mean:+.3f}", f"[{d.low:+.3f}, {d.high:+.3f}]"


def task_pairs_markdown(rows: Sequence[TaskPair]) -> str:
    """The pairs as one markdown table per task."""
    lines = ["# Synthetic tasks: paired differences of accuracy", "",
             "A - B of the accuracy on each paired test set (`where` names it when it is not the standard "
             "one; fraction of right answers; positive: A is "
             "better), paired by seed over the seeds that learnt that test set at C (its own accuracy at C) "
             "in both groups; 95 % Student-t interval over the per-seed differences. Past C, **change from "
             "C** is the paired difference-in-differences (A - B at L) - (A - B at C) per seed, with its "
             "interval, and the verdict reads it: a gap already there at C is no effect past C. "
             "**not distinguishable**: the interval contains 0. With fewer than 2 common learnt seeds there "
             "is no interval and no verdict. See docs/tasks.md.", ""]
    for task in dict.fromkeys(r.task for r in rows):
        lines += [f"## {task}", "", "| where | A | B | A - B | 95 % interval | change from C | 95 % interval "
                  "| seeds | verdict |", "|---|---|---|---:|---|---:|---|---|---|"]
        for r in (r for r in rows if r.task == task):
            mean, interval = _interval_text(r.difference)
            change, change_interval = _interval_text(r.change) if r.past else ("", "")
            seeds = ",".join(map(str, r.seeds))
            lines.append(f"| {r.where} | {r.a} | {r.b} | {mean} | {interval} | {change} | {change_interval} "
                         f"| {seeds} | {r.verdict} |")
        lines.append("")
    if not rows:
        lines.append("No pair of groups shares a seed that learnt the task at C.")
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["TaskPair", "accuracy_by_seed", "change_from_c", "task_pairs", "task_pairs_markdown"]
