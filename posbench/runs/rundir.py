"""The run directory and every file a run writes into it, owned by one class: :class:`RunDir`.

    <run>/config.yaml      the resolved config (written when the run claims the directory)
         /status.json      running | completed | failed | interrupted (+ error, step)
         /refused.json     a refused start next to an earlier run's record (the record stays)
         /metrics.jsonl    one JSON object per logged step
         /checkpoints/     step_<N>.pt (+ .sha256), see :mod:`posbench.runs.checkpoint`
         /results.json     written (and merged by ``posbench eval``) under the results lock
         /figures/         per-run figures
         /.posbench.lock   one process at a time holds the directory (:class:`RunLock`)

File names are those of the readers (:mod:`posbench.runs.run_record`, `.results`, `.status`); nothing else writes a run
file by name.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock, Timeout
from omegaconf import DictConfig, OmegaConf

from posbench.core.errors import PosbenchError, one_line
from posbench.core.io import write_json_atomic, write_text_atomic
from posbench.runs.checkpoint import checkpoint_dir, list_checkpoints
from posbench.runs.results import RESULTS_FILE, quarantine, read_results, write_results
from posbench.runs.results_types import Results
from posbench.runs.run_record import CONFIG_FILE, METRICS_FILE, read_metrics
from posbench.runs.status import REFUSED_FILE, STATUS_FILE, read_status, write_status

RESULTS_LOCK = ".results.json.lock"  # held while results.json is read, merged and rewritten
FIGURES_DIR = "figures"


class RunLocked(PosbenchError):
    """Another process holds the run directory."""


class RunLock:
    """Exclusive lock on a run directory, so two trainings never write into one.

    filelock's lock is an flock(2) on ``.posbench.lock``: the kernel drops it when the holder
    exits in any way (kill -9 included), so a stale lock can never block. The holder's PID goes
    to a file of its own (the lock file is truncated by every process that tries to lock it).
    """

    LOCK_FILE, OWNER_FILE = ".posbench.lock", ".posbench.pid"

    def __init__(self, run_dir: Path, enabled: bool = True, otherwise: str = "or choose another hydra.run.dir") -> None:
        self.run_dir, self.enabled, self.lock = Path(run_dir), enabled, None
        self.otherwise = otherwise  # the refusal's way out for the command that asked (train, eval)

    def __enter__(self) -> RunLock:
        if not self.enabled or self.lock is not None:  # already held: ``with`` on a taken lock
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.run_dir / self.LOCK_FILE))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            try:
                holder = (self.run_dir / self.OWNER_FILE).read_text().strip() or "unknown"
            except OSError:
                holder = "unknown"
            raise RunLocked(
                f"{self.run_dir} is in use by another posbench process (PID {holder}); wait for it to end "
                f"or stop it, {self.otherwise}"
            ) from None
        self.lock = lock
        write_text_atomic(self.run_dir / self.OWNER_FILE, f"{os.getpid()}\n")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.lock is not None:
            (self.run_dir / self.OWNER_FILE).unlink(missing_ok=True)
            self.lock.release()
            self.lock = None


class RunDir:
    """One run directory: its lock, records, metrics, checkpoint folder and results."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._results_lock: FileLock | None = None

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def __str__(self) -> str:
        return str(self.path)

    # ------------------------------------------------------------------ paths

    @property
    def results_path(self) -> Path:
        return self.path / RESULTS_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return checkpoint_dir(self.path)

    @property
    def figures_dir(self) -> Path:
        return self.path / FIGURES_DIR

    def other_eval_path(self, data_name: str) -> Path:
        """``eval_<slug>.json``: an evaluation of the run on other text (never results.json)."""
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", data_name) or "data"
        return self.path / f"eval_{slug}.json"

    def checkpoints(self) -> list[Path]:
        return list_checkpoints(self.path)

    # ------------------------------------------------------------------ locks

    def lock(self, enabled: bool = True, otherwise: str = "or choose another hydra.run.dir") -> RunLock:
        """The exclusive lock of a training (or finishing) process on this directory;
        ``otherwise``: what the refusal suggests besides waiting."""
        return RunLock(self.path, enabled, otherwise)

    def results_lock(self) -> FileLock:
        """Held while results.json is written, or read, merged and rewritten (``posbench eval``).
        One lock per :class:`RunDir`, taken again by :meth:`write_results` inside it (re-entrant)."""
        if self._results_lock is None:
            self._results_lock = FileLock(str(self.path / RESULTS_LOCK))
        return self._results_lock

    # ------------------------------------------------------------------ records

    def claim(self, cfg: DictConfig, method: str, seed: int) -> None:
        """This run's config.yaml and status "running"; an earlier refusal is over."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.config_path, OmegaConf.to_yaml(cfg, resolve=True))
        self.write_status("running", method=method, seed=seed)
        self.clear_refusal()

    def write_status(self, status: str, error: str | None = None, **extra: Any) -> Path:
        return write_status(self.path, status, error=error, **extra)

    def clear_refusal(self) -> None:
        (self.path / REFUSED_FILE).unlink(missing_ok=True)

    def already_complete(self) -> bool:
        status = read_status(self.path) or {}
        return status.get("status") == "completed" and self.results_path.is_file()

    def record_failure(self, cfg: DictConfig, err: BaseException, claimed: bool) -> bool:
        """Record a failed job without destroying an earlier run's record.

        A run this process claimed, or a directory with no record yet, gets status "failed". A
        refused start next to an earlier run's record (a resume under another config, ...) leaves
        that record alone and writes refused.json, which the sweep summary counts as a failure.
        Best effort: on a full disk the one-line error matters more than the record. True when
        status.json now records this failure (the directory's record is this start's).
        """
        if isinstance(err, RunLocked) or not self.path.is_dir():
            return False
        method = cfg.get("method", {}).get("name") if isinstance(cfg.get("method"), DictConfig) else None
        earlier_record = any((self.path / name).exists() for name in (STATUS_FILE, RESULTS_FILE)) or bool(
            self.checkpoints())
        try:
            if claimed or not earlier_record:
                self.write_status("failed", method=method, seed=cfg.get("seed"), error=one_line(err))
                return True
            write_json_atomic(self.path / REFUSED_FILE, {
                "error": one_line(err), "method": method, "seed": cfg.get("seed"),
                "updated": datetime.now(timezone.utc).isoformat(timespec="seconds")})
        except OSError:
            pass
        return False

    def record_unstarted_failure(self, cfg: DictConfig, err: BaseException, hydra_record: Any = None) -> None:
        """:meth:`record_failure` for a start that failed before taking the lock: nothing is
        written into a run directory another process holds. ``hydra_record``: the CLI's
        :class:`posbench.runs.runlog.HydraRecord`, written beside a status.json of a directory that held
        no earlier run, else dropped (an earlier run's ``.hydra/`` and log stay as they were)."""
        if not self.path.is_dir():
            if hydra_record is not None:
                hydra_record.discard()
            return
        ours = False
        try:
            with self.lock():
                ours = self.record_failure(cfg, err, claimed=False)
                if ours and hydra_record is not None:
                    hydra_record.write(cfg)
        except (RunLocked, OSError):
            pass  # best effort, as record_failure: the one-line error matters more
        if not ours and hydra_record is not None:
            hydra_record.discard()

    def remove_stray_temp_files(self, log: Callable[[str], None]) -> None:
        """Delete ``.tmp-*`` files a kill left mid-write (atomic writes, checkpoints included).
        Called under the run's lock, so none of them can belong to a live writer."""
        stray = [p for folder in (self.path, self.checkpoint_dir) if folder.is_dir()
                 for p in folder.glob(".tmp-*") if p.is_file()]
        for path in stray:
            path.unlink(missing_ok=True)
        if stray:
            log(f"removed {len(stray)} unfinished temporary file(s) left by an interrupted write in {self.path}")

    # ------------------------------------------------------------------ metrics.jsonl

    def append_metrics(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def validation_logged(self, step: int) -> bool:
        """Whether ``metrics.jsonl`` already holds the validation row of ``step``."""
        return any(r.get("step") == step and "val_loss" in r for r in read_metrics(self.path))

    def truncate_metrics(self, step: int, log: Callable[[str], None]) -> None:
        """Drop metrics logged after ``step`` (a resumed run logs them again). A damaged file (a
        line that is not a JSON object, other than a last line cut by a kill) is quarantined and
        its good lines kept."""
        path = self.metrics_path
        if not path.exists():
            return
        lines = path.read_text(errors="replace").splitlines()
        keep, damaged = [], 0
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("step", 0), (int, float)):
                cut_by_a_kill = number == len(lines) and row is None  # expected, not damage
                damaged += not cut_by_a_kill
                continue
            if row.get("step", 0) <= step:
                keep.append(line)
        if damaged:
            quarantine(path, f"has {damaged} damaged line(s)", log, copy=True)
        write_text_atomic(path, "".join(f"{line}\n" for line in keep))

    # ------------------------------------------------------------------ results.json

    def read_results(self, log: Callable[[str], None]) -> Results | None:
        """results.json, or None when it is missing or damaged; a damaged one is reported in
        one line and left where it is (:meth:`write_results` sets it aside when it replaces it)."""
        try:
            return read_results(self.results_path)
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError) as err:  # json.JSONDecodeError is a ValueError
            log(f"{self.results_path} is damaged ({damage(err)}); the run's final checkpoint can recompute it")
            return None

    def write_results(self, results: Results, log: Callable[[str], None] | None = None) -> Path:
        """Validate and write results.json under the results lock (never between a
        ``posbench eval``'s read and write). A damaged results.json it replaces is first set
        aside as ``results.json.corrupt`` (kept for inspection)."""
        with self.results_lock():
            try:
                read_results(self.results_path)
            except FileNotFoundError:
                pass
            except (ValueError, UnicodeDecodeError) as err:
                quarantine(self.results_path, f"is damaged ({damage(err)})", log or (lambda _: None))
            return write_results(self.path, results)

    def write_other_eval(self, data_name: str, record: dict[str, Any]) -> Path:
        path = self.other_eval_path(data_name)
        write_json_atomic(path, record)
        return path


def damage(err: BaseException) -> str:
    """The first line of a parse error, short enough for a one-line message."""
    return str(err).splitlines()[0][:120] if str(err) else type(err).__name__


__all__ = ["FIGURES_DIR", "RESULTS_LOCK", "RunDir", "RunLock", "RunLocked"]
