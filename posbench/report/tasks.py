"""Task runs in comparisons: accuracy against length per method, with intervals, and tables.

``posbench plot`` (and a sweep's ``comparison/``) hands task runs here: runs are split by task
(name and options), grouped within a task as the loss tables group text runs
(:func:`posbench.report.compare.group_runs`: runs that differ only by seed), and each group's accuracy
at every length gets a 95 % interval: a t-interval over the seeds' means with >= 2 seeds, else a
bootstrap over the one run's sequences (:func:`posbench.evaluation.stats.across_runs`).

Gating, test set by test set: a seed whose accuracy at C on a test set is below
``task.learnt_at_c`` (:func:`posbench.evaluation.tasks.learnt_on_test`) is never averaged on that
test set: its tables and figures average the seeds learnt on it only and list the others, seed by
seed, as "not learnt at C". A test set can be harder at C than the standard one (copy's shifted
test), and a gap already there at C is no effect past C. Each test set (``task.tests``) gets its
own tables, with its baselines (chance and the shortcuts) and the task's answer axes (lookback,
string length, ...) beside them. What a table shows comes from the run's task record and the
task's declarations (:class:`posbench.tasks.Task` ``metrics``, ``TESTS``, ``TEST_NOTES``, ``AXES``):
nothing here names a task.

Writes ``tasks_<task>.png`` (accuracy and, for copy, exact match against length), ``tasks.md``
and ``tasks.csv``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from posbench.core.io import write_text_atomic
from posbench.evaluation.stats import Interval, across_runs
from posbench.evaluation.tasks import learnt_at_c, learnt_on_test
from posbench.model.extension import NONE
from posbench.report.compare import group_runs
from posbench.report.figures import line_styles, new_figure, save
from posbench.runs.results_types import AxisSummary, TaskEntry, TaskRecord
from posbench.runs.run_record import RunRecord
from posbench.tasks.base import STANDARD, task_class


def is_task_run(run: RunRecord) -> bool:
    return "task" in run.results


def task_label(run: RunRecord) -> str:
    """``name`` plus the options that set its data (``flipflop {p_ignore: 0.8, ...}``)."""
    task = run.results["task"]
    return f"{task['name']} {json.dumps(task.get('options', {}), sort_keys=True)}"


def task_title(table: TaskTable) -> str:
    """A figure's title for a task: ``flipflop (p_ignore 0.8, seed 0)``, its options as settings
    (unset ones left out), wrapped; not the JSON that keys the tables."""
    options = json.loads(table.label.split(" ", 1)[1]) if " " in table.label else {}
    shown = ", ".join(f"{k} {v}" for k, v in sorted(options.items()) if v is not None)
    return "\n".join(textwrap.wrap(f"{table.name} ({shown})" if shown else table.name, 110))


def test_set(entry: TaskEntry) -> str:
    """An entry's test set (entries from before named test sets are the standard one)."""
    return entry.get("test_set", STANDARD)


def plain_entries(run: RunRecord, metric: str, test: str = STANDARD) -> dict[int, TaskEntry]:
    """length -> the plain model's entry of test set ``test`` holding ``metric``."""
    return {int(e["length"]): e for e in run.results["task"]["entries"]
            if e.get("extension", NONE) == NONE and metric in e and test_set(e) == test}


def gate(run: RunRecord, test: str | None = None):
    """The learnt-at-C verdict of test set ``test`` (None: the reference test,
    :func:`posbench.evaluation.tasks.learnt_at_c`; else
    :func:`posbench.evaluation.tasks.learnt_on_test`)."""
    task = run.results["task"]
    return learnt_at_c(task, run.train_context) if test is None else learnt_on_test(task, run.train_context, test)


def learnt(run: RunRecord, test: str | None = None) -> bool:
    """Whether the run learnt its task at C on test set ``test`` (None: the reference test)."""
    return gate(run, test)["learnt"]


