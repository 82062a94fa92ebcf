"""The pieces of results.json as typed dicts (docs/results-schema.md, docs/tasks.md).

The evaluation and training layers write these plain dicts; the runs and report layers read them
back by key. The declarations say which keys each piece holds: a key marked ``NotRequired`` is
absent from some files (added after the first runs, or written only in some cases), so a reader
uses ``.get`` for it. Nothing here changes what is written: at runtime these are ordinary dicts.
"""

# No ``from __future__ import annotations`` here: Python 3.11's TypedDict sees ``NotRequired``
# only in evaluated annotations.
import sys
from typing import Any

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # a dependency of torch
    from typing_extensions import NotRequired, TypedDict

# ----------------------------------------------------------------------------- summaries


class IntervalSummary(TypedDict):
    """A mean with its interval (:meth:`posbench.evaluation.stats.Interval.to_dict`)."""

    mean: float | None  # the mean; None when there was no value (a band without answers)
    low: float | None  # lower end of the 95 % interval (None: no interval)
    high: float | None  # upper end of the 95 % interval (None: no interval)
    n: int  # number of values it is over (sequences for a bootstrap, seeds for t)
    kind: str  # "bootstrap", "t", "1 seed" or "none"
    half_width: float | None  # (high - low) / 2 (None: no interval)


class BandAccuracy(IntervalSummary):
    """A task entry's accuracy in one band (``by_position``, ``by_<axis>``)."""

    answers: int  # answer targets in the band


class AxisSummary(TypedDict):
    """An answer axis of a task entry (``lookback``, ``string_length``, ``ring``) over the answers."""

    median: float | None  # median (None without answers)
    p90: float | None  # 90th percentile
    max: int | None  # largest value
    beyond_context: float | None  # share of answers >= C (out of reach of a window of C tokens)


class EffectiveLength(TypedDict):
    """``effective_length`` of a loss entry."""

    eps: float  # the loss margin
    window: int  # positions of the moving average that smooths the loss curve
    in_context: int | None  # first position >= C where the smoothed loss exceeds the 0-C band by eps (L: never)
    windowed: int | None  # the same against the smoothed windowed curve (None when L <= C)


class CurveSummary(TypedDict):
    """The band summary of one pass over the windows (``evaluation.curves.curve_summary``)."""

    loss_by_position: list[float]  # L values: mean next-token loss at each position
    bands: dict[str, float]  # {"0-C": ..., "C-2C": ..., ...}: band means of loss_by_position
    sequence_bands: dict[str, list[float]]  # {band: [N values]}: each sequence's band mean
    cumulative_perplexity: list[float]  # L values: exp(mean loss of positions 0..l)
    perplexity_ratio: dict[str, float]  # {band: PPL(band) / PPL(0-C)}


class WindowedCurve(CurveSummary):
    """``windowed`` of a loss entry (L > C): the like-for-like pass reading at most C tokens."""

    stride: int  # positions scored per window
    seconds: float | None  # time of the windowed pass


class CostCurve(TypedDict):
    """``cost`` of a loss entry (L > C): full minus windowed; positive when the long context hurts."""

    loss_by_position: list[float]  # L values (0 below C for the plain model)
    bands: dict[str, float]  # band means of loss_by_position
    sequence_bands: dict[str, list[float]]  # {band: [N values]}


class AxisSides(TypedDict):
    """``extension_per_axis`` of a grid entry: the sides whose ratio is the extension factor."""

    train_side: int  # side of the training grid
    side: int  # side of the evaluated grid


# ----------------------------------------------------------------------------- entries


