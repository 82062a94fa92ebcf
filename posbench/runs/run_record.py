"""Runs as read back: :class:`RunRecord` (a run with a valid results.json), its metrics.jsonl and
config.yaml, and finding runs (:func:`discover_runs`, :func:`finished_runs`).

A run directory (docs/run-directory.md) holds ``config.yaml``, ``metrics.jsonl``, ``status.json``,
``results.json`` (only when completed), ``checkpoints/`` and ``figures/``. Everything here that
reads runs is tolerant: a crashed, running or corrupt run becomes a *problem* with a reason, never
an exception, so one bad run cannot hide the results of the others. results.json itself is
:mod:`posbench.runs.results`, its eval entries :mod:`posbench.runs.entries`, status.json
:mod:`posbench.runs.status`.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from posbench.config import method_option_names
from posbench.runs.entries import entry_extension, plain_entries
from posbench.runs.results import RESULTS_FILE, read_results
from posbench.runs.results_types import Results
from posbench.runs.status import STATUS_FILE, read_refusal, read_status

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
# Folders inside a run (or a Hydra job) that never contain runs themselves.
_SKIP_DIRS = {"checkpoints", "figures", "comparison", "wandb", "__pycache__"}

__all__ = ["CONFIG_FILE", "METRICS_FILE", "RunRecord", "discover_runs", "finished_runs", "read_config", "read_metrics",
           "recorded_precision"]


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``<run_dir>/metrics.jsonl`` ([] when absent).

    Unparseable lines are skipped: the last line of a killed run is often cut mid-write.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``<run_dir>/config.yaml`` as a dict ({} when missing or unreadable)."""
    import yaml

    try:
        config = yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def recorded_precision(results: Results, config: Any) -> str | None:
    """The precision a run trained and was evaluated in (``bf16``, ``fp32``): its results.json
    ``environment``, else its config's ``trainer.precision`` when that names one; None when
    unknown (``auto`` before posbench recorded what it resolved to)."""
    recorded = (results.get("environment") or {}).get("precision")
    if recorded:
        return str(recorded)
    configured = str((config.get("trainer") or {}).get("precision") or "auto")
    return configured if configured in ("fp32", "bf16") else None


@dataclass
class RunRecord:
    """A run with a valid results.json. ``metrics`` is read from metrics.jsonl on first use."""

    path: Path
    results: Results
    status: dict[str, Any] | None = None
    _metrics: list[dict[str, Any]] | None = field(default=None, repr=False)
    _config: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def method(self) -> str:
        return str(self.results["method"])

    @property
    def seed(self) -> Any:
        return self.results["seed"]

    @property
    def train_context(self) -> int:
        return int(self.results["train_context"])

    @property
    def method_options(self) -> dict[str, Any]:
        """The method options the run trained with: an option its results.json does not record
        takes the value it had before the option existed (the method's ``options_before``), not
        today's default. Only such a run's method module is imported to read that: a run that
        records every option of ``configs/method/<name>.yaml`` is read without it (or torch)."""
        recorded = dict(self.results.get("method_options") or {})
        shipped = method_option_names(self.method)
        if shipped is not None and shipped <= set(recorded):
            return recorded
        from posbench.methods import saved_options

        return saved_options(self.method, recorded)

    def plain(self) -> RunRecord:
        """The same run with only its plain eval entries (what the method comparisons read)."""
        results = {**self.results, "eval": plain_entries(self.results["eval"])}
        return RunRecord(self.path, results, self.status, self._metrics, self._config)

    @property
    def config(self) -> dict[str, Any]:
        """The run's resolved ``config.yaml`` ({} when absent or unreadable)."""
        if self._config is None:
            self._config = read_config(self.path)
        return self._config

    @property
    def precision(self) -> str:
        """The precision the run trained in (``bf16``, ``fp32``), or ``unknown`` for results.json
        files from before posbench recorded it (``environment``) under ``trainer.precision=auto``."""
        return recorded_precision(self.results, self.config) or "unknown"

    def variant(self, label: str) -> RunRecord:
        """The run as measured under ``label`` (an ``eval_variants`` label, e.g. ``num_sequences=64``,
        see :func:`merge_eval_entries`): those entries, plus the run's own at lengths the variant
        lacks (which ``posbench eval`` measured the same way, having nothing to compare them with).
        Raises ``KeyError`` when the run has no entry of that label."""
        chosen = [e for e in self.results.get("eval_variants", []) if e.get("variant") == label]
        if not chosen:
            raise KeyError(label)
        covered = {(e["split"], e["length"]) for e in chosen}
        own = [e for e in self.results["eval"] if (e["split"], e["length"]) not in covered]
        results = {**self.results, "eval": sorted(own + chosen, key=lambda e: (e["split"] != "validation", e["length"],
                                                                               entry_extension(e) != "none"))}
        return RunRecord(self.path, results, self.status, self._metrics)

    @property
    def name(self) -> str:
        return str(self.results.get("run_name") or self.path.name)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        if self._metrics is None:
            self._metrics = read_metrics(self.path)
        return self._metrics


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _markers(directory: Path) -> tuple[bool, bool]:
    """(strong, weak): strong = results/status file; weak = config/metrics or a Hydra job dir."""
    strong = (directory / RESULTS_FILE).is_file() or (directory / STATUS_FILE).is_file()
    weak = (
        (directory / CONFIG_FILE).is_file()
        or (directory / METRICS_FILE).is_file()
        or (directory / ".hydra" / "config.yaml").is_file()
    )
    return strong, weak


