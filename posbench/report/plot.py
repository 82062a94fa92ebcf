"""Comparison figures and tables from saved runs, without retraining.

``plot_runs`` reads any set of runs (run dirs, sweep dirs, globs) and writes into ``out_dir``:

- ``train_loss.<fmt>``: training loss against tokens, one colour per method (seeds share it).
  Faint line = logged values; solid line = bias-corrected EMA with weight ``TRAIN_EMA`` (0.8) per
  logged step, lowered for runs under 100 logged points (see ``_ema``); dots = validation loss. The y-axis tops out just above the highest smoothed loss
  after the first 10% of logged steps, so the initial drop from ln(vocab) does not flatten the
  comparison (a later divergence stays visible).
- ``val_loss_<C>_<2C>.<fmt>``: the ``C-2C`` band measured at each validation step (the
  ``val_loss_<C>_<2C>`` key of metrics.jsonl) against training tokens, one line per group, mean
  over seeds with a 95 % t-interval band: seed 003's figure. Only when some run logged the key.
- ``loss_by_position.<fmt>``: per-position eval loss at the headline length (2 x train context,
  512 by default; the shortest evaluated length when 2C was not evaluated), mean over seeds with
  its pointwise 95 % t-interval across seeds as a band, dashed: the windowed (like-for-like)
  curve past the context, dotted vertical line at the training context. Curves are smoothed by a
  centred moving average of ``max(1, length // 64)`` positions (8 at length 512; windows shrink
  at the ends). The y-axis tops out a little above the highest in-context loss (95th percentile
  over positions 0..C-1), so methods that blow up past the context do not squash the others:
  when a curve goes above ``min + 1.5 x (that percentile - min)`` the axis is clipped there and
  the title names the methods that leave it. ``loss_by_position_<L>.<fmt>`` for every other
  evaluated length; ``_<split>`` is inserted for splits other than the headline one (validation
  when present).
- ``cost_by_position.<fmt>`` and ``cumulative_perplexity.<fmt>`` at the longest evaluated length:
  the extrapolation cost (full minus windowed loss) and P(l), with the same bands.
- ``band_<C>_<2C>.<fmt>`` (``band_256_512``): grouped bars per group of the ``0-C`` and
  ``C-2C`` band means, error bars = 95 % interval (t across seeds; one seed: bootstrap over
  sequences, widened by the between-seed sd pooled over the groups with seeds when there are any).
- ``bands.md`` / ``bands.csv``: one row per group (runs that differ only by seed; see
  :mod:`posbench.report.compare`), every band's mean and 95 % interval, the cost per band, PPL ratio,
  cumulative perplexity and effective length, sorted by the headline band; each band comes from
  the shortest evaluated length that contains it. ``bands.md`` also holds the paired differences
  on the headline band and lists missing/failed runs.
- ``paired.md`` / ``paired.csv``: A - B for every pair of groups, on every band past the context
  (loss and cost), with the paired 95 % interval and, over >= 2 common seeds, whether it excludes
  0; a pair with one common seed is marked ``1 seed`` and gets no verdict
  (:mod:`posbench.report.compare`).
- ``copy_retrieval_<kind>.<fmt>``, ``copy_sensitivity_<kind>.<fmt>``, ``copy.md`` / ``copy.csv``: the copy probe (posbench.report.probes),
  only when some run has ``probes`` entries; every registered probe's ``compare_figures`` hook likewise.
- ``tasks_<task>.<fmt>``, ``tasks.md`` / ``tasks.csv``: task runs (posbench.report.tasks).

Each kind of run (text, task; :mod:`posbench.report.kinds`) draws its own part; the figures
(:mod:`posbench.report.curves`) are those of text runs.

Groups are runs that differ only by seed (:func:`posbench.report.compare.run_facets`); failed, refused
and result-less runs are skipped (:func:`posbench.runs.run_record.finished_runs`). Curves of one run are
titled "one run per curve", never a mean over seeds. Colours: :func:`line_styles` (a method's
registry colour in every figure, 20 colours, markers from 11 curves on); legends sit outside the
axes. The band chart's y-axis starts near the bars when 0 would hide their differences.

Figures are drawn on ``matplotlib.figure.Figure`` objects rendered by Agg (no pyplot, no display,
no global backend switch) and every file is written atomically.
"""


from __future__ import annotations

import fnmatch
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from posbench.core.errors import PosbenchError, one_line
from posbench.report.curves import (  # the figures, importable from here as before
    TRAIN_EMA,
    band_figure,
    position_figure,
    train_loss_figure,
    training_extrapolation_figure,
    validation_subset,
)
from posbench.report.extension import run_extension_figures
from posbench.report.figures import FORMATS, check_formats, line_styles, save
from posbench.report.kinds import TextKind, by_kind, kind_of, split_unscored
from posbench.runs.results import RESULTS_FILE, read_results
from posbench.runs.run_record import RunRecord, discover_runs, finished_runs, read_metrics
from posbench.runs.rundir import RunDir
from posbench.runs.status import read_status


