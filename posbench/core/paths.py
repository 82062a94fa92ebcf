"""Paths as a run's records show them: never the absolute paths of the machine that wrote them.

A record (results.json, a sweep's summary.md) that is committed or shared names a place inside
the repository it was written from relative to that repository's root (``.gpucache/data/...``),
and a place in the home directory from ``~`` (``~/.cache/posbench/data/...``); any other path is
kept as it is. :func:`recorded_location` reads such a path back on this machine.
"""

from __future__ import annotations

import os
from pathlib import Path


def repository_root(start: str | os.PathLike | None = None) -> Path | None:
    """The root of the git repository holding ``start`` (default: the working directory): the
    nearest folder with a ``.git`` entry (a folder, or a worktree's file); None outside any."""
    here = Path(start or os.getcwd()).resolve()
    return next((folder for folder in (here, *here.parents) if (folder / ".git").exists()), None)


def recorded_path(path: str | os.PathLike) -> str:
    """``path`` as a record stores it: relative to the working directory's repository when
    inside it, else from ``~`` when inside the home directory, else unchanged."""
    resolved = Path(path).expanduser().resolve()
    for root, prefix in ((repository_root(), ""), (Path.home().resolve(), "~/")):
        if root is not None and resolved.is_relative_to(root) and resolved != root:
            return prefix + resolved.relative_to(root).as_posix()
    return str(path)


def recorded_location(text: str | os.PathLike) -> Path:
    """Where a recorded path (:func:`recorded_path`, or an absolute one from older records) lies
    on this machine: ``~`` expanded, a relative path from the working directory's repository."""
    path = Path(text).expanduser()
    if path.is_absolute():
        return path
    return (repository_root() or Path.cwd()) / path


__all__ = ["recorded_location", "recorded_path", "repository_root"]
