"""Task runs in comparisons: accuracy against length per method, with intervals, and tables.

``posbench plot`` (and a sweep's ``comparison/``) hands task runs here: runs are split by task
(name and options), grouped within a task as the loss tables group text runs
(:func:`posbench.compare.group_runs`: runs that differ only by seed), and each group's accuracy
at every length gets a 95 % interval: a t-interval over the seeds' means with >= 2 seeds, else a
bootstrap over the one run's sequences (:func:`posbench.stats.across_runs`).

Writes ``tasks_<task>.png`` (accuracy and, for copy, exact match against length), ``tasks.md``
and ``tasks.csv``.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from posbench.compare import group_runs
from posbench.extension import NONE
from posbench.figures import line_styles, new_figure, save
from posbench.io import write_text_atomic
from posbench.results import RunRecord
from posbench.stats import Interval, across_runs


def is_task_run(run: RunRecord) -> bool:
    return "task" in run.results


def task_label(run: RunRecord) -> str:
    """``name`` plus the options that set its data (``flipflop {p_ignore: 0.8, ...}``)."""
    task = run.results["task"]
    return f"{task['name']} {json.dumps(task.get('options', {}), sort_keys=True)}"


def plain_entries(run: RunRecord, metric: str) -> dict[int, dict[str, Any]]:
    """length -> the plain model's entry holding ``metric``."""
    return {int(e["length"]): e for e in run.results["task"]["entries"]
            if e.get("extension", NONE) == NONE and metric in e}


def interval(runs: Sequence[RunRecord], metric: str, length: int, bucket: str | None = None) -> Interval | None:
    """A group's ``metric`` at ``length`` (overall, or in position ``bucket``): a t-interval over
    its runs' means, or for one run the entry's own bootstrap over its sequences."""
    blocks = []
    for run in runs:
        entry = plain_entries(run, metric).get(length)
        block = None if entry is None else (entry[metric] if bucket is None else entry["by_position"].get(bucket))
        if block is None or block.get("mean") is None:
            return None
        blocks.append(block)
    if len(blocks) == 1:  # the same bootstrap_interval over the same sequences that the run stored
        one = blocks[0]
        return Interval(one["mean"], one["low"], one["high"], one["n"], one["kind"])
    return across_runs([float(block["mean"]) for block in blocks])


@dataclass
class TaskTable:
    """One task's comparison: its groups (label -> runs), lengths, metrics and chance level."""

    name: str
    label: str
    groups: dict[str, list[RunRecord]]
    lengths: list[int]
    metrics: list[str]
    chance: float
    context: int
    baselines: dict[str, dict[int, float]] = field(default_factory=dict)
    """MQAR: answering without the lookup (``chance``, ``in_context``, ``elimination``) -> length -> accuracy."""


def table_baselines(runs: Sequence[RunRecord]) -> dict[str, dict[int, float]]:
    """The baselines the runs' entries record (the same test sequences for every run of a task)."""
    found: dict[str, dict[int, float]] = {}
    for run in runs:
        for length, entry in plain_entries(run, "accuracy").items():
            for name, value in entry.get("baselines", {}).items():
                found.setdefault(name, {}).setdefault(length, float(value))
    return found


BASELINE_NOTE = ("Baselines: `chance` guesses among all values, `in_context` among the values in the sequence "
                 "(1/N), `elimination` among the values whose pairs have not appeared in the query region yet "
                 "(1/N when answers are labels only); a model above them reads the query key.")


def baseline_rows(table: TaskTable, lengths: Sequence[int]) -> list[str]:
    """Markdown rows ``| baseline: <name> | - | values by length | ... |`` under a task's accuracy table."""
    return [f"| baseline: {name} | - | " + " | ".join(f"{by_length[L]:.3f}" if L in by_length else "-" for L in lengths)
            + " | on the test sequences |" for name, by_length in table.baselines.items()]


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
        groups = {g.label: g.runs for g in group_runs(members).values()}
        tables.append(TaskTable(task["name"], label, groups, lengths, list(task.get("metrics", ["accuracy"])),
                                float(task.get("chance", 0.0)), min(r.train_context for r in members),
                                table_baselines(members)))
    return tables


def _cell(value: Interval | None) -> str:
    if value is None:
        return "-"
    if value.half_width is None:
        return f"{value.mean:.3f}"
    return f"{value.mean:.3f} ± {value.half_width:.3f}"


def _how(runs: Sequence[RunRecord]) -> str:
    return f"t over {len(runs)} seeds" if len(runs) > 1 else "bootstrap over sequences (1 seed)"


