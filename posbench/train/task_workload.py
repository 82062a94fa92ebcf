"""A task run's workload (:class:`posbench.train.workload.Workload`): generated batches, answer-only
validation and the accuracy evaluation, in place of a token cache (docs/tasks.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from posbench.core.errors import PosbenchError
from posbench.evaluation.tasks import task_results, task_summary, validation_batches, validation_metrics
from posbench.runs.results_types import EvaluatedRun, Results
from posbench.tasks.base import EVALUATION_OPTIONS, Task, TaskBatches, answer_share

DATA_OPTIONS_BEFORE = {"shifted_training": False}
"""Data options added after runs were made, with the value those runs had: a run's resume identity
leaves them out at that value, so a checkpoint made before the option existed still resumes."""


@dataclass
class TaskWorkload:
    """What a task run trains on, is validated and scored on, records and checks on resume."""

    task: Task
    options: dict[str, Any] = field(default_factory=dict)

    text = None
    """No held-out text: the text probes (``eval.probes``) are refused for task runs."""

    data_dir = None
    """No token cache: checkpoints record ``data_dir: null``."""

    @classmethod
    def from_spec(cls, spec: Any, log: Callable[[str], None]) -> TaskWorkload:
        """The task's generator (no token cache)."""
        return cls(spec.task, spec.task_options)

    @property
    def vocab_size(self) -> int:
        return self.task.vocab_size

    def train_batches(self, t: Any, seed: int, rank: int, world_size: int, device: torch.device) -> TaskBatches:
        """Generated afresh each step, a pure function of (task seed, run seed, step)."""
        return TaskBatches(self.task, t.batch_size, seed, rank=rank, world_size=world_size, device=device)

    def micro_loss(self, loss: torch.Tensor, part: torch.Tensor, whole: torch.Tensor, accum: int) -> torch.Tensor:
        """Micro-batches hold unequal numbers of answers: weight each by its share, so the sum is
        the batch's mean over answers (not a mean of means)."""
        return loss * (accum * answer_share(part, whole)) if accum > 1 else loss

    def validation_sets(self, model: nn.Module, t: Any, log: Callable[[str], None]) -> dict[str, Any]:
        """As the text runs': the set past C is left out (with a note) where the method's
        positions stop before its length, instead of failing at the first validation."""
        extrapolation = t.val_extrapolation_sequences
        length, limit = self.task.extrapolation_length(), model.position.max_positions
        if extrapolation and limit is not None and length > limit:
            log(f"note: no val_accuracy_{t.context}_{length} during training: the method's positions stop at "
                f"{limit} ({model.position.length_fix(length)})")
            extrapolation = 0
        return validation_batches(self.task, t.context, t.val_sequences, extrapolation)

    def validation_row(self, model: nn.Module, sets: dict[str, Any], context: int, batch_size: int,
                       device: torch.device, amp_dtype: torch.dtype | None) -> dict[str, float]:
        """Answers only: loss and accuracy at C, accuracy past C."""
        return validation_metrics(model, self.task, sets, context, batch_size, device, amp_dtype)

    def identity(self) -> dict[str, str]:
        """Resume check: the task and the options that set its data (not the evaluation's)."""
        options = {k: v for k, v in self.options.items() if k not in EVALUATION_OPTIONS
                   and not (k in DATA_OPTIONS_BEFORE and v == DATA_OPTIONS_BEFORE[k])}
        return {"task": f"{self.task.name}:{sorted(options.items())}"}

    def evaluate(self, model: nn.Module, spec: Any, device: torch.device, amp_dtype: torch.dtype | None,
                 log: Callable[[str], None]) -> EvaluatedRun:
        """Accuracy on the task's answers by length (results["task"]); no loss curves."""
        return task_results(model, spec, device, amp_dtype, log)

    def record(self) -> dict[str, Any]:
        """results.json's ``data`` for a task run."""
        return {"dir": None, "meta": {"task": self.task.name, "options": self.options,
                                      "vocab": list(self.task.vocab)}}

    def summary(self, results: Results) -> dict[str, float]:
        return task_summary(results)

    def done_line(self, results: Results, context: int) -> str:
        return "accuracy by length " + ", ".join(
            f"{k.rsplit('/', 1)[-1]}: {v:.3f}" for k, v in task_summary(results).items())

    @staticmethod
    def check_reevaluation(run: Any) -> None:
        """``posbench eval`` adds entries to text runs only (a task run with a damaged results.json
        is finished instead)."""
        raise PosbenchError(f"{run.path} is a task run (task={run.config.task.name}): posbench eval adds entries to "
                            "text runs only; its test accuracy is measured at the end of training (set eval.lengths / "
                            "eval.extension when training it, docs/tasks.md)")

    @staticmethod
    def saved_data(run: Any, log: Callable[[str], None]) -> None:
        """No token cache: a task generates its data."""
        return None


__all__ = ["TaskWorkload"]
