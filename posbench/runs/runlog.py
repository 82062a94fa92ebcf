"""What ``posbench train`` leaves in a run directory besides the run itself: Hydra's record
(``.hydra/``) and the log file (``train.log``), written only by the process that holds the run.

Hydra writes both into the job's output directory before the task starts, so a second train
started into a running (or finished) run directory used to rewrite that run's ``.hydra/`` and
append to its log before posbench's lock refused it. ``configs/train.yaml`` therefore sets
``hydra.output_subdir: null`` and logs through :class:`DeferredFileHandler`, and posbench writes
both itself once the run's lock is held (:meth:`HydraRecord.write`). A start refused by the lock
drops them (:meth:`HydraRecord.discard`); a single run refused before anything started (a config
typo) leaves no directory at all (:meth:`HydraRecord.remove_unstarted`).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from posbench.core.errors import PosbenchError
from posbench.core.io import check_output_dir, write_text_atomic

HYDRA_SUBDIR = ".hydra"  # where Hydra itself would write its record


class DeferredFileHandler(logging.FileHandler):
    """A log file that stays closed until the process owns the run directory.

    Records are kept in memory until :meth:`write_kept` (then written, and later records go
    straight to the file) or :meth:`drop` (never written). A handler closed with neither, e.g.
    a job that failed before it could lock its directory, writes what it kept (Hydra's own
    behaviour). A failed write (a full disk) is reported once, on one line, instead of
    logging's traceback per record.
    """

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = None, delay: bool = True,
                 errors: str | None = None) -> None:
        super().__init__(filename, mode=mode, encoding=encoding, delay=True, errors=errors)
        self.pending: list[logging.LogRecord] | None = []  # None once written
        self.dropped = False
        self.write_failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.dropped:
            return
        if self.pending is not None:
            self.pending.append(record)
            return
        super().emit(record)

    def write_kept(self) -> None:  # (not "release": logging.Handler's lock method)
        """Write the kept records and every later one to the file."""
        if self.dropped or self.pending is None:
            return
        pending, self.pending = self.pending, None
        for record in pending:
            super().emit(record)

    def drop(self) -> None:
        """Forget the kept records; nothing of this process reaches the file."""
        self.pending, self.dropped = None, True

    def close(self) -> None:
        if self.pending:
            self.write_kept()
        super().close()

    def handleError(self, record: logging.LogRecord) -> None:  # the name logging calls
        if not self.write_failed:
            self.write_failed = True
            err = sys.exc_info()[1]
            print(f"posbench: warning: cannot write the log file {self.baseFilename} ({err}); "
                  "the log goes on on the console only", file=sys.stderr)


def deferred_handlers() -> list[DeferredFileHandler]:
    """The :class:`DeferredFileHandler` s of the root logger (Hydra's job logging)."""
    return [h for h in logging.getLogger().handlers if isinstance(h, DeferredFileHandler)]


class HydraRecord:
    """Hydra's record of one ``posbench train`` job, written once the run is this process's.

    ``created``: the folders of the output directory Hydra made for this job (found missing
    before the job started, see :class:`RunDirCallback`), removed again by
    :meth:`remove_unstarted`. ``sweep_dir``: the sweep's directory (a multirun job);
    ``named_dir``: the command line named the output directory (``hydra.run.dir`` /
    ``hydra.sweep.dir``), so the same command finds the run again.
    """

    def __init__(self, output_dir: Path, files: dict[str, Any], multirun: bool, created: list[Path],
                 sweep_dir: Path | None = None, named_dir: bool = False) -> None:
        self.output_dir, self.files, self.multirun, self.created = Path(output_dir), files, multirun, created
        self.sweep_dir, self.named_dir = (Path(sweep_dir) if sweep_dir is not None else None), named_dir

    def continue_hint(self, run_dir: Path, resume_named: bool) -> str:
        """:func:`continue_hint` for this job."""
        return continue_hint(run_dir, resume_named, self.sweep_dir if self.multirun else None, self.named_dir)

    @classmethod
    def from_hydra(cls) -> HydraRecord:
        """The record of the running Hydra job, as Hydra would have written it."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
        from omegaconf import OmegaConf, open_dict, read_write

        hydra_cfg = HydraConfig.get()
        root = copy.deepcopy(HydraConfig.instance().cfg)  # {"hydra": ...}
        with read_write(root.hydra), open_dict(root.hydra):  # where the record is, as Hydra's own record says
            root.hydra.output_subdir = HYDRA_SUBDIR
        output_dir = Path(hydra_cfg.runtime.output_dir)
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        created = [] if multirun else [p for p in _created_folders if _same(p, output_dir) or _is_parent(p, output_dir)]
        dir_key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        named = any(str(o).split("=", 1)[0].lstrip("+~") == dir_key for o in hydra_cfg.overrides.hydra)
        return cls(output_dir, {"hydra.yaml": OmegaConf.to_yaml(root),
                                "overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task)}, multirun, created,
                   sweep_dir=Path(os.path.abspath(str(hydra_cfg.sweep.dir))) if multirun else None,
                   named_dir=named)

    def write(self, cfg: Any, is_main: bool = True) -> None:
        """This process holds the run: write ``.hydra/`` (main process) and open the log file.

        Best effort: the record is written on the way out of a failed run too, where a full
        disk must not replace the run's one-line error with a traceback; a failed write is
        one warning line on stderr."""
        from omegaconf import OmegaConf

        if is_main:
            folder = self.output_dir / HYDRA_SUBDIR
            try:
                write_text_atomic(folder / "config.yaml", OmegaConf.to_yaml(cfg))
                for name, text in self.files.items():
                    write_text_atomic(folder / name, text)
            except OSError as err:
                print(f"posbench: warning: cannot write Hydra's record {folder} ({err})", file=sys.stderr)
        for handler in deferred_handlers():
            handler.write_kept()

    @staticmethod
    def discard() -> None:
        """This process was refused: none of its log lines reach the run's log file."""
        for handler in deferred_handlers():
            handler.drop()

    def remove_unstarted(self) -> bool:
        """A single run that failed before anything started: remove the empty folders Hydra
        made for it, so no failed run directory is left behind. False (nothing removed) in a
        sweep, whose summary lists the failed job from its status.json, or when the folder
        holds anything."""
        if self.multirun or not self.created:
            return False
        try:
            if any(self.output_dir.iterdir()):
                return False
        except OSError:
            return False
        self.discard()
        for folder in sorted(self.created, key=lambda p: len(p.parts), reverse=True):
            try:
                folder.rmdir()  # only ever removes an empty folder
            except OSError:
                break
        return True


class RunDirCallback(Callback):
    """Hydra callback (``configs/train.yaml``) that runs before Hydra makes the job's folders:
    an output folder naming an existing file, or one that cannot be written (a read-only disk),
    is refused with one line (Hydra would end in a traceback), and a single run's folders that do not exist yet are noted for
    :meth:`HydraRecord.remove_unstarted`. Hydra turns a callback's exceptions into warnings, so
    a refusal exits here."""

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        path = self._checked(config, "hydra.run.dir")
        _created_folders[:] = missing_folders(path) if path is not None else []

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._checked(config, "hydra.sweep.dir")
        try:
            problem = shared_resume(list(config.hydra.overrides.task))
        except Exception:  # an override Hydra cannot parse is Hydra's to report
            problem = None
        if problem is not None:
            print(f"posbench {config.hydra.job.name}: error: {problem}", file=sys.stderr)
            raise SystemExit(2) from None

    @staticmethod
    def _checked(config: Any, key: str) -> Path | None:
        from omegaconf import OmegaConf

        try:
            value = OmegaConf.select(config, key)
        except Exception:  # an unresolvable value is Hydra's to report
            return None
        if value is None:
            return None
        try:
            return check_output_dir(value, key, writable=True)
        except PosbenchError as err:
            print(f"posbench {config.hydra.job.name}: error: {err}", file=sys.stderr)
            raise SystemExit(2) from None


def continue_hint(run_dir: Path, resume_named: bool, sweep_dir: Path | None = None, named_dir: bool = False) -> str:
    """How to continue a job after an interruption: a sweep job (``sweep_dir``) in its sweep
    directory (``trainer.resume=<job dir>`` would send every job into that one run), a single
    run in its run directory. ``resume_named``: the command already has ``trainer.resume=<run
    dir>``; ``named_dir``: it names its output directory (``hydra.run.dir`` / ``hydra.sweep.dir``)."""
    if sweep_dir is not None:
        if named_dir:
            return "continue the sweep with the same command"
        return f"continue the sweep with the same command plus hydra.sweep.dir={sweep_dir}"
    if resume_named or named_dir:
        return "continue with the same command"
    return f"continue with the same command plus trainer.resume={run_dir}"


def shared_resume(overrides: list[str]) -> str | None:
    """Why a sweep's overrides send all its jobs into one run directory, or None.

    ``trainer.resume=<run dir>`` continues one run, in that directory: in a sweep of several
    jobs every job would write into that one run (the first that matches continues it, the
    others are refused), and the new sweep's own directory records none of them. A sweep is
    continued in its own directory (``hydra.sweep.dir``); sweeping ``trainer.resume`` itself
    (one run per job) is fine."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    resume = [o for o in parsed if o.key_or_group == "trainer.resume" and not o.is_sweep_override()]
    swept = [o for o in parsed if o.is_sweep_override() and o.key_or_group != "trainer.resume"]
    if not resume or not swept:
        return None
    value = str(resume[-1].value())
    if value.lower() in ("auto", "true", "false", "none", "null"):
        return None
    return (f"trainer.resume={value} continues one run, but this sweep has several jobs ({swept[0].input_line}), "
            "which would all write into it; continue a sweep with its own command plus "
            "hydra.sweep.dir=<its sweep dir>, without trainer.resume")


# Folders of the next single run's output directory that did not exist before Hydra made them.
_created_folders: list[Path] = []


def _same(a: Path, b: Path) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _is_parent(parent: Path, child: Path) -> bool:
    return os.path.abspath(child).startswith(os.path.abspath(parent) + os.sep)


def missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet (absolute)."""
    path = Path(os.path.abspath(path))
    return [p for p in (path, *path.parents) if not p.exists()]