class LossEntry(TypedDict):
    """One entry of ``eval`` (or ``eval_variants``): a (split, length, extension) of a text run."""

    split: str  # the split scored ("validation", ...)
    length: int  # L: positions scored per window
    num_sequences: int  # N: windows of L + 1 tokens scored
    loss_by_position: list[float]  # L values: mean next-token loss at each position, full context
    bands: dict[str, float]  # {"0-C": ..., "C-2C": ...}: band means of loss_by_position
    tokens_per_second: float  # speed of the full pass
    seconds: float  # time of the full pass
    sequences_sha256: NotRequired[str]  # SHA-256 of the scored token ids: equal = the same windows
    sequence_bands: NotRequired[dict[str, list[float]]]  # {band: [N values]}: each sequence's band mean
    cumulative_perplexity: NotRequired[list[float]]  # L values: exp(mean loss of positions 0..l)
    perplexity_ratio: NotRequired[dict[str, float]]  # {band: PPL(band) / PPL(0-C)}
    effective_length: NotRequired[EffectiveLength]  # where the loss leaves the in-context level
    windowed: NotRequired[WindowedCurve]  # L > C: the like-for-like pass
    cost: NotRequired[CostCurve]  # L > C: full minus windowed
    extension: NotRequired[str]  # the context extension ("none" = the plain model; absent: plain)
    extension_factor: NotRequired[float | None]  # the extension's factor (None for none)
    extension_options: NotRequired[dict[str, Any]]  # the settings of an extension that takes some
    extension_scope: NotRequired[str]  # the layers it went on (global, local, rope; absent: all)
    data: NotRequired[str]  # after posbench eval: the text scored ("run" or the other text's path)
    checkpoint_step: NotRequired[int]  # after posbench eval: the step of the checkpoint scored
    precision: NotRequired[str]  # after posbench eval: the precision it ran in (bf16, fp32)
    added: NotRequired[bool]  # true on an entry posbench eval added at a new split or length
    variant: NotRequired[str]  # in eval_variants: what differs (num_sequences=64, replaced, ...)


class TaskEntry(TypedDict):
    """One entry of ``task.entries``: a (test set, length, extension) of a task run (docs/tasks.md)."""

    split: str  # "test": the test stream
    length: int  # L: the length of the test sequences
    num_sequences: int  # test sequences scored
    sequences_sha256: str  # SHA-256 of the sequences: equal = the same sequences, pairable
    answers: int  # number of answer targets
    loss: float | None  # mean cross-entropy over the answers (None without answers)
    accuracy: IntervalSummary  # mean over sequences of each sequence's accuracy, bootstrap interval
    sequence_accuracy: list[float]  # each sequence's accuracy (those with an answer)
    sequence_rows: list[int]  # their rows among the num_sequences
    by_position: dict[str, BandAccuracy]  # accuracy by band of answer position (a grid: by ring)
    baselines: dict[str, float | None]  # expected accuracy of each shortcut (chance, previous_bit, ...)
    test_set: NotRequired[str]  # standard, sparse, far, shifted (absent: standard)
    exact_match: NotRequired[IntervalSummary]  # copy: share of sequences with every answer right
    sequence_exact_match: NotRequired[list[float]]  # copy: per sequence, 0 or 1
    lookback: NotRequired[AxisSummary]  # flip-flop: distance from the query back to the answer
    by_lookback: NotRequired[dict[str, BandAccuracy]]  # flip-flop: accuracy by lookback band
    string_length: NotRequired[AxisSummary]  # copy: the copied string's length
    by_string_length: NotRequired[dict[str, BandAccuracy]]  # copy: accuracy by string length band
    ring: NotRequired[AxisSummary]  # grid tasks: the answer cell's ring
    by_ring: NotRequired[dict[str, BandAccuracy]]  # grid tasks: accuracy by ring band
    extension: NotRequired[str]  # the context extension ("none" = the plain model; absent: plain)
    extension_factor: NotRequired[float | None]  # the extension's factor (None for none)
    extension_options: NotRequired[dict[str, Any]]  # the settings of an extension that takes some
    extension_per_axis: NotRequired[AxisSides]  # grid tasks' extension entries
    seconds: NotRequired[float]  # time of the pass