def _run_dirs_under(root: Path) -> list[Path]:
    """Run directories at or below ``root`` (hidden folders and run sub-folders are skipped)."""
    strong_dirs, weak_dirs = [], []
    for current, subdirs, _files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d not in _SKIP_DIRS)
        here = Path(current)
        strong, weak = _markers(here)
        if strong:
            strong_dirs.append(here)
            subdirs[:] = []  # a run does not contain other runs
        elif weak:
            weak_dirs.append(here)
    # A dir with only weak markers (e.g. a Hydra job dir) that contains a real run is not a run.
    strong_set = set(strong_dirs)
    weak_dirs = [w for w in weak_dirs if not any(w in s.parents for s in strong_set)]
    return sorted(strong_dirs + weak_dirs)


def _problem_reason(run_dir: Path) -> str:
    status = read_status(run_dir)
    if status is None:
        if (run_dir / STATUS_FILE).exists():
            return "no results.json and unreadable status.json"
        return "no results.json (still running, or crashed before writing status.json?)"
    state = status.get("status")
    if state == "failed":
        return f"failed: {status.get('error') or 'no error message recorded'}"
    if state == "interrupted":
        return f"interrupted: {status.get('error') or 'stopped early'} (resume with trainer.resume=<this run dir>)"
    if state == "completed":
        return "status says completed but results.json is missing"
    return "no results.json (still running?)"


def discover_runs(patterns: Iterable[str | os.PathLike]) -> tuple[list[RunRecord], list[tuple[str, str]]]:
    """Find runs from run dirs, sweep dirs (searched recursively), results.json files or globs.

    Returns ``(ok, problems)``: ``ok`` holds a :class:`RunRecord` per valid results.json (sorted
    by path); ``problems`` a ``(path, reason)`` per run directory without a usable results.json
    (failed, running, corrupt) and per pattern that matched nothing. Never raises for bad runs.
    """
    problems: list[tuple[str, str]] = []
    run_dirs: list[Path] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        matches = sorted(glob.glob(pattern, recursive=True)) if _is_glob(pattern) else [pattern]
        matches = [m for m in matches if os.path.exists(m)]
        if not matches:
            problems.append((pattern, "no such file or directory"))
            continue
        found = []
        for match in map(Path, matches):
            if match.is_file():
                if match.name == RESULTS_FILE:
                    found.append(match.parent)
            else:
                found.extend(_run_dirs_under(match))
        if not found:
            problems.append((pattern, "no run directories found (no results.json, status.json or config.yaml)"))
        run_dirs.extend(found)

    ok: list[RunRecord] = []
    seen: set[Path] = set()
    for run_dir in run_dirs:
        key = run_dir.resolve()
        if key in seen:
            continue
        seen.add(key)
        results_path = run_dir / RESULTS_FILE
        status = read_status(run_dir)
        state = (status or {}).get("status")
        if not results_path.exists():
            problems.append((str(run_dir), _problem_reason(run_dir)))
            continue
        if state in ("running", "failed", "interrupted"):
            # A results.json beside such a status is from an earlier finish (the run is being
            # continued, or a later attempt failed): it does not describe the run as it is now.
            reason = "status.json says running (being continued, or killed)" if state == "running" else _problem_reason(run_dir)
            problems.append((str(run_dir), f"{reason}; its results.json is from an earlier finish"))
            continue
        try:
            results = read_results(results_path)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            problems.append((str(run_dir), f"corrupt results.json: {err}"))
        except ValueError as err:
            problems.append((str(run_dir), f"invalid results.json: {err}"))
        except OSError as err:
            problems.append((str(run_dir), f"unreadable results.json: {err}"))
        else:
            ok.append(RunRecord(path=run_dir, results=results, status=status))
    ok.sort(key=lambda r: str(r.path))
    return ok, problems


def finished_runs(runs: Iterable[RunRecord], problems: Iterable[tuple[str, str]]
                  ) -> tuple[list[RunRecord], list[tuple[str, str]]]:
    """The runs a comparison may show, and the rest as problems (sorted). Left out, beside what
    :func:`discover_runs` already leaves out (failed, running, interrupted, corrupt): a run whose
    last start was refused (its results.json is an earlier run's; see ``REFUSED_FILE``) and a
    results.json with no evaluation of the plain model (no final results)."""
    kept, dropped = [], []
    for run in runs:
        if (why := read_refusal(run.path)) is not None:
            dropped.append((str(run.path), f"refused (its earlier results are kept): {why}"))
        elif not plain_entries(run.results["eval"]) and not (run.results.get("task") or {}).get("entries"):
            dropped.append((str(run.path), "no final results: its results.json holds no evaluation of the model"))
        else:
            kept.append(run)
    problems = [(path, f"refused: {why}" if (why := read_refusal(path)) else reason) for path, reason in problems]
    return kept, sorted(problems + dropped)