def not_learnt_note(run: RunRecord, test: str | None = None) -> str:
    """``s2 (0.868 < 0.9)``: a seed left out of the averages, with its accuracy at C on ``test``."""
    verdict = gate(run, test)
    value = f"no {verdict['test_set']} test at C" if verdict["value"] is None else f"{verdict['value']:.3f}"
    return f"s{run.seed} ({value} < {verdict['threshold']:g})"


def interval(runs: Sequence[RunRecord], metric: str, length: int, bucket: str | None = None,
             test: str = STANDARD, by: str = "by_position") -> Interval | None:
    """A group's ``metric`` at ``length`` on test set ``test`` (overall, or in the band
    ``bucket`` of ``by``: ``by_position``, ``by_lookback``, ...): a t-interval over its runs'
    means, or for one run the entry's own bootstrap over its sequences."""
    blocks = []
    for run in runs:
        entry = plain_entries(run, metric, test).get(length)
        block = None if entry is None else (entry[metric] if bucket is None else entry.get(by, {}).get(bucket))
        if block is None or block.get("mean") is None:
            return None
        blocks.append(block)
    if not blocks:
        return None
    if len(blocks) == 1:  # the same bootstrap_interval over the same sequences that the run stored
        one = blocks[0]
        return Interval(one["mean"], one["low"], one["high"], one["n"], one["kind"])
    return across_runs([float(block["mean"]) for block in blocks])


def metrics_of(task: TaskRecord) -> list[str]:
    """The metrics a task record holds (``accuracy``, plus ``exact_match`` where a sequence is one answer)."""
    return list(task.get("metrics", ["accuracy"]))


def axes_of(task: TaskRecord) -> dict[str, str]:
    """The answer axes a task's tables report, name -> its name in tasks.md: the task's ``AXES``;
    for a task this posbench does not know, every axis its entries hold (``by_<name>`` beside a
    ``<name>`` summary)."""
    cls = task_class(task.get("name", ""))
    if cls is not None:
        return dict(cls.AXES)
    held = [key[3:] for e in task.get("entries", []) for key in e
            if key.startswith("by_") and key != "by_position" and isinstance(e.get(key[3:]), dict)]
    return {name: name.replace("_", " ") for name in dict.fromkeys(held)}


def unscored_reason(run: RunRecord) -> str | None:
    """Why a task run cannot be shown (NaN accuracies), or None."""
    bad = sorted({f"{test_set(e)} L={e['length']}" for e in run.results["task"].get("entries", [])
                  for metric in metrics_of(run.results["task"])
                  if isinstance((e.get(metric) or {}).get("mean"), float) and math.isnan(e[metric]["mean"])})
    return f"its results.json holds NaN task accuracies ({', '.join(bad)})" if bad else None


