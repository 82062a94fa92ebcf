"""status.json (running, completed, failed, interrupted) and refused.json: what a run directory says
about the run's state."""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
from pathlib import Path
from typing import Any

from posbench.core.io import write_json_atomic

STATUS_FILE = "status.json"
# Written instead of status.json when a start was refused next to an earlier run's record
# (e.g. a resume under another config): the record stays, the sweep summary counts a failure.
REFUSED_FILE = "refused.json"
STATUSES = ("running", "completed", "failed", "interrupted")


def timestamp() -> str:
    """Now, in UTC, to the second (ISO 8601): when a record was written."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def write_status(run_dir: str | os.PathLike, status: str, error: str | None = None, **extra: Any) -> Path:
    """Atomically write ``<run_dir>/status.json`` = ``{"status", "error", **extra, "updated"}``.

    ``status`` is one of ``STATUSES``: running, completed, failed, interrupted (stopped by a
    signal or ``trainer.stop_after_steps`` with a checkpoint to resume from).
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    path = Path(run_dir) / STATUS_FILE
    record = {"status": status, "error": error, **extra, "updated": timestamp()}
    try:
        write_json_atomic(path, record)
    except OSError as err:
        if err.errno != errno.ENOSPC or not path.is_file():
            raise
        # A full disk has no room for the temporary copy; a status is small enough to overwrite
        # in place (within the blocks the file has), so a failed run still says so.
        with open(path, "r+") as f:
            f.write(json.dumps(record, indent=2) + "\n")
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    return path


def read_status(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``<run_dir>/status.json`` as a dict, or None when missing or unreadable."""
    try:
        with open(Path(run_dir) / STATUS_FILE) as f:
            status = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return status if isinstance(status, dict) else None


def read_refusal(run_dir: str | os.PathLike) -> str | None:
    """The error of a refused start in ``run_dir`` (see ``REFUSED_FILE``), or None."""
    try:
        record = json.loads((Path(run_dir) / REFUSED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return str(record.get("error")) if isinstance(record, dict) else "refused"