def plot_runs(
    patterns: Sequence[str | os.PathLike] | str | os.PathLike,
    out_dir: str | os.PathLike,
    formats: Sequence[str] = ("png",),
    log: Callable[[str], Any] = print,
    variant: str | None = None,
    methods: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Build every comparison figure and the band tables from saved runs.

    Args:
        patterns: run dirs, sweep dirs (searched recursively), results.json paths or globs.
        out_dir: where figures and tables go (created if needed).
        formats: any of ``png``, ``pdf``, ``svg``; each figure is written once per format.
        log: called with one line per skipped run and notes, and a final line naming ``out_dir``.
        variant: plot each run's entries of this ``eval_variants`` label (``RunRecord.variant``)
            instead of its own; a run without it is refused in one line.
        methods: draw only the runs of these methods (names or globs: ``[rope, alibi*]``); a name
            that matches no run is refused in one line. None: every method.

    Returns:
        ``{"out_dir", "files", "runs", "methods": {method: n_runs}, "headline_band", "problems"}``
        where ``problems`` lists ``(path, reason)`` for every failed, running, corrupt or missing
        run (they are skipped, not fatal).

    Raises:
        PosbenchError: no valid run at all, or an unsupported format.
    """
    formats = check_formats(formats)
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    patterns = [str(p) for p in patterns]
    runs, problems = finished_runs(*discover_runs(patterns))  # failed / refused / no results: never in a table
    runs = selected_methods(runs, methods, log)
    runs, unscored = split_unscored(runs)  # e.g. task runs with NaN accuracies
    problems = sorted(problems + unscored)
    for path, reason in problems:
        log(f"skipping {path}: {reason}")
    if not runs:
        raise PosbenchError(
            f"no finished runs found in {', '.join(patterns) or '(no paths given)'}: a run directory must "
            f"contain a valid {RESULTS_FILE} (written when `posbench train` finishes), with metrics.jsonl "
            "and status.json; pass run dirs, sweep dirs or globs"
        )
    if variant:
        lacking = [str(r.path) for r in runs if not any(v.get("variant") == variant
                                                        for v in r.results.get("eval_variants", []))]
        if lacking:
            raise PosbenchError(f"no eval_variants entries labelled {variant!r} in {', '.join(lacking)}; "
                                "drop variant= or use a label their results.json eval_variants holds")
        runs = [r.variant(variant) for r in runs]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Each kind of run draws its own figures and tables; the first kind present is the headline one.
    compared = [kind.compare(kind_runs, out, formats, log, problems) for kind, kind_runs in by_kind(runs).items()]
    files = [f for c in compared for f in c.files]
    first = compared[0]
    log(f"wrote {len(files)} files for {first.described} to {out}")
    return {
        "out_dir": str(out),
        "files": [str(f) for f in files],
        "runs": [str(r.path) for r in first.runs],
        "methods": first.methods,
        "headline_band": first.headline_band,
        "problems": list(problems),
    }


def plot_single_run(run_dir: str | os.PathLike, formats: Sequence[str] = ("png",)) -> list[Path]:
    """Per-run figures in ``<run_dir>/figures/``: ``train_loss`` and its kind's own figures
    (``loss_by_position[_<L>]``, a task's accuracy, a probe's ``run_figures``).

    Works on a run still in progress (training loss only). Returns the written paths.
    """
    formats = check_formats(formats)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PosbenchError(f"run directory {run_dir} does not exist")
    out = RunDir(run_dir).figures_dir
    try:
        full: RunRecord | None = RunRecord(path=run_dir, results=read_results(run_dir), status=read_status(run_dir))
    except (OSError, ValueError):
        full = None  # no (valid) results yet: plot what the metrics say
    run = None if full is None else full.plain()
    status = read_status(run_dir) or {}
    method = run.method if run else str(status.get("method") or run_dir.name)
    name = run.name if run else run_dir.name
    metrics = run.metrics if run else read_metrics(run_dir)
    written = save(train_loss_figure([(method, name, metrics)], f"Training loss: {name}"), out, "train_loss", formats)
    if run is not None:
        written += kind_of(run).run_figures(run, out, formats, title=f"{name}: ")
        if isinstance(kind_of(run), TextKind):  # and its extension curves, once posbench eval added them
            written += run_extension_figures(full, out, formats)
    return written


def selected_methods(runs: list[RunRecord], methods: Sequence[str] | str | None,
                     log: Callable[[str], Any]) -> list[RunRecord]:
    """The runs whose method matches one of ``methods`` (names or globs); all when None or empty."""
    if not methods:
        return runs
    patterns = [methods] if isinstance(methods, str) else [str(m) for m in methods]
    present = sorted({r.method for r in runs})
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(m, p) for m in present)]
    if unmatched:
        raise PosbenchError(f"methods={','.join(unmatched)} matches no run here; the runs' methods are "
                            f"{', '.join(present) or 'none'}")
    kept = [r for r in runs if any(fnmatch.fnmatchcase(r.method, p) for p in patterns)]
    log(f"methods={','.join(patterns)}: {len(kept)} of {len(runs)} runs")
    return kept


def write_run_figures(run_dir: Path, log: Callable[[str], None]) -> list[Path]:
    """:func:`plot_single_run`, never raising: figures must never cost a finished run its results."""
    try:
        written = plot_single_run(run_dir)
        return [Path(p) for p in (written or [])]
    except Exception as err:  # figures must never cost a finished run its results
        log(f"warning: could not draw the run's figures: {one_line(err)}")
        return []


__all__ = ["FORMATS", "TRAIN_EMA", "band_figure", "line_styles", "plot_runs", "plot_single_run", "position_figure",
           "train_loss_figure", "training_extrapolation_figure", "validation_subset", "write_run_figures"]