class LearntAtC(TypedDict):
    """``task.learnt_at_c``: whether the run learnt its task at C."""

    test_set: str  # the test it is read on ("standard")
    length: int  # C
    metric: str  # "accuracy"
    threshold: float  # task.learnt_at_c
    value: float | None  # the plain model's accuracy there (None: no such entry)
    learnt: bool  # value >= threshold


class TaskRecord(TypedDict):
    """``task`` of a task run."""

    name: str  # the task (flipflop, assoc_recall, copy, ...)
    options: dict[str, Any]  # its options (task.*)
    metrics: list[str]  # the metrics it reports (accuracy, exact_match)
    chance: float  # chance accuracy
    vocab_size: int  # the task's vocabulary size
    entries: list[TaskEntry]  # one per (test set, length, extension)
    learnt_at_c: NotRequired[LearntAtC]  # the verdict (runs from before it lack it)


# ----------------------------------------------------------------------------- the run


class TrainRecord(TypedDict):
    """``train``: how training went."""

    tokens: int  # training tokens seen
    steps: int  # optimiser steps
    final_loss: float  # the last step's training loss
    tokens_per_second: float  # training tokens / training time (less validation and checkpoints)
    wall_seconds: float  # wall time of the run (all resumed segments)
    device: str  # cpu or cuda
    final_val_loss: NotRequired[float | None]  # the final validation loss at C
    epochs: NotRequired[float]  # passes over the training text
    overhead_seconds: NotRequired[float]  # time spent on validation and checkpoints
    world_size: NotRequired[int]  # processes that trained
    resumed_from_step: NotRequired[int | None]  # the step the last segment resumed from (None: none)
    validation_windows: NotRequired[dict[str, int]]  # in-training validation sets: metrics key -> windows
    position_dropped_after_step: NotRequired[int]  # method=drope: steps trained with method.base before the drop
    state_passing: NotRequired[dict[str, Any]]  # trainer.state_passing when on: {mode, noise}


class EvaluatedRun(TypedDict):
    """The part of results.json a run's final evaluation writes (before ``train`` and the rest)."""

    schema_version: int  # SCHEMA_VERSION
    kind: NotRequired[str]  # the run's kind: text, task or a plug-in's (absent from files written before it)
    method: str  # the position method (its label, e.g. rope+rand2048)
    seed: int  # the run's seed
    train_context: int  # C
    eval: list[LossEntry]  # one entry per (split, length, extension); [] for a task run
    created: NotRequired[str]  # when it was written (ISO 8601, UTC)
    task: NotRequired[TaskRecord]  # a task run's task and its entries


class Results(EvaluatedRun):
    """A whole results.json."""

    train: TrainRecord  # how training went
    run_name: NotRequired[str]  # the run's name
    eval_variants: NotRequired[list[LossEntry]]  # entries posbench eval measured otherwise
    model: NotRequired[dict[str, Any]]  # the model config plus parameters, non_embedding_parameters
    method_options: NotRequired[dict[str, Any]]  # the method's options
    data: NotRequired[dict[str, Any]]  # dir (the token cache) and meta; retrieval when used
    versions: NotRequired[dict[str, str]]  # posbench, torch, python, cuda, device_name
    environment: NotRequired[dict[str, Any]]  # precision, device, ... training computed with
    probes: NotRequired[list[dict[str, Any]]]  # eval.probes=[copy]: a copy probe entry per extension
    passkey: NotRequired[list[dict[str, Any]]]  # eval.probes=[passkey]: an entry per extension


__all__ = ["AxisSides", "AxisSummary", "BandAccuracy", "CostCurve", "CurveSummary", "EffectiveLength", "EvaluatedRun",
           "IntervalSummary", "LearntAtC", "LossEntry", "Results", "TaskEntry", "TaskRecord", "TrainRecord",
           "WindowedCurve"]
