"""The report halves of the kinds of run (:mod:`posbench.runs.kinds`): text runs and task runs.

Each kind's report half is one object that owns its comparison (``posbench plot``'s figures and
tables), a run's own figures and its part of a sweep's ``summary.md``; :func:`kind_of` selects it
once from the run's record (results.json's ``kind``), so :mod:`posbench.report.plot` and
:mod:`posbench.commands.sweep` never branch on the kind. The training half of a kind is its
:class:`posbench.train.workload.Workload`. A new kind is a :class:`ReportKind` subclass attached
with :func:`posbench.runs.kinds.register_run_kind` (``report=``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from posbench.core.io import write_text_atomic
from posbench.evaluation.probes import PROBES
from posbench.report.compare import (
    Comparison,
    compare_runs,
    grouping_notes,
    paired_csv,
    paired_markdown,
    splits,
    summary_csv,
    summary_markdown,
)
from posbench.report.curves import (
    HEADLINE_SPLIT,
    band_figure,
    position_figures,
    train_loss_figure,
    training_extrapolation_figure,
    validation_subset,
)
from posbench.report.extension import plot_extensions
from posbench.report.figures import save
from posbench.report.task_pairs import task_pairs, task_pairs_markdown
from posbench.report.tasks import plot_task_runs, tables_markdown, task_figure, task_tables, unscored_reason
from posbench.runs.kinds import RUN_KINDS, TASK, TEXT, get_run_kind, register_run_kind, results_kind
from posbench.runs.run_record import RunRecord

Log = Callable[[str], Any]


@dataclass
class Compared:
    """What one kind's comparison wrote: its files, its runs, the groups' sizes and the headline band."""

    files: list[Path] = field(default_factory=list)
    runs: list[RunRecord] = field(default_factory=list)
    methods: dict[str, int] = field(default_factory=dict)
    headline_band: str | None = None
    described: str = ""
    """``<n> runs (<g> groups)``: the end of the log line naming the output folder."""


class ReportKind:
    """The report half of one kind of run. ``reads_text``: its runs have text for ``posbench viz``'s pictures."""

    reads_text = False

    def unscored(self, run: RunRecord) -> str | None:
        """Why ``run`` cannot be shown in a comparison, or None."""
        return None

    def compare(self, runs: Sequence[RunRecord], out: Path, formats: Sequence[str], log: Log,
                problems: Sequence[tuple[str, str]]) -> Compared:
        """The comparison figures and tables of ``runs`` (all of this kind) into ``out``."""
        raise NotImplementedError

    def run_figures(self, run: RunRecord, out: Path, formats: Sequence[str], title: str) -> list[Path]:
        """A finished run's own figures, beside its training loss (``title`` prefixes their titles)."""
        return []

    def summary(self, runs: Sequence[RunRecord]) -> tuple[dict[str, str], list[str]]:
        """A sweep's summary.md part for ``runs``: (run path -> its group in the job table, lines)."""
        return {}, []


def probe_figure_hooks(hook: str) -> list[Callable[..., list[Path]]]:
    """The registered probes' figure functions called ``hook`` (``compare_figures``, ``run_figures``),
    from the report module each probe names (:class:`posbench.evaluation.probes.Probe` ``report``)."""
    found = []
    for probe in PROBES.values():
        function = getattr(importlib.import_module(probe.report), hook, None) if probe.report else None
        if function is not None:
            found.append(function)
    return found


def _bands_markdown(comparison: Comparison, problems: Sequence[tuple[str, str]]) -> str:
    lines = ["# Loss by position band", "",
             summary_markdown(comparison.metrics, comparison.rows, comparison.split, comparison.headline),
             f"## Paired differences on {comparison.headline} (all bands: paired.md)", "",
             paired_markdown(comparison.headline_pairs),
             f"## Missing or failed runs ({len(problems)})", ""]
    lines += [f"- `{path}`: {reason}" for path, reason in problems] or ["None."]
    return "\n".join(lines) + "\n"


