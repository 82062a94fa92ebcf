"""results.json: its schema (``SCHEMA_VERSION``, docs/results-schema.md), building and validating
it, writing it atomically, reading it back, and setting a damaged one aside."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Callable

from posbench import __version__
from posbench.core.io import write_json_atomic
from posbench.runs.results_types import LossEntry, Results, TrainRecord
from posbench.runs.status import timestamp

SCHEMA_VERSION = 1

RESULTS_FILE = "results.json"

_REQUIRED_TOP = ("schema_version", "method", "seed", "train_context", "train", "eval")
_REQUIRED_TRAIN = ("tokens", "steps", "final_loss", "tokens_per_second", "wall_seconds", "device")
_REQUIRED_EVAL = ("split", "length", "num_sequences", "loss_by_position", "bands")


def versions() -> dict[str, str]:
    """Software and device the results were produced with."""
    import torch  # here: reading results needs no torch

    return {"posbench": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda or "",
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()}


def build_results(*, method: str, seed: int, train_context: int, eval: list[LossEntry],
                  train: TrainRecord | None = None, kind: str | None = None, **extra: Any) -> Results:
    """A results.json dict (schema ``SCHEMA_VERSION``): the one builder of every evaluator's part
    (the text runs' :func:`posbench.evaluation.loss.evaluate_run`, the task runs'
    :func:`posbench.evaluation.tasks.task_results`) and of a whole file.

    ``kind`` is the run's kind (:mod:`posbench.runs.kinds`; files without it are read by
    :func:`posbench.runs.kinds.results_kind`). ``extra`` keys (``task``, ``run_name``, ``model``,
    ``data``...) are stored as given, then
    ``created`` unless passed. With ``train`` the file is whole: ``versions`` is filled in unless
    passed and it is validated; without, it is an evaluation's top part, which the trainer
    completes (:class:`posbench.train.final.FinalEvaluation`).
    """
    results: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **({"kind": kind} if kind else {}), "method": method,
                               "seed": seed, "train_context": train_context}
    if train is not None:
        results["train"] = dict(train)
    results["eval"] = list(eval)
    results.update(extra)
    results.setdefault("created", timestamp())
    if train is not None:
        results.setdefault("versions", versions())
        validate_results(results)
    return results  # type: ignore[return-value]


def validate_results(results: Any) -> Results:
    """Check the results.json schema; raise ``ValueError`` naming the first problem found."""
    if not isinstance(results, dict):
        raise ValueError(f"results must be a JSON object, got {type(results).__name__}")
    for key in _REQUIRED_TOP:
        if key not in results:
            raise ValueError(f"missing key {key!r}")
    version = results["schema_version"]
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(f"schema_version {version!r} is not supported (this posbench reads <= {SCHEMA_VERSION})")
    train = results["train"]
    if not isinstance(train, dict):
        raise ValueError("'train' must be an object")
    for key in _REQUIRED_TRAIN:
        if key not in train:
            raise ValueError(f"missing key 'train.{key}'")
    for section in ("eval", "eval_variants"):  # eval_variants: optional (see merge_eval_entries)
        if section == "eval_variants" and section not in results:
            continue
        if not isinstance(results[section], list):
            raise ValueError(f"'{section}' must be a list")
        for i, entry in enumerate(results[section]):
            _validate_entry(f"{section}[{i}]", entry)
    return results


def _validate_entry(where: str, entry: Any) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"'{where}' must be an object")
    for key in _REQUIRED_EVAL:
        if key not in entry:
            raise ValueError(f"missing key '{where}.{key}'")
    if len(entry["loss_by_position"]) != entry["length"]:
        raise ValueError(
            f"{where}.loss_by_position has {len(entry['loss_by_position'])} values for length {entry['length']}"
        )
    if not isinstance(entry["bands"], dict):
        raise ValueError(f"'{where}.bands' must be an object")
    for block in ("windowed", "cost"):  # optional (older files lack them), but whole when present
        if block in entry and len(entry[block].get("loss_by_position", ())) != entry["length"]:
            raise ValueError(f"{where}.{block}.loss_by_position must have {entry['length']} values")


def write_results(run_dir: str | os.PathLike, results: Results) -> Path:
    """Validate and atomically write ``<run_dir>/results.json``; returns its path."""
    validate_results(results)
    path = Path(run_dir) / RESULTS_FILE
    write_json_atomic(path, results)
    return path


def read_results(path: str | os.PathLike) -> Results:
    """Read and validate a results.json (``path`` may be the file or its run directory).

    Raises ``OSError`` / ``json.JSONDecodeError`` / ``ValueError`` for missing, corrupt or
    invalid files.
    """
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    with open(path) as f:
        return validate_results(json.load(f))


def quarantine(path: str | os.PathLike, why: str, log: Callable[[str], None], copy: bool = False) -> Path:
    """Set a damaged record aside as ``<name>.corrupt`` (kept for inspection; ``copy`` keeps the
    original in place for the caller to rewrite) and say so in one line."""
    import shutil

    path = Path(path)
    aside = path.with_name(path.name + ".corrupt")
    if copy:
        shutil.copyfile(path, aside)
    else:
        os.replace(path, aside)
    log(f"{path} {why}; moved it aside to {aside.name} and recomputing it from the last good checkpoint")
    return aside
