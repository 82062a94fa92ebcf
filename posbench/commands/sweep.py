"""Hydra multirun callback: comparison plots and a summary once every job of a sweep is done.

Enable it in the Hydra config::

    hydra:
      callbacks:
        compare_plots:
          _target_: posbench.commands.sweep.ComparePlotsCallback
          formats: [png]
          viz: true          # posbench viz pictures + overview in comparison/viz

At the end of ``posbench train -m ...`` it writes ``<sweep dir>/summary.md`` (finished jobs with
their headline band, failed or missing jobs with the reason) and ``<sweep dir>/comparison/``
(everything :func:`posbench.report.plot.plot_runs` makes, and with ``viz`` the pictures and overview of
:func:`posbench.viz.command.viz_sweep` in ``comparison/viz/``). It never raises: a sweep's results must not
be lost because a plot failed, so errors become warnings in the log.

Note: Hydra's basic sweeper re-raises a job's exception after the batch and then skips
``on_multirun_end``; jobs should therefore record failures in status.json and return normally.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from posbench.config import config_names
from posbench.core.io import write_text_atomic
from posbench.core.paths import recorded_path
from posbench.runs.entries import headline_entries
from posbench.runs.results import RESULTS_FILE
from posbench.runs.run_record import RunRecord, discover_runs, finished_runs
from posbench.runs.status import STATUS_FILE

log = logging.getLogger(__name__)

# Failed or missing jobs found by the last on_multirun_end in this process (read by the CLI to
# exit non-zero after a sweep with failures; Hydra itself keeps going past failed jobs).
_last_sweep_failures = 0


# Overrides of the last sweep whose glob matched no option of its group (the sweep ran no job).
_last_sweep_empty_globs: list[str] = []


def failed_jobs_of_last_sweep() -> int:
    """Number of failed/missing jobs of the last sweep that ended in this process (0 if none ran)."""
    return _last_sweep_failures


def empty_globs_of_last_sweep() -> list[str]:
    """Overrides like ``method=glob(xyz*)`` of the last sweep that matched nothing."""
    return list(_last_sweep_empty_globs)


def empty_globs(overrides: Sequence[str]) -> list[str]:
    """The ``group=glob(...)`` overrides that select no option of a posbench config group."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    parser = OverridesParser.create()
    empty = []
    for text in overrides:
        override = parser.parse_override(text)
        options = config_names(override.key_or_group)
        if isinstance(override.value(), Glob) and options and not override.value().filter(options):
            empty.append(text)
    return empty


def resumed_elsewhere(job_dir: Path) -> Path | None:
    """The run a sweep job continued with ``trainer.resume=<run dir>`` outside its own
    directory (sweeping ``trainer.resume``, one run per job), or None: such a job leaves only
    Hydra's record (``.hydra/``, its log) in its own directory."""
    from omegaconf import OmegaConf

    if (job_dir / STATUS_FILE).exists() or (job_dir / RESULTS_FILE).exists():
        return None
    try:
        target = OmegaConf.select(OmegaConf.load(job_dir / ".hydra" / "config.yaml"), "trainer.resume")
    except Exception:  # no readable record: the job stays a missing one
        return None
    if target is None or str(target).lower() in ("auto", "true", "false", "none", "null"):
        return None
    path = Path(str(target)).expanduser()
    return path if path.is_dir() and path.resolve() != job_dir.resolve() else None


def sweep_runs(sweep_dir: Path) -> tuple[list[RunRecord], list[tuple[str, str]]]:
    """The runs of a sweep's jobs (each job's directory, or the run it continued elsewhere with
    ``trainer.resume``) and its failed or missing jobs."""
    runs, problems = discover_runs([sweep_dir])
    # A sweep dir with no job dirs at all is a problem of the pattern, not a failed job.
    problems = [(p, r) for p, r in problems if Path(p) != sweep_dir]
    kept = []
    for path, reason in problems:
        target = resumed_elsewhere(Path(path))
        if target is None:
            kept.append((path, reason))
            continue
        found, missing = discover_runs([target])
        runs, kept = runs + found, kept + missing
    return finished_runs(runs, kept)


def _relative(path: str | os.PathLike, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(root.resolve())) or "."
    except ValueError:
        return str(path)