class TextKind(ReportKind):
    """A run on text: loss by position, bands and costs, extensions and probes."""

    reads_text = True

    def compare(self, runs: Sequence[RunRecord], out: Path, formats: Sequence[str], log: Log,
                problems: Sequence[tuple[str, str]]) -> Compared:
        extension_files = plot_extensions(runs, out, formats, (splits(runs) or [HEADLINE_SPLIT])[0], log)
        probe_runs = runs  # with their extension entries: a probe entry per extension
        runs = [r.plain() for r in runs]  # the method comparison reads the plain model's entries
        comparison = compare_runs(runs)
        groups = {label: g.runs for label, g in comparison.groups.items()}
        for note in grouping_notes(comparison.groups):
            log(note)
        context = comparison.context
        if len({r.train_context for r in runs}) > 1:
            log(f"note: runs have different training contexts; bands are named after each run's own context, "
                f"the headline uses {context}")
        inner, headline, split = f"0-{context}", comparison.headline, comparison.split
        files: list[Path] = []
        series = [(label, r.name, r.metrics) for label, rs in groups.items() for r in rs]
        files += save(train_loss_figure(series, "Training loss"), out, "train_loss", formats)
        key = f"val_loss_{context}_{2 * context}"
        if any(key in record for rs in groups.values() for r in rs for record in r.metrics):
            figure = training_extrapolation_figure({label: [r.metrics for r in rs] for label, rs in groups.items()},
                                                    key, f"Loss on positions {headline} during training ({key}, "
                                                    f"{validation_subset(runs, key)})")
            files += save(figure, out, key, formats)
        files += position_figures(groups, out, formats)
        title = f"Loss in and past the training context ({split})"
        files += save(band_figure(comparison.rows, inner, headline, title), out, f"band_{context}_{2 * context}",
                      formats)
        write_text_atomic(out / "bands.md", _bands_markdown(comparison, problems))
        write_text_atomic(out / "bands.csv", summary_csv(comparison.metrics, comparison.rows, comparison.groups))
        write_text_atomic(out / "paired.md", "# Paired differences between methods\n\n" + paired_markdown(comparison.pairs))
        write_text_atomic(out / "paired.csv", paired_csv(comparison.pairs))
        files += [out / "bands.md", out / "bands.csv", out / "paired.md", out / "paired.csv"] + extension_files
        for figures in probe_figure_hooks("compare_figures"):  # copy_retrieval_*, copy.md/csv, ...
            files += figures(probe_runs, out, formats, log)
        return Compared(files, runs, {label: len(rs) for label, rs in groups.items()}, headline,
                        f"{len(runs)} runs ({len(groups)} groups)")

    def run_figures(self, run: RunRecord, out: Path, formats: Sequence[str], title: str) -> list[Path]:
        written = position_figures({run.method: [run]}, out, formats, title_prefix=title)
        for figures in probe_figure_hooks("run_figures"):  # passkey[_<extension>], ...
            written += figures(run.results, out, formats, title=title)
        return written

    def summary(self, runs: Sequence[RunRecord]) -> tuple[dict[str, str], list[str]]:
        comparison = compare_runs(runs)
        group_of = {str(r.path): label for label, g in comparison.groups.items() for r in g.runs}
        notes = grouping_notes(comparison.groups)
        lines = ["", f"## Per method ({comparison.split} split)", ""]
        lines += [f"- {note.removeprefix('note: ')}" for note in notes] + ([""] if notes else [])
        lines += [summary_markdown(comparison.metrics, comparison.rows, comparison.split, comparison.headline),
                  f"## Paired differences on {comparison.headline}", "", paired_markdown(comparison.headline_pairs),
                  "Comparison figures and all tables: `comparison/` (`bands.md`, `paired.md`, `*.csv`)."]
        return group_of, lines


class TaskKind(ReportKind):
    """A synthetic task run (docs/tasks.md): accuracy on the answers by length, beside its baselines."""

    def unscored(self, run: RunRecord) -> str | None:
        return unscored_reason(run)  # NaN accuracies

    def compare(self, runs: Sequence[RunRecord], out: Path, formats: Sequence[str], log: Log,
                problems: Sequence[tuple[str, str]]) -> Compared:
        files = plot_task_runs(runs, out, formats, log)
        if files:  # and the paired differences between methods, by seed
            write_text_atomic(out / "tasks_paired.md", task_pairs_markdown(task_pairs(task_tables(runs))))
            files.append(out / "tasks_paired.md")
        return Compared(files, list(runs), {}, None, f"{len(runs)} task runs")

    def run_figures(self, run: RunRecord, out: Path, formats: Sequence[str], title: str) -> list[Path]:
        written: list[Path] = []
        for table in task_tables([run]):  # its accuracy against length
            written += save(task_figure(table), out, f"task_{table.name}", formats)
        return written

    def summary(self, runs: Sequence[RunRecord]) -> tuple[dict[str, str], list[str]]:
        group_of = {str(r.path): f"task {r.results['task']['name']}" for r in runs}
        return group_of, ["", tables_markdown(task_tables(runs)).replace("# Synthetic", "## Synthetic", 1)
                          .replace("\n## ", "\n### "),
                          "Figures and tables: `comparison/` (`tasks_<task>.png`, `tasks.md`, `tasks.csv`)."]


register_run_kind(TEXT, report=TextKind())
register_run_kind(TASK, report=TaskKind())


def kind_of(run: RunRecord) -> ReportKind:
    """The report half of ``run``'s kind (its results.json's ``kind``; :func:`posbench.runs.kinds.results_kind`)."""
    return get_run_kind(results_kind(run.results)).report


def by_kind(runs: Sequence[RunRecord]) -> dict[ReportKind, list[RunRecord]]:
    """``runs`` by the report half of their kind, in the registry's order; kinds without runs are left out."""
    found: dict[str, list[RunRecord]] = {}
    for run in runs:
        found.setdefault(results_kind(run.results), []).append(run)
    return {kind.report: found[name] for name, kind in RUN_KINDS.items() if name in found}


def split_unscored(runs: Sequence[RunRecord]) -> tuple[list[RunRecord], list[tuple[str, str]]]:
    """``runs`` without those their kind cannot show (:meth:`ReportKind.unscored`; a kind this
    posbench does not know or cannot report), and those as problems."""
    kept, dropped = [], []
    for run in runs:
        name = results_kind(run.results)
        known = RUN_KINDS.get(name)
        if known is None or known.report is None:
            dropped.append((str(run.path), f"a run of kind {name!r}, which this posbench cannot report "
                                           f"(known: {', '.join(k for k, v in RUN_KINDS.items() if v.report)})"))
            continue
        reason = known.report.unscored(run)
        if reason is None:
            kept.append(run)
        else:
            dropped.append((str(run.path), reason))
    return kept, dropped


__all__ = ["Compared", "ReportKind", "TaskKind", "TextKind", "by_kind", "kind_of", "probe_figure_hooks",
           "split_unscored"]
