"""Atomic file writes: a reader never sees a half-written file.

Everything is written to a temporary file in the destination's folder, flushed and fsynced,
then moved into place with ``os.replace`` (atomic on POSIX). A process killed mid-write leaves
at most a stray ``.tmp-*`` file, never a truncated result/checkpoint/cache file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from posbench.core.errors import PosbenchError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; move it onto ``path`` if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results should be shareable like any file
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 hex digest of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_output_dir(path: Any, key: str, writable: bool = False) -> Path:
    """``path`` as an output folder, or one line naming ``key`` when it (or a parent) is a file;
    with ``writable``, also when it (or, while it does not exist, the nearest folder above it)
    cannot be written: a read-only disk or mount, or no permission."""
    path = Path(os.path.abspath(Path(str(path)).expanduser()))
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            what = "names an existing file" if part == path else f"lies under {part}, which is a file"
            raise PosbenchError(f"{key}={path} {what}, not a folder; choose another {key}")
    if writable:
        existing = next(part for part in (path, *path.parents) if part.exists())
        if not os.access(existing, os.W_OK | os.X_OK):
            where = "" if existing == path else f" ({existing} is the folder it would be made in)"
            raise PosbenchError(f"{key}={path} cannot be written{where}: a read-only disk or no permission; "
                                f"choose another {key} on a writable disk")
    return path