def sweep_summary(sweep_dir: str | os.PathLike, runs: Sequence[RunRecord], problems: Sequence[tuple[str, str]]) -> str:
    """Markdown: a sweep's finished jobs (with their group and headline band), failed/missing
    ones, then per group (runs that differ only by seed, see :func:`posbench.report.compare.run_facets`)
    the mean and 95 % interval of every band, the cost, cumulative perplexity and effective
    length, and the paired differences on the headline band."""
    runs, problems = finished_runs(runs, problems)  # idempotent: a failed run never enters the tables
    from posbench.report.kinds import by_kind  # here, not at import: it loads matplotlib, which a job never needs
    root = Path(sweep_dir)
    lines = [f"# Sweep summary: {recorded_path(root)}", "", f"## Finished ({len(runs)})", ""]
    # Each kind of run (text, task) writes its own part: (run -> its group, the part's lines).
    parts = [kind.summary(kind_runs) for kind, kind_runs in by_kind(runs).items()]
    group_of = {path: group for part_groups, _ in parts for path, group in part_groups.items()}
    if runs:
        lines += ["| job | method | seed | group | headline band | loss |", "|---|---|---|---|---|---:|"]
        for run in runs:
            band = f"{run.train_context}-{2 * run.train_context}"
            value = next((e["bands"][band] for e in sorted(headline_entries(run.results["eval"]), key=lambda e: e["length"])
                          if band in e["bands"]), None)
            shown = "-" if value is None else f"{value:.4f}"
            lines.append(f"| `{_relative(run.path, root)}` | {run.method} | {run.seed} | {group_of[str(run.path)]} | "
                         f"{band} | {shown} |")
    else:
        lines.append("None.")
    lines += ["", f"## Failed or missing ({len(problems)})", ""]
    lines += [f"- `{_relative(path, root)}`: {reason}" for path, reason in problems] or ["None."]
    for _, part in parts:
        lines += part
    return "\n".join(lines) + "\n"


class ComparePlotsCallback(Callback):
    """Writes ``summary.md`` and ``comparison/`` into the sweep dir when a multirun ends."""

    def __init__(self, formats: Sequence[str] = ("png",), out_subdir: str = "comparison", viz: bool = True,
                 methods: Sequence[str] | None = None) -> None:
        self.formats = tuple(formats)
        self.methods = list(methods) if methods else None  # the comparison's methods (plot's methods=)
        self.out_subdir = out_subdir
        self.viz = viz  # also draw posbench viz's pictures and overview into <comparison>/viz

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _last_sweep_failures, _last_sweep_empty_globs
        _last_sweep_failures = 0
        try:
            _last_sweep_empty_globs = empty_globs(list(config.hydra.overrides.task))
        except Exception as err:  # a callback must never break the sweep
            log.warning("could not check the sweep's glob overrides: %s", err)
        try:
            sweep_dir = Path(str(config.hydra.sweep.dir))
        except Exception as err:  # a callback must never break the sweep
            log.warning("comparison plots skipped: no hydra.sweep.dir in the config (%s)", err)
            return
        try:
            runs, problems = sweep_runs(sweep_dir)
            _last_sweep_failures = len(problems)
            write_text_atomic(sweep_dir / "summary.md", sweep_summary(sweep_dir, runs, problems))
            log.info("sweep summary: %d finished, %d failed or missing -> %s",
                     len(runs), len(problems), sweep_dir / "summary.md")
        except Exception as err:
            log.warning("could not write the sweep summary in %s: %s", sweep_dir, err)
            return
        if not runs:
            log.warning("no finished runs in %s; comparison plots skipped", sweep_dir)
            return
        try:
            from posbench.report.plot import plot_runs  # here: a broken plot import must not fail the sweep

            out_dir = sweep_dir / self.out_subdir
            plot_runs([str(sweep_dir)], out_dir=out_dir, formats=self.formats, log=log.debug, methods=self.methods)
            log.info("comparison plots for %d runs written to %s", len(runs), out_dir)
        except Exception as err:
            log.warning("comparison plots failed (the runs themselves are intact): %s", err)
        from posbench.report.kinds import kind_of

        if self.viz and any(kind_of(r).reads_text for r in runs):  # viz reads text; task runs have none
            try:
                from posbench.viz.command import viz_sweep_default  # here, as plot_runs above

                viz_sweep_default(sweep_dir, out_dir / "viz", self.formats, log=log.debug)
                log.info("viz pictures and overview written to %s", out_dir / "viz")
            except Exception as err:
                log.warning("viz pictures failed (the runs themselves are intact): %s", err)