@dataclass
class TaskTable:
    """One task's comparison: its groups (label -> runs, every seed), lengths, metrics, chance
    level and test sets. :meth:`learnt` and :meth:`not_learnt` split a group by the gate of a
    test set (None: the reference test)."""

    name: str
    label: str
    groups: dict[str, list[RunRecord]]
    lengths: list[int]
    metrics: list[str]
    chance: float
    context: int
    tests: list[str] = field(default_factory=lambda: [STANDARD])
    grid: bool = False
    """A grid task (``layout`` grid): lengths are square grids, shown by side ("8x8"), and
    ``by_position`` holds rings = max(row, col) (an image task's pooled answer has none)."""
    notes: dict[int, str] = field(default_factory=dict)
    """length -> what follows its name (an image task's size in pixels: ``14x14 (56 px)``)."""
    paired_tests: list[str] = field(default_factory=lambda: [STANDARD])
    """The test sets ``tasks_paired.md`` compares on (the task's ``PAIRED_TESTS``)."""
    test_notes: dict[str, str] = field(default_factory=dict)
    """Test set -> the line under its heading (the task's ``TEST_NOTES``)."""
    axes: dict[str, str] = field(default_factory=dict)
    """The answer axes reported, name -> its name in tasks.md (:func:`axes_of`)."""

    @property
    def bands(self) -> dict[str, str]:
        """The band breakdowns of an entry shown, ``by_position`` and ``by_<axis>``, and their names in tasks.md."""
        return {"by_position": "answer position", **{f"by_{name}": title for name, title in self.axes.items()}}

    def length_name(self, length: int) -> str:
        """``L=256 (1C)`` (``L=100``), or a grid's ``16x16`` (an image's ``14x14 (56 px)``)."""
        if self.grid:
            side = math.isqrt(length)
            return f"{side}x{side}{self.notes.get(length, '')}"
        return f"L={length} ({length // self.context}C)" if length % self.context == 0 else f"L={length}"

    def x(self, length: int) -> int:
        """Where a length is drawn: the length, or a grid's side."""
        return math.isqrt(length) if self.grid else length

    def learnt(self, label: str, test: str | None = None) -> list[RunRecord]:
        return [r for r in self.groups[label] if learnt(r, test)]

    def not_learnt(self, label: str, test: str | None = None) -> list[RunRecord]:
        return [r for r in self.groups[label] if not learnt(r, test)]

    def baselines(self, test: str, length: int) -> dict[str, float]:
        """The baselines stored with the test sequences (the same for every run), else chance."""
        for runs in self.groups.values():
            for run in runs:
                entry = plain_entries(run, "accuracy", test).get(length)
                if entry is not None and "baselines" in entry:
                    return {k: v for k, v in entry["baselines"].items() if v is not None}
        return {"chance": self.chance}

    def axis(self, test: str, length: int) -> tuple[str, AxisSummary] | None:
        """The test's answer axis (the first of :attr:`axes` stored) summary at ``length``, if stored."""
        for runs in self.groups.values():
            for run in runs:
                entry = plain_entries(run, "accuracy", test).get(length, {})
                for name in self.axes:
                    if isinstance(entry.get(name), dict):
                        return name, entry[name]
        return None


def task_tables(runs: Sequence[RunRecord]) -> list[TaskTable]:
    """The task runs of ``runs``, one table per task and options (in first-seen order)."""
    by_task: dict[str, list[RunRecord]] = {}
    for run in runs:
        if is_task_run(run):
            by_task.setdefault(task_label(run), []).append(run)
    tables = []
    for label, members in by_task.items():
        task = members[0].results["task"]
        lengths = sorted({int(e["length"]) for r in members for e in r.results["task"]["entries"]})
        tests = list(dict.fromkeys(test_set(e) for r in members for e in r.results["task"]["entries"]))
        groups = {g.label: g.runs for g in group_runs(members).values()}
        cls = task_class(task["name"])
        notes = {L: cls.length_note(L, task.get("options") or {}) for L in lengths} if cls is not None else {}
        paired = [t for t in (cls.PAIRED_TESTS if cls is not None else [STANDARD]) if t in tests]
        tables.append(TaskTable(task["name"], label, groups, lengths, metrics_of(task),
                                float(task.get("chance", 0.0)), min(r.train_context for r in members), tests,
                                grid=cls is not None and cls.layout == "grid", notes=notes, paired_tests=paired,
                                test_notes=dict(cls.TEST_NOTES) if cls is not None else {}, axes=axes_of(task)))
    return tables


def _cell(value: Interval | None) -> str:
    if value is None:
        return "-"
    if value.half_width is None:
        return f"{value.mean:.3f}"
    return f"{value.mean:.3f} ± {value.half_width:.3f}"


def _how(runs: Sequence[RunRecord]) -> str:
    return f"t over {len(runs)} seeds" if len(runs) > 1 else "bootstrap over sequences (1 seed)"


def _head(table: TaskTable) -> str:
    return " | ".join(table.length_name(L) for L in table.lengths)