def tables_markdown(tables: Sequence[TaskTable]) -> str:
    """``tasks.md``: per task and metric, mean ± 95 % half-width by length; then accuracy by
    answer position (buckets 0-C, C-2C, ...) at the longest length."""
    lines = ["# Synthetic tasks: accuracy on answer tokens by length", "",
             "Mean over test sequences (each sequence's fraction of right answers) ± the 95 % half-width: "
             "t-interval over seeds, or a bootstrap over sequences for one seed (column `interval`). "
             "See docs/tasks.md.", ""]
    for table in tables:
        c = table.context
        lines += [f"## {table.label}", "", f"Training context C = {c}; chance {table.chance:.3f}.", ""]
        for metric in table.metrics:
            head = " | ".join(f"L={L} ({L // c}C)" if L % c == 0 else f"L={L}" for L in table.lengths)
            lines += [f"**{metric}**", "", f"| method | seeds | {head} | interval |",
                      "|---|---:|" + "---:|" * len(table.lengths) + "---|"]
            for label, runs in table.groups.items():
                cells = " | ".join(_cell(interval(runs, metric, L)) for L in table.lengths)
                lines.append(f"| {label} | {len(runs)} | {cells} | {_how(runs)} |")
            if metric == "accuracy" and table.baselines:
                lines += baseline_rows(table, table.lengths) + ["", BASELINE_NOTE]
            lines.append("")
        longest = table.lengths[-1]
        buckets = sorted({b for runs in table.groups.values() for r in runs
                          for b in plain_entries(r, "accuracy").get(longest, {}).get("by_position", {})},
                         key=lambda b: int(b.split("-")[0]))
        lines += [f"**accuracy by answer position at L={longest}**", "",
                  "| method | " + " | ".join(buckets) + " |", "|---|" + "---:|" * len(buckets)]
        for label, runs in table.groups.items():
            lines.append(f"| {label} | " + " | ".join(_cell(interval(runs, "accuracy", longest, b)) for b in buckets) + " |")
        lines.append("")
    return "\n".join(lines)


def tables_csv(tables: Sequence[TaskTable]) -> str:
    """``tasks.csv``: one row per (task, group, metric, length, position bucket or ``all``);
    ``options`` is the task's options as JSON."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["task", "options", "group", "seeds", "metric", "length", "positions", "mean", "low", "high", "n",
                     "interval"])
    for table in tables:
        options = table.label.split(" ", 1)[1]
        for label, runs in table.groups.items():
            for metric in table.metrics:
                for L in table.lengths:
                    buckets = [None] + ([b for b in plain_entries(runs[0], metric).get(L, {}).get("by_position", {})]
                                        if metric == "accuracy" else [])
                    for bucket in buckets:
                        value = interval(runs, metric, L, bucket)
                        if value is None:
                            continue
                        bounds = ["" if v is None else f"{v:.6f}" for v in (value.low, value.high)]
                        writer.writerow([table.name, options, label, len(runs), metric, L, bucket or "all",
                                         f"{value.mean:.6f}", *bounds, value.n, value.kind])
        for name, by_length in table.baselines.items():  # MQAR: the accuracy of answering without the lookup
            for L, mean in sorted(by_length.items()):
                writer.writerow([table.name, options, f"baseline: {name}", 0, "accuracy", L, "all", f"{mean:.6f}",
                                 "", "", "", "baseline"])
    return buffer.getvalue()


def task_figure(table: TaskTable):
    """Accuracy (and exact match) against length, one line per group, 95 % interval bars."""
    fig = new_figure(5.0 * len(table.metrics) + 3.0, 4.5)
    styles = line_styles(list(table.groups))
    for i, metric in enumerate(table.metrics):
        ax = fig.add_subplot(1, len(table.metrics), i + 1)
        for label, runs in table.groups.items():
            points = [(L, interval(runs, metric, L)) for L in table.lengths]
            points = [(L, v) for L, v in points if v is not None]
            if not points:
                continue
            x = np.array([L for L, _ in points], dtype=float)
            y = np.array([v.mean for _, v in points])
            err = np.array([[v.mean - (v.low if v.low is not None else v.mean) for _, v in points],
                            [(v.high if v.high is not None else v.mean) - v.mean for _, v in points]])
            ax.errorbar(x, y, yerr=err, color=styles[label]["color"], marker=styles[label]["marker"] or "o",
                        markersize=4, capsize=3, linewidth=1.3, label=f"{label} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        if metric == "accuracy":
            ax.axhline(table.chance, color="grey", linestyle=":", linewidth=1, label="chance")
            for (name, by_length), dash in zip([(n, b) for n, b in table.baselines.items() if n != "chance"],
                                               ("--", "-.", (0, (1, 3)))):
                points = sorted(by_length.items())
                ax.plot([L for L, _ in points], [v for _, v in points], color="grey", linestyle=dash, linewidth=1,
                        label=f"baseline: {name}")
        ax.axvline(table.context, color="black", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(table.lengths, [str(L) for L in table.lengths])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("test length L (dotted: training context)")
        ax.set_ylabel(metric.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.set_title(f"{table.label}\n{metric} on answer tokens, 95 % intervals", fontsize=8)
    fig.axes[-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
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


__all__ = ["TaskTable", "is_task_run", "plot_task_runs", "tables_csv", "tables_markdown", "task_figure", "task_tables"]
