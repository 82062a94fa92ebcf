"""Synthetic tasks with a right answer: flip-flop, associative recall (MQAR), copy.

A task is a generator of token sequences plus a mask of the targets that are *answers*; only
answers are trained on (the other targets get :data:`IGNORE`) and scored (accuracy, and exact
match per sequence for copy). Sequences are generated on the fly, a pure function of the task's
options and a seed, so there is nothing to download or cache:

    train batch at step s  <- numpy.random.default_rng([task.seed, TRAIN, run seed, s])
    validation at length L <- numpy.random.default_rng([task.seed, VALID, L])
    test at length L       <- numpy.random.default_rng([task.seed, TEST, L])

so train, validation and test never share a random stream, and every method and run seed is
evaluated on the same test sequences (paired). ``configs/task/<name>.yaml`` selects a task
(``posbench train task=flipflop method=alibi``); docs/tasks.md describes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from posbench.core.errors import PosbenchError

IGNORE = -100
"""Target id of a non-answer position: ``F.cross_entropy``'s default ``ignore_index``."""

TRAIN, VALID, TEST = 0, 1, 2  # the random streams (first-but-one seed word)

STANDARD = "standard"
"""The test set every task has (the one of runs from before named test sets): the entries
without a ``test_set`` key are this one."""

EVALUATION_OPTIONS = ("tests", "learnt_at_c")
"""Task options that change the evaluation only, not the training data: left out of the resume
check (a run may be resumed, or re-evaluated, with other test sets)."""