def _baseline_rows(table: TaskTable, test: str) -> list[str]:
    """Chance and the shortcuts (and the window-C oracle) by length, then the answer axis."""
    names = list(dict.fromkeys(k for L in table.lengths for k in table.baselines(test, L)))
    rows = [f"| *baseline: {name}* | | " + " | ".join(
        f"{table.baselines(test, L)[name]:.3f}" if name in table.baselines(test, L) else "-" for L in table.lengths)
        + " | expected accuracy on these sequences | |" for name in names]
    axes = [table.axis(test, L) for L in table.lengths]
    if any(axes):
        name = next(a[0] for a in axes if a)
        cells = " | ".join("-" if a is None or a[1]["median"] is None else
                           f"{a[1]['median']:g} / {a[1]['p90']:g} / {a[1]['beyond_context']:.3f}" for a in axes)
        rows.append(f"| *{name}: median / p90 / share >= C* | | {cells} | tokens | |")
    return rows


def _not_learnt_rows(table: TaskTable, metric: str, test: str) -> list[str]:
    rows = []
    for label in table.groups:
        for run in table.not_learnt(label, test):
            cells = " | ".join(_cell(interval([run], metric, L, test=test)) for L in table.lengths)
            rows.append(f"| {label} s{run.seed} | {not_learnt_note(run, test)} | {cells} |")
    return rows


def _band_table(table: TaskTable, test: str, by: str, title: str) -> list[str]:
    """Accuracy by the bands of ``by`` at the longest length, learnt seeds only."""
    longest = table.lengths[-1]
    buckets = sorted({b for label in table.groups for r in table.learnt(label, test)
                      for b in plain_entries(r, "accuracy", test).get(longest, {}).get(by, {})},
                     key=lambda b: int(b.split("-")[0]))
    if not buckets:
        return []
    if table.grid and by == "by_position":
        title = "ring = max(row, col)"
    lines = [f"**accuracy by {title} at {table.length_name(longest).split(' ')[0]}** (learnt seeds)", "",
             "| method | " + " | ".join(buckets) + " |", "|---|" + "---:|" * len(buckets)]
    answers = {}
    for label in table.groups:
        if runs := table.learnt(label, test):
            lines.append(f"| {label} | " + " | ".join(_cell(interval(runs, "accuracy", longest, b, test, by))
                                                       for b in buckets) + " |")
            bands = plain_entries(runs[0], "accuracy", test).get(longest, {}).get(by, {})
            answers = answers or {b: bands[b].get("answers", "-") for b in bands}
    return lines + ["| *answers per run* | " + " | ".join(str(answers.get(b, "-")) for b in buckets) + " |", ""]


def tables_markdown(tables: Sequence[TaskTable]) -> str:
    """``tasks.md``: per task, test set and metric, mean ± 95 % half-width by length over the
    seeds that learnt the task at C on that test set, the baselines and answer axis beside them, the seeds that
    did not learn it one by one; then accuracy by answer position (and lookback or string
    length) at the longest length."""
    lines = ["# Synthetic tasks: accuracy on answer tokens by length", "",
             ("Mean over test sequences (each sequence's fraction of right answers) ± the 95 % half-width: "
              "t-interval over seeds, or a bootstrap over sequences for one seed (column `interval`). "
              "On each test set, only seeds that learnt it at C (accuracy at C on that test set >= "
              "task.learnt_at_c) are averaged; the others are listed apart as not learnt at C. See docs/tasks.md."), ""]
    for table in tables:
        c = table.context
        trained = f"{table.length_name(c)} = {c} cells" if table.grid else f"C = {c}"
        lines += [f"## {table.label}", "", f"Training context {trained}; chance {table.chance:.3f}.", ""]
        for test in table.tests:
            lines += [f"### test set `{test}`", "", table.test_notes.get(test, test) + ".", ""]
            for metric in table.metrics:
                lines += [f"**{metric}**", "", f"| method | seeds | {_head(table)} | interval | not learnt at C |",
                          "|---|---:|" + "---:|" * len(table.lengths) + "---|---|"]
                for label in table.groups:
                    runs, left_out = table.learnt(label, test), table.not_learnt(label, test)
                    cells = " | ".join(_cell(interval(runs, metric, L, test=test)) for L in table.lengths)
                    note = ", ".join(not_learnt_note(r, test) for r in left_out)
                    lines.append(f"| {label} | {len(runs)} | {cells} | {_how(runs) if runs else '-'} | {note} |")
                if metric == "accuracy":
                    lines += _baseline_rows(table, test)
                lines.append("")
                if not_learnt := _not_learnt_rows(table, metric, test):
                    lines += [f"not learnt at C ({metric}, each seed alone; no claim past C):", "",
                              f"| run | accuracy at C < threshold | {_head(table)} |",
                              "|---|---|" + "---:|" * len(table.lengths), *not_learnt, ""]
            for by, title in table.bands.items():
                lines += _band_table(table, test, by, title)
    return "\n".join(lines)


