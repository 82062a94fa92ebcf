"""Scoring a model on a task: accuracy on the answer tokens only, by length and by position.

A target counts only where the task's answer mask is set: the loss is the mean cross-entropy over
answers, and a prediction is right when the argmax over the whole vocabulary is the answer. Each
sequence's accuracy is the fraction of its answers that are right, and a length's accuracy is
the mean over sequences (every sequence weighs the same), with a percentile bootstrap over the
sequences (:func:`posbench.evaluation.stats.bootstrap_interval`); across seeds the comparison tables use a
t-interval over the runs' means (:func:`posbench.evaluation.stats.across_runs`), as for the loss bands.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from posbench.evaluation.curves import band_edges
from posbench.evaluation.loss import inference, sequences_fingerprint
from posbench.evaluation.stats import bootstrap_interval
from posbench.model.extension import NONE, evaluation_order, extended, record_extension
from posbench.runs.results import build_results
from posbench.runs.results_types import EvaluatedRun, IntervalSummary, LearntAtC, TaskEntry, TaskRecord
from posbench.tasks.base import IGNORE, STANDARD, TEST, VALID, Batch, Task, task_class

ENTRY_SPLIT = "test"


def answer_scores(model: nn.Module, batch: Batch, batch_size: int, device: torch.device,
                  autocast_dtype: torch.dtype | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(correct, loss)``, each ``(N, L)`` numpy arrays over every target of ``batch``: whether
    the argmax is the target and the cross-entropy (float64); read them only where
    ``batch.answers`` is set (``(N, 1)`` for a pooled head: one answer per sequence). The body
    runs under ``autocast_dtype``, the head in float32."""
    x, y = batch.inputs_targets()  # (N, L) each, y = IGNORE off the answers
    correct = np.zeros(y.shape, dtype=bool)
    loss = np.zeros(y.shape, dtype=np.float64)
    with inference(model):
        for start in range(0, x.shape[0], batch_size):
            xb, yb = x[start:start + batch_size].to(device), y[start:start + batch_size].to(device)
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                h = model.answer_states(model.hidden_states(xb))  # (b, L, D), pooled: (b, 1, D)
            logits = F.linear(h.float(), model.lm_head.weight.float())  # (b, L, V)
            ce = F.cross_entropy(logits.transpose(1, 2), yb, reduction="none", ignore_index=IGNORE)  # (b, L)
            correct[start:start + xb.shape[0]] = (logits.argmax(-1) == yb).cpu().numpy()
            loss[start:start + xb.shape[0]] = ce.double().cpu().numpy()
    return correct, loss