_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: make a task available as ``task=<cls.name>``."""
    _TASKS[cls.name] = cls
    return cls


def unregister_task(name: str) -> None:
    """Remove task ``name`` (tests that register a throwaway task)."""
    _TASKS.pop(name, None)


def list_tasks() -> list[str]:
    return list(_TASKS)


def task_class(name: str) -> type[Task] | None:
    """The registered task ``name`` (None when unknown), for reading saved runs."""
    return _TASKS.get(name)


@dataclass
class Batch:
    """Generated sequences: ``tokens`` ``(N, L + 1)`` int64 (inputs ``[:, :-1]``), ``answers``
    ``(N, L)`` bool: target ``t`` is scored, and ``labels`` ``(N, L)``: the targets when they are
    not the next input (MQAR's values are labels only, never inputs); None = the next input,
    ``tokens[:, 1:]``.

    ``features`` ``(N, L, F)`` float32: continuous inputs in place of token ids (an image's
    patches; the model embeds them with its patch embedding, ``model.patch_dim`` = F); the tokens
    are then placeholders that only carry the length. A task with a pooled answer (one per
    sequence, :attr:`Task.head` ``pooled``) has ``answers`` and ``labels`` of shape ``(N, 1)``."""

    tokens: np.ndarray
    answers: np.ndarray
    labels: np.ndarray | None = None
    features: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """``(N, L + 1)``, as an evaluation window tensor's."""
        return self.tokens.shape

    @property
    def inputs(self) -> np.ndarray:
        return self.tokens[:, :-1]  # (N, L)

    @property
    def targets(self) -> np.ndarray:
        """``(N, L)``: the target of every input (read it where ``answers`` is set)."""
        return self.tokens[:, 1:] if self.labels is None else self.labels

    def fingerprint_ids(self) -> np.ndarray:
        """What identifies the sequences: the tokens, the labels when there are any, and the
        features' bits when there are any."""
        parts = [self.tokens] + ([] if self.labels is None else [self.labels])
        if self.features is not None:
            parts.append(np.ascontiguousarray(self.features, dtype=np.float32).reshape(len(self.tokens), -1).view(np.int32))
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)

    def inputs_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: int64 token ids ``(N, L)`` (or the float32 ``features`` ``(N, L, F)``) and
        int64 targets ``(N, L)`` (``(N, 1)`` for a pooled answer) holding :data:`IGNORE` off the answers."""
        if self.features is not None:
            x = torch.from_numpy(np.ascontiguousarray(self.features, dtype=np.float32))
        else:
            x = torch.from_numpy(self.inputs.astype(np.int64))
        y = torch.from_numpy(self.targets.astype(np.int64))  # a copy (astype)
        y[~torch.from_numpy(self.answers)] = IGNORE
        return x.contiguous(), y


class Task:
    """A synthetic task: its vocabulary, its generator and its metric.

    Subclasses set ``name``, ``vocab`` (token names; ids are their indices), ``metrics``
    (``accuracy``, plus ``exact_match`` where a sequence is one answer) and implement
    :meth:`generate`. Options are keyword-only constructor arguments; a bad value raises
    :class:`PosbenchError` naming the fix. ``context`` is the training length C.
    """

    name: str = ""
    layout: str = "sequence"
    """The model the task is read by: ``sequence`` (the causal language model) or ``grid`` (the
    bidirectional grid encoder, :mod:`posbench.tasks.grid`); the run spec sets ``model.layout`` from it."""
    vocab: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ("accuracy",)
    head: str = "tokens"
    """``tokens``: an answer is a token's label (the LM head at every position); ``pooled``: one
    answer per sequence, read from the mean of the final hidden states (``answers`` ``(N, 1)``).
    The run spec sets ``model.head`` from it."""
    patch_dim: int | None = None
    """None: the inputs are token ids; F: they are ``Batch.features`` of F floats per token,
    embedded by the model's patch embedding (the run spec sets ``model.patch_dim``)."""
    TESTS: tuple[str, ...] = (STANDARD,)
    """The test sets the task can generate (``task.tests`` picks among them); their order fixes
    their random streams (never reorder). The first is the reference test: the default of
    ``task.tests`` and the one the learnt-at-C gate reads (the standard one, but for tasks
    without one)."""
    PAIRED_TESTS: tuple[str, ...] = (STANDARD,)
    """The test sets ``tasks_paired.md`` compares methods on."""
    TEST_NOTES: dict[str, str] = {}
    """What each test set measures, one line under its heading in ``tasks.md`` (a test set
    without a note is shown by its name)."""
    AXES: dict[str, str] = {}
    """The answer axes of :meth:`answer_axes` that the tables report, name -> how ``tasks.md``
    names it: each gets a summary row beside the baselines and a table of accuracy by its bands
    (``by_<name>``). An axis the task computes but leaves out here is stored in results.json only."""
    LEARNT_AT_C: float = 0.9
    """Default of ``task.learnt_at_c``: the accuracy at C on the standard test that a run must
    reach to count as having learnt the task (else it is never averaged into a claim past C)."""

    def __init__(self, context: int, *, seed: int = 0, tests: Any = None, learnt_at_c: Any = None) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:  # numpy seeds are >= 0
            raise PosbenchError(f"task.seed must be an integer >= 0, got {seed!r}")
        self.context, self.seed = context, seed
        # the reference test alone unless asked (configs/task/*.yaml ask for every test set)
        self.tests = self.TESTS[:1] if tests is None else tuple(tests) if isinstance(tests, (list, tuple)) else (tests,)
        unknown = [t for t in self.tests if t not in self.TESTS]
        if unknown or not self.tests or len(set(self.tests)) < len(self.tests):
            raise PosbenchError(f"task.tests={list(self.tests)!r}: choose distinct test sets among "
                                f"{', '.join(self.TESTS)} (task={self.name})")
        threshold = self.LEARNT_AT_C if learnt_at_c is None else learnt_at_c
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise PosbenchError(f"task.learnt_at_c={learnt_at_c!r} must be an accuracy in [0, 1], e.g. 0.9")
        self.learnt_at_c = float(threshold)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        """``n`` sequences of ``length`` inputs (``length + 1`` tokens). ``split`` is ``train``
        or ``test`` (tasks whose test distribution differs from training read it)."""
        raise NotImplementedError

    def chance(self) -> float:
        """Accuracy of a uniform guess among the answer tokens (a reference line)."""
        raise NotImplementedError

    def sequences(self, stream: int, length: int, n: int, test: str = STANDARD) -> Batch:
        """The fixed held-out sequences of ``stream`` (VALID or TEST) at ``length``; ``test``
        names a test set of ``TESTS`` (seed words ``[task.seed, stream, length, its index]``;
        the standard one keeps ``[task.seed, stream, length]``)."""
        split = "train" if stream == TRAIN else "test"
        if test == STANDARD:
            return self.generate(np.random.default_rng([self.seed, stream, length]), n, length, split)
        rng = np.random.default_rng([self.seed, stream, length, self.TESTS.index(test)])
        return self.test_batch(rng, n, length, test)

    def test_batch(self, rng: np.random.Generator, n: int, length: int, test: str) -> Batch:
        """``n`` sequences of the test set ``test`` (one of ``TESTS`` other than the standard)."""
        raise NotImplementedError

    def answer_axes(self, batch: Batch) -> dict[str, np.ndarray]:
        """Per answer, the quantities besides position that an answer's accuracy is reported by
        (``(N, L)`` int arrays read where ``batch.answers`` is set), e.g. ``lookback``; the tables
        show those :attr:`AXES` names."""
        return {}

    def axis_bands(self, axis: str, length: int) -> list[tuple[int, int]]:
        """The bands ``[a, b)`` an answer axis is reported by at ``length`` (:func:`lookback_bands`)."""
        return lookback_bands(length, self.context)

    def position_bands(self, length: int) -> dict[str, np.ndarray] | None:
        """The bands results.json's ``by_position`` reports answers by at ``length``: band name ->
        ``(L,)`` bool mask of the targets in it. None (sequence tasks): the target position's bands
        0-C, C-2C, 2C-4C, ... (:func:`posbench.evaluation.curves.band_edges`); a grid task's are rings."""
        return None

    def baselines(self, batch: Batch) -> dict[str, np.ndarray]:
        """Per answer, the expected correctness ``(N, L)`` of guesses a model could make without
        solving the task: ``chance`` and the task's shortcuts."""
        return {"chance": np.full(batch.answers.shape, self.chance())}

    def baseline_accuracy(self, batch: Batch) -> dict[str, float | None]:
        """Each :meth:`baselines` guess's accuracy on ``batch``, averaged as a model's is: the mean
        over sequences (with at least one answer) of the mean over their answers."""
        answers = batch.answers
        counts = answers.sum(axis=1)
        rows = counts > 0
        return {name: float(((hits * answers).sum(axis=1)[rows] / counts[rows]).mean()) if rows.any() else None
                for name, hits in self.baselines(batch).items()}

    def train_batch(self, run_seed: int, step: int, batch_size: int) -> Batch:
        """The global training batch of ``step`` (length C)."""
        return self.generate(np.random.default_rng([self.seed, TRAIN, run_seed, step]), batch_size,
                             self.context, "train")

    def check_length(self, length: int) -> None:
        """Refuse an evaluation length the task cannot fill (one line)."""

    def extrapolation_length(self) -> int:
        """The length of the in-training validation set past C (``val_accuracy_<C>_<this>``): 2C."""
        return 2 * self.context

    def beyond_context(self, length: int) -> np.ndarray:
        """(L,) bool (an answer slot per target; ``(1,)`` for a pooled answer): the targets of a
        ``length``-long sequence that lie past the training context (positions >= C), those the
        in-training ``val_accuracy_<C>_<2C>`` reads."""
        return np.arange(length) >= self.context

    def check_sizes(self, sizes: dict[str, int]) -> None:
        """Refuse held-out sets larger than the task can fill (one line): ``sizes`` maps each
        setting (``eval.num_sequences``, ``trainer.val_sequences``, ...) to its count. A generated
        task fills any; an image task has as many images as its split."""

    @classmethod
    def length_note(cls, length: int, options: dict[str, Any]) -> str:
        """Shown after a length's name in the tables (an image task: its size in pixels)."""
        return ""

    def check_lengths(self, lengths: Sequence[int]) -> None:
        """Refuse evaluation ``lengths`` before any work, naming at once what all of them need."""
        for length in lengths:
            self.check_length(length)