def tables_csv(tables: Sequence[TaskTable]) -> str:
    """``tasks.csv``: one row per (task, test set, group, metric, length, band or ``all``) over
    the seeds learnt on that test set (``not_learnt`` counts the seeds left out); ``options`` is the task's
    options as JSON, ``positions`` is ``all``, a position band or ``lookback:a-b``
    (``string_length:a-b``), and ``baselines`` (rows of accuracy over ``all``) the JSON of the
    baselines' expected accuracy on the same sequences."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["task", "options", "group", "seeds", "metric", "length", "positions", "mean", "low", "high", "n",
                     "interval", "test_set", "not_learnt", "baselines"])
    for table in tables:
        options = table.label.split(" ", 1)[1]
        for test in table.tests:
            for label in table.groups:
                runs, left_out = table.learnt(label, test), len(table.not_learnt(label, test))
                for metric in table.metrics:
                    for L in table.lengths:
                        entry = plain_entries(runs[0], metric, test).get(L, {}) if runs else {}
                        bands = [(None, "by_position")] + ([(b, by) for by in table.bands for b in entry.get(by, {})]
                                                           if metric == "accuracy" else [])
                        for bucket, by in bands:
                            value = interval(runs, metric, L, bucket, test, by)
                            if value is None:
                                continue
                            where = "all" if bucket is None else bucket if by == "by_position" else f"{by[3:]}:{bucket}"
                            bounds = ["" if v is None else f"{v:.6f}" for v in (value.low, value.high)]
                            baselines = (json.dumps({k: round(v, 6) for k, v in table.baselines(test, L).items()})
                                         if metric == "accuracy" and bucket is None else "")
                            writer.writerow([table.name, options, label, len(runs), metric, L, where,
                                             f"{value.mean:.6f}", *bounds, value.n, value.kind, test, left_out,
                                             baselines])
    return buffer.getvalue()


NOT_SHORTCUTS = ("chance", "window_C")
"""Baselines drawn apart: chance (its own line) and the window-C oracle; every other baseline a
task stores is a shortcut, drawn as the best shortcut line."""


def _baseline_lines(ax, table: TaskTable, test: str) -> None:
    """Chance (dotted), the best shortcut (dashed) and the window-C oracle (dash-dot), in grey."""
    ax.axhline(table.chance, color="grey", linestyle=":", linewidth=1, label="chance")
    values = [table.baselines(test, L) for L in table.lengths]
    best = [max((v[k] for k in v if k not in NOT_SHORTCUTS), default=None) for v in values]
    if any(b is not None for b in best):
        ax.plot([table.x(L) for L, b in zip(table.lengths, best, strict=True) if b is not None],
                [b for b in best if b is not None],
                color="grey", linestyle="--", linewidth=1, label="best shortcut")
    if all("window_C" in v for v in values):
        ax.plot([table.x(L) for L in table.lengths], [v["window_C"] for v in values], color="silver", linestyle="-.", linewidth=1,
                label="window-C oracle")


def _not_learnt_lines(ax, table: TaskTable, label: str, style: dict[str, Any], metric: str, test: str) -> None:
    """Each seed of ``label`` that did not learn its task at C, drawn alone (thin, dotted, crosses)
    and named with its accuracy at C against the gate, so that a run that did not learn still shows."""
    for run in table.not_learnt(label, test):
        points = [(L, e[metric]["mean"]) for L, e in sorted(plain_entries(run, metric, test).items())
                  if (e.get(metric) or {}).get("mean") is not None]
        if points:
            verdict = gate(run, test)
            value = f"no {verdict['test_set']} test at C" if verdict["value"] is None else f"{verdict['value']:.3f}"
            ax.plot([table.x(L) for L, _ in points], [v for _, v in points], color=style["color"], linestyle=":",
                    marker="x", markersize=5, linewidth=1.0, alpha=0.8,
                    label=f"{label} s{run.seed}: not learnt at C ({value} < {verdict['threshold']:g})")


def task_figure(table: TaskTable):
    """Accuracy (and exact match) against length per test set, one line per group over its
    learnt seeds, 95 % interval bars, the baselines in grey; each seed that did not learn its
    task at C drawn apart and marked so."""
    panels = [(test, metric) for test in table.tests for metric in table.metrics]
    fig = new_figure(5.0 * len(panels) + 3.0, 4.5)
    styles = line_styles(list(table.groups))
    for i, (test, metric) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        if not any(table.learnt(label, test) for label in table.groups):
            ax.text(0.5, 0.5, "no seed learnt this test set at C:\nno claim past C (tasks.md lists each seed)",
                    transform=ax.transAxes, ha="center", va="center", fontsize=8)
        for label in table.groups:
            runs = table.learnt(label, test)
            _not_learnt_lines(ax, table, label, styles[label], metric, test)
            points = [(L, interval(runs, metric, L, test=test)) for L in table.lengths] if runs else []
            points = [(L, v) for L, v in points if v is not None]
            if not points:
                continue
            x = np.array([table.x(L) for L, _ in points], dtype=float)
            y = np.array([v.mean for _, v in points])
            err = np.array([[v.mean - (v.low if v.low is not None else v.mean) for _, v in points],
                            [(v.high if v.high is not None else v.mean) - v.mean for _, v in points]])
            ax.errorbar(x, y, yerr=err, color=styles[label]["color"], marker=styles[label]["marker"] or "o",
                        markersize=4, capsize=3, linewidth=1.3, linestyle=styles[label]["linestyle"], label=label)
        if metric == "accuracy":
            _baseline_lines(ax, table, test)
        ax.axvline(table.x(table.context), color="black", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks([table.x(L) for L in table.lengths],
                      [table.length_name(L) if table.grid else str(L) for L in table.lengths])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("test grid side (dotted: training grid)" if table.grid else "test length L (dotted: training context)")
        ax.set_ylabel(metric.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.set_title(f"test set {test}: {metric} on answer tokens", fontsize=8)
    fig.suptitle(f"{task_title(table)}\nlines: on each test set the seeds that learnt it at C, 95 % intervals; "
                 "dotted with crosses: a seed that did not", fontsize=8)
    handles: dict[str, Any] = {}
    for ax in fig.axes:  # every group and baseline once (a test set no seed learnt draws no line of it)
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(name, handle)
    fig.axes[-1].legend(handles.values(), handles.keys(), fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return fig


def plot_task_runs(runs: Sequence[RunRecord], out: Path, formats: Sequence[str],
                   log: Callable[[str], Any]) -> list[Path]:
    """Figures and tables of the task runs among ``runs`` into ``out``; [] when there are none."""
    tables = task_tables(runs)
    if not tables:
        return []
    files: list[Path] = []
    for table in tables:
        stem = f"tasks_{table.name}"
        if sum(t.name == table.name for t in tables) > 1:  # the same task with other options
            stem += f"_{tables.index(table)}"
        files += save(task_figure(table), out, stem, formats)
    write_text_atomic(out / "tasks.md", tables_markdown(tables))
    write_text_atomic(out / "tasks.csv", tables_csv(tables))
    log(f"task tables for {sum(len(rs) for t in tables for rs in t.groups.values())} runs: {out / 'tasks.md'}")
    return files + [out / "tasks.md", out / "tasks.csv"]


__all__ = ["TaskTable", "gate", "interval", "is_task_run", "learnt", "plain_entries", "plot_task_runs", "unscored_reason",
           "tables_csv", "tables_markdown", "task_figure", "task_tables"]