def sequence_accuracy(correct: np.ndarray, answers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-sequence accuracy over ``answers`` (rows without an answer are dropped) and the kept
    rows' indices."""
    counts = answers.sum(axis=1)
    rows = np.flatnonzero(counts > 0)
    return (correct & answers)[rows].sum(axis=1) / counts[rows], rows


def summary(values: np.ndarray) -> IntervalSummary:
    """Mean and bootstrap interval over sequences (:func:`posbench.evaluation.stats.bootstrap_interval`)."""
    if values.size == 0:
        return {"mean": None, "low": None, "high": None, "n": 0, "kind": "none", "half_width": None}
    return bootstrap_interval(values).to_dict()


def shown_mean(value: dict[str, Any]) -> str:
    """A summary's mean for a log line; a length whose sequences hold no answer has none."""
    return "- (no answer)" if value["mean"] is None else f"{value['mean']:.3f}"


def axis_summary(values: np.ndarray, context: int) -> dict[str, Any]:
    """An answer axis (e.g. lookback) over the answers: median, 90th percentile, max and the
    fraction at ``>= context`` (out of reach of a window of the last C tokens)."""
    if values.size == 0:
        return {"median": None, "p90": None, "max": None, "beyond_context": None}
    return {"median": float(np.median(values)), "p90": float(np.percentile(values, 90)), "max": int(values.max()),
            "beyond_context": float((values >= context).mean())}


def answer_details(task: Task, batch: Batch, correct: np.ndarray, length: int, train_context: int) -> dict[str, Any]:
    """The entry's baselines (mean over sequences of each guess's expected accuracy) and, per
    answer axis of the task (``lookback``, ``string_length``), its summary and the accuracy by
    its bands ``by_<axis>`` (0-C, C-2C, ...)."""
    answers = batch.answers
    details: dict[str, Any] = {"baselines": task.baseline_accuracy(batch)}
    for axis, values in task.answer_axes(batch).items():
        details[axis] = axis_summary(values[answers], train_context)
        details[f"by_{axis}"] = {}
        for a, b in task.axis_bands(axis, length):
            inside = answers & (values >= a) & (values < b)
            per_sequence, _ = sequence_accuracy(correct, inside)
            details[f"by_{axis}"][f"{a}-{b}"] = {**summary(per_sequence), "answers": int(inside.sum())}
    return details


def position_bands(task: Task, answers: np.ndarray, train_context: int) -> dict[str, np.ndarray]:
    """``(N, L)`` answers of each ``by_position`` band: the task's own bands (a grid task: rings
    0-s, s-2s, ...), else by target position 0-C, C-2C, 2C-4C, ... fully inside the length."""
    length = answers.shape[1]
    bands = task.position_bands(length)
    if bands is not None:
        return {band: answers & cells[None, :] for band, cells in bands.items()}
    inside = {}
    for a, b in band_edges(length, train_context):
        inside[f"{a}-{b}"] = np.zeros_like(answers)
        inside[f"{a}-{b}"][:, a:b] = answers[:, a:b]
    return inside


def task_entry(task: Task, batch: Batch, correct: np.ndarray, loss: np.ndarray, *, length: int,
               train_context: int, test: str = STANDARD) -> TaskEntry:
    """One results.json ``task.entries`` item (docs/tasks.md, "Results")."""
    answers = batch.answers
    per_sequence, rows = sequence_accuracy(correct, answers)
    entry: TaskEntry = {
        "split": ENTRY_SPLIT, "test_set": test, "length": length, "num_sequences": int(answers.shape[0]),
        "sequences_sha256": sequences_fingerprint(torch.from_numpy(np.asarray(batch.fingerprint_ids()))),
        "answers": int(answers.sum()),
        "loss": float(loss[answers].mean()) if answers.any() else None,
        "accuracy": summary(per_sequence),
        "sequence_accuracy": per_sequence.tolist(),
        "sequence_rows": rows.tolist(),
        "by_position": {},
    }
    for band, inside in position_bands(task, answers, train_context).items():
        values, _ = sequence_accuracy(correct, inside)
        entry["by_position"][band] = {**summary(values), "answers": int(inside.sum())}
    if "exact_match" in task.metrics:
        exact = (correct | ~answers)[rows].all(axis=1).astype(np.float64)  # every answer of the row right
        entry["exact_match"] = summary(exact)
        entry["sequence_exact_match"] = exact.tolist()
    entry.update(answer_details(task, batch, correct, length, train_context))
    return entry


def evaluate_task(model: nn.Module, task: Task, evaluation: Any, train_context: int, device: torch.device,
                  autocast_dtype: torch.dtype | None, log: Callable[[str], Any]) -> list[TaskEntry]:
    """Every (eval length, extension) of ``evaluation`` (an :class:`posbench.evaluation.settings.EvalConfig`)
    on ``evaluation.num_sequences`` test sequences of the task: the results.json entries."""
    entries = []
    task.check_lengths(evaluation.lengths)
    for test, length in ((test, length) for test in task.tests for length in sorted(set(evaluation.lengths))):
        batch = task.sequences(TEST, length, evaluation.num_sequences, test)
        for extension in evaluation_order(evaluation.extension):
            started = time.perf_counter()
            settings = evaluation.extension_options()  # eval.rerope.*, eval.self_extend.*
            with extended(model, extension, train_context, length, evaluation.extension_factor, settings) as factor:
                correct, loss = answer_scores(model, batch, evaluation.batch_size, device, autocast_dtype)
            entry = task_entry(task, batch, correct, loss, length=length, train_context=train_context, test=test)
            record_extension(entry, extension, factor, train_context, length, settings, layout=task.layout)
            entry["seconds"] = time.perf_counter() - started
            entries.append(entry)
            shown = ", ".join(f"{band}: {v['mean']:.3f}" for band, v in entry["by_position"].items() if v["n"])
            shown = f"by position {shown}; " if entry["by_position"] else ""  # a pooled answer has no position
            label = ("" if test == STANDARD else f" {test}") + ("" if extension == NONE else f" {extension}")
            extra = f", exact match {shown_mean(entry['exact_match'])}" if "exact_match" in entry else ""
            baselines = ", ".join(f"{k} {v:.3f}" for k, v in entry["baselines"].items() if v is not None)
            log(f"task {task.name} length {length}{label}: accuracy {shown_mean(entry['accuracy'])}{extra} "
                f"({shown}baselines {baselines})")
    return entries


def validation_batches(task: Task, context: int, val_sequences: int, extrapolation_sequences: int) -> dict[str, Batch]:
    """The in-training validation sets (stream VALID): ``val`` at C and, when asked, ``val_<C>_<2C>``."""
    sets = {"val": task.sequences(VALID, context, val_sequences)}
    if extrapolation_sequences:
        length = task.extrapolation_length()  # 2C (a grid task: twice the side)
        sets[f"val_{context}_{length}"] = task.sequences(VALID, length, extrapolation_sequences)
    return sets


def validation_metrics(model: nn.Module, task: Task, sets: dict[str, Batch], context: int, batch_size: int,
                       device: torch.device, autocast_dtype: torch.dtype | None) -> dict[str, float]:
    """``val_loss`` and ``val_accuracy`` at C (answers only), and ``val_accuracy_<C>_<2C>``
    (answers at positions C..2C-1 of 2C-long sequences) when that set exists."""
    row: dict[str, float] = {}
    for name, batch in sets.items():
        correct, loss = answer_scores(model, batch, batch_size, device, autocast_dtype)
        answers = batch.answers.copy()
        if name != "val":
            answers &= task.beyond_context(batch.inputs.shape[1])[None, :]  # past C (a grid: outside its square)
        else:
            row["val_loss"] = float(loss[answers].mean())
        row[name.replace("val", "val_accuracy", 1)] = float(correct[answers].mean()) if answers.any() else float("nan")
    return row


def task_results(model: nn.Module, spec: Any, device: torch.device, autocast_dtype: torch.dtype | None,
                 log: Callable[[str], Any]) -> EvaluatedRun:
    """A task run's final evaluation (``spec``: its :class:`posbench.runs.spec.RunSpec`) as the top
    part of results.json: ``eval`` stays empty (no text loss curves), ``task`` holds the task,
    its options and the entries of :func:`evaluate_task`."""
    task, context = spec.task, spec.trainer.context
    entries = evaluate_task(model, task, spec.eval, context, device, autocast_dtype, log)
    record: TaskRecord = {"name": task.name, "options": {k: v for k, v in spec.task_options.items() if k != "name"},
              "metrics": list(task.metrics), "chance": task.chance(), "vocab_size": task.vocab_size, "entries": entries}
    record["learnt_at_c"] = learnt_at_c(record, context)
    if not record["learnt_at_c"]["learnt"]:
        log(f"task {task.name}: not learnt at C (accuracy at {context} on the {record['learnt_at_c']['test_set']} test "
            f"{shown_mean({'mean': record['learnt_at_c']['value']})} < task.learnt_at_c={task.learnt_at_c}): "
            "comparisons leave this run out of every claim past C")
    return build_results(kind=spec.kind, method=spec.method, seed=spec.seed, train_context=context, eval=[],
                         task=record)


def learnt_at_c(task: TaskRecord, train_context: int) -> LearntAtC:
    """Whether a run learnt its task at C: the plain model's accuracy on the reference test at
    length C (the standard one; the first of the task's ``TESTS`` for a task without it) against
    ``task.learnt_at_c`` (the task's default for runs that predate the option).
    ``task`` is results.json's ``task``; a run with a recorded verdict keeps it. ``value`` is
    None (and ``learnt`` False) when the run has no such entry."""
    if isinstance(task.get("learnt_at_c"), dict):
        return task["learnt_at_c"]
    cls = task_class(task.get("name", ""))
    threshold = (task.get("options") or {}).get("learnt_at_c")
    threshold = float(threshold if threshold is not None else cls.LEARNT_AT_C if cls else Task.LEARNT_AT_C)
    reference = cls.TESTS[0] if cls else STANDARD  # the standard test, for every task that has one
    value = next((e["accuracy"]["mean"] for e in task.get("entries", [])
                  if e.get("test_set", STANDARD) == reference and int(e["length"]) == train_context
                  and e.get("extension", NONE) == NONE and "accuracy" in e), None)
    learnt = value is not None and not np.isnan(value) and value >= threshold
    return {"test_set": reference, "length": train_context, "metric": "accuracy", "threshold": threshold,
            "value": value, "learnt": bool(learnt)}


def task_summary(results: EvaluatedRun) -> dict[str, float]:
    """``task/<metric>_<L>`` of the plain model on the standard test (``task/<test>_<metric>_<L>``
    on the others): the W&B summary and the run's last log line; empty for text runs."""
    out: dict[str, float] = {}
    task = results.get("task") or {}
    for entry in task.get("entries", []):
        if entry.get("extension", NONE) != NONE:
            continue
        test = entry.get("test_set", STANDARD)
        prefix = "" if test == STANDARD else f"{test}_"
        for metric in task.get("metrics", ["accuracy"]):  # the metrics the task declared
            if metric in entry and entry[metric]["mean"] is not None:
                out[f"task/{prefix}{metric}_{entry['length']}"] = float(entry[metric]["mean"])
    return out


__all__ = ["answer_details", "answer_scores", "axis_summary", "evaluate_task", "learnt_at_c", "position_bands", "sequence_accuracy",
           "task_entry", "task_results", "task_summary", "validation_batches", "validation_metrics"]