def lookback_bands(length: int, context: int) -> list[tuple[int, int]]:
    """The bands ``[a, b)`` that lookbacks at ``length`` are drawn and reported in: 0-C, C-2C,
    2C-4C, ... (the edges of :func:`posbench.evaluation.curves.band_edges`) and the rest up to ``length``."""
    edges = [0, min(context, length)]
    while edges[-1] * 2 <= length:
        edges.append(edges[-1] * 2)
    if edges[-1] < length:
        edges.append(length)
    return list(itertools.pairwise(edges))


def answer_share(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """The fraction of the answer targets of ``whole`` (targets, IGNORE off the answers) that lie
    in ``part`` (a micro-batch of it): weighting each micro-batch's mean loss by it makes the
    sum the mean over every answer of the batch, whatever the micro-batching (no device sync)."""
    return part.ne(IGNORE).sum() / whole.ne(IGNORE).sum().clamp(min=1)


def positive_int(task: str, name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PosbenchError(f"task.{name}={value!r} must be an integer >= {minimum} (task={task})")
    return value


def make_task(section: Any, context: int) -> Task:
    """``task`` config section (``{name, <options>}``) -> the task, validated."""
    from omegaconf import DictConfig, OmegaConf

    values = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)
    name = values.pop("name", None)
    if name not in _TASKS:
        raise PosbenchError(f"unknown task {name!r}; choose one of: {', '.join(_TASKS)} (task=<name>)")
    cls = _TASKS[name]
    try:
        return cls(context, **values)
    except TypeError as err:
        import inspect

        valid = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "context")]
        raise PosbenchError(f"task={name}: {err}; valid options: {', '.join(valid)}") from None


class TaskBatches:
    """The training loop's batches for a task: ``get(step)`` -> ``(x, y)`` on the device, a pure
    function of (task seed, run seed, step) like :class:`posbench.data.loader.TrainBatches`;
    rank ``r`` of ``world_size`` takes rows ``r::world_size`` of the global batch."""

    def __init__(self, task: Task, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 device: torch.device | None = None) -> None:
        if batch_size % world_size:
            raise PosbenchError(f"batch_size={batch_size} is not divisible by world_size={world_size}; "
                                f"use a multiple of {world_size}")
        self.task, self.batch_size, self.seed = task, batch_size, seed
        self.rank, self.world_size, self.device = rank, world_size, device

    steps_per_epoch = 1
    """Data is generated afresh every step: an "epoch" is one step (trainer.max_steps sets the length)."""

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.task.train_batch(self.seed, step, self.batch_size).inputs_targets()  # (B, C) each
        x, y = x[self.rank::self.world_size], y[self.rank::self.world_size]
        if self.device is not None and self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y


__all__ = ["Batch", "EVALUATION_OPTIONS", "IGNORE", "STANDARD", "Task", "TaskBatches", "TEST", "TRAIN", "VALID", "answer_share", "list_tasks",
           "lookback_bands", "make_task", "positive_int", "register_task", "task_class",
           "unregister_task"]
