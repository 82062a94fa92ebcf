"""``posbench runs <folder>``: the runs and sweeps under a folder and the state of each, read from
the records a run directory keeps (:mod:`posbench.runs.rundir`); nothing is written or locked.

    running      status.json says running and its process (.posbench.pid) is alive: the step it
                 has logged (metrics.jsonl) of the steps it will train
    stopped      stopped by a signal or trainer.stop_after_steps (status interrupted), or its
                 process is gone while status.json still says running (killed, or the machine
                 went down): the step of its newest checkpoint, which a resume continues from
    failed       status failed, with the recorded reason
    finished     status completed: its headline (the C-2C band of its plain model, 256-512 at
                 C 256), or a task run's accuracy at C and whether it learnt its task
    refused      a later start was refused beside the run's record (refused.json), noted
    unknown      a run directory without a readable status.json

A sweep is a folder with Hydra's ``multirun.yaml``; its runs are listed under it. The PID check
is on this machine: a run started on another machine that shares the folder reads as stopped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posbench.core.errors import PosbenchError
from posbench.runs.checkpoint import list_checkpoints
from posbench.runs.entries import headline_entries
from posbench.runs.results import RESULTS_FILE, read_results
from posbench.runs.run_record import _run_dirs_under, read_config, read_metrics
from posbench.runs.rundir import RunLock
from posbench.runs.status import read_refusal, read_status

SWEEP_FILE = "multirun.yaml"  # Hydra writes it at the top of every sweep


@dataclass
class RunState:
    """One run directory as its records describe it."""

    path: Path
    state: str
    """running | stopped | failed | finished | unknown"""
    detail: str
    """What a reader needs: the step, the reason, the headline."""
    step: int | None = None
    headline: float | None = None


@dataclass
class Listing:
    """The runs under ``root``: those of each sweep, and those in no sweep."""

    root: Path
    sweeps: dict[Path, list[RunState]] = field(default_factory=dict)
    runs: list[RunState] = field(default_factory=list)

    def all(self) -> list[RunState]:
        return [r for runs in self.sweeps.values() for r in runs] + self.runs

    def text(self) -> str:
        """The listing as printed: a line per run, grouped by sweep, and a count of each state."""
        if not self.all():
            return f"no runs under {self.root} (no status.json, results.json or config.yaml found)\n"
        lines: list[str] = []
        for sweep, runs in self.sweeps.items():
            lines.append(f"sweep {_shown(sweep, self.root)}: {len(runs)} run(s), {_counts(runs)}")
            lines += [f"  {_shown(r.path, sweep):<28} {r.state:<9} {r.detail}" for r in runs]
        if self.runs:
            if self.sweeps:
                lines.append("runs in no sweep:")
            lines += [f"  {_shown(r.path, self.root):<28} {r.state:<9} {r.detail}" for r in self.runs]
        lines.append(f"{len(self.all())} run(s) under {self.root}: {_counts(self.all())}")
        return "\n".join(lines) + "\n"


def list_runs(folder: str | os.PathLike) -> Listing:
    """Every run directory at or below ``folder``, with its state."""
    root = Path(str(folder)).expanduser()
    if not root.is_dir():
        raise PosbenchError(f"dir={root} is not a folder; posbench runs <folder with runs or sweeps>")
    listing = Listing(root)
    for run_dir in _run_dirs_under(root):
        state = run_state(run_dir)
        sweep = next((p for p in [run_dir, *run_dir.parents] if (p / SWEEP_FILE).is_file()), None)
        if sweep is not None and (sweep == root or root in sweep.parents):
            listing.sweeps.setdefault(sweep, []).append(state)
        else:
            listing.runs.append(state)
    return listing


def run_state(run_dir: Path) -> RunState:
    """The state of one run directory, from its records."""
    status = read_status(run_dir)
    config = read_config(run_dir)
    state = (status or {}).get("status")
    planned = ((config.get("trainer") or {}).get("max_steps"))
    of = f"/{planned}" if isinstance(planned, int) else ""
    refused = read_refusal(run_dir)
    note = f" (a later start was refused: {refused})" if refused else ""
    if state == "running" and _alive(run_dir):
        step = _logged_step(run_dir)
        at = "starting (no step logged yet)" if step is None else f"at step {step}{of}"
        return RunState(run_dir, "running", f"{at}, PID {_pid(run_dir)}{note}", step)
    if state in ("running", "interrupted"):
        step = _checkpoint_step(run_dir)
        why = "stopped" if state == "interrupted" else "its process is gone (killed?)"
        where = "no checkpoint: a rerun starts over" if step is None else \
            f"continue: posbench train ... trainer.resume={run_dir}"
        at = "before its first checkpoint" if step is None else f"at step {step}{of}"
        return RunState(run_dir, "stopped", f"{at}, {why}; {where}{note}", step)
    if state == "failed":
        return RunState(run_dir, "failed", f"{status.get('error') or 'no reason recorded'}{note}",
                        _checkpoint_step(run_dir))
    if state == "completed":
        return _finished(run_dir, note)
    if (run_dir / RESULTS_FILE).is_file():
        return _finished(run_dir, " (no status.json)" + note)
    return RunState(run_dir, "unknown", "no readable status.json (crashed before starting, or not a posbench run)"
                    + note)


def _finished(run_dir: Path, note: str) -> RunState:
    try:
        results = read_results(run_dir / RESULTS_FILE)
    except (OSError, ValueError) as err:
        return RunState(run_dir, "failed", f"status completed, but results.json is unreadable: {err}{note}")
    steps = (results.get("train") or {}).get("steps")
    done = f"{steps} steps" if steps is not None else "finished"
    task = results.get("task")
    if task:
        return RunState(run_dir, "finished", f"{done}, task {task.get('name')}{_learnt(task)}{note}", steps)
    context = int(results.get("train_context") or 0)
    band = f"{context}-{2 * context}"
    value = next((float(e["bands"][band]) for e in headline_entries(results.get("eval", []))
                  if band in e.get("bands", {})), None)
    shown = f"{band} loss {value:.4f}" if value is not None else f"no {band} band evaluated"
    return RunState(run_dir, "finished", f"{done}, {shown}{note}", steps, value)


def _learnt(task: dict[str, Any]) -> str:
    verdict = task.get("learnt_at_c")
    if not isinstance(verdict, dict) or verdict.get("value") is None:
        return ""
    value, threshold = float(verdict["value"]), float(verdict["threshold"])
    at = f"accuracy at C {value:.3f}"
    return f", {at}" if verdict.get("learnt") else f", not learnt at C ({value:.3f} < {threshold:g})"


def _pid(run_dir: Path) -> int | None:
    try:
        return int((run_dir / RunLock.OWNER_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(run_dir: Path) -> bool:
    """Whether the process the run's PID file names runs on this machine."""
    pid = _pid(run_dir)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _logged_step(run_dir: Path) -> int | None:
    steps = [r["step"] for r in read_metrics(run_dir) if isinstance(r.get("step"), int)]
    return max(steps) if steps else None


def _checkpoint_step(run_dir: Path) -> int | None:
    steps = [int(m.group(1)) for p in list_checkpoints(run_dir) if (m := re.search(r"step_(\d+)", p.name))]
    return max(steps) if steps else None


def _counts(runs: list[RunState]) -> str:
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.state] = counts.get(r.state, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in counts.items())


def _shown(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base)) or "."
    except ValueError:
        return str(path)
