"""What a run trains on and is scored on: the training half of each kind of run.

The trainer asks its workload for everything that differs between kinds, so
:mod:`posbench.train.trainer` never branches on the kind of run; ``posbench eval`` asks a saved
run's workload class (:func:`saved_workload`). The kinds are one registry
(:mod:`posbench.runs.kinds`), whose report halves are :mod:`posbench.report.kinds`; this module
attaches the built-in kinds' training halves: :class:`TextWorkload` (``text``) and
:class:`posbench.train.task_workload.TaskWorkload` (``task``), both following :class:`Workload`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import nn

from posbench.core.paths import recorded_path
from posbench.data import PreparedData, prepare_data
from posbench.data.loader import TrainBatches
from posbench.data.retrieval import RetrievalConfig, make_inserter
from posbench.evaluation.loss import evaluate_run, headline, per_position_loss, validation_sets
from posbench.runs.kinds import TASK, TEXT, config_kind, get_run_kind, register_run_kind
from posbench.runs.load import run_data
from posbench.runs.results_types import EvaluatedRun, Results
from posbench.runs.resume import data_identity
from posbench.train.task_workload import TaskWorkload


class Workload(Protocol):
    """The data side of a run, as the trainer uses it."""

    @classmethod
    def from_spec(cls, spec: Any, log: Callable[[str], None]) -> Workload:
        """The workload of ``spec`` (a :class:`posbench.runs.spec.RunSpec` of this kind)."""

    @property
    def text(self) -> PreparedData | None:
        """Held-out text for the probes (``eval.probes``); None where there is none."""

    @property
    def data_dir(self) -> str | None:
        """The token cache a checkpoint records (None: generated data)."""

    @property
    def vocab_size(self) -> int: ...

    def train_batches(self, t: Any, seed: int, rank: int, world_size: int, device: torch.device) -> Any:
        """``get(step) -> (x, y)`` on the device and ``steps_per_epoch``."""

    def micro_loss(self, loss: torch.Tensor, part: torch.Tensor, whole: torch.Tensor, accum: int) -> torch.Tensor:
        """A micro-batch's loss as its term of the global batch's loss (``part``: its targets,
        ``whole``: the batch's; the trainer sums the terms of ``accum`` micro-batches)."""

    def validation_sets(self, model: nn.Module, t: Any, log: Callable[[str], None]) -> dict[str, Any]:
        """The fixed in-training validation sets, by name."""

    def validation_row(self, model: nn.Module, sets: dict[str, Any], context: int, batch_size: int,
                       device: torch.device, amp_dtype: torch.dtype | None) -> dict[str, float]:
        """metrics.jsonl values of one validation (``val_loss`` always among them)."""

    def identity(self) -> dict[str, str]:
        """What the training data is, for the resume check."""

    def evaluate(self, model: nn.Module, spec: Any, device: torch.device, amp_dtype: torch.dtype | None,
                 log: Callable[[str], None]) -> EvaluatedRun:
        """The final evaluation: the top part of results.json."""

    def record(self) -> dict[str, Any]:
        """results.json's ``data``."""

    def summary(self, results: Results) -> dict[str, float]:
        """Summary values for the logger (W&B)."""

    def done_line(self, results: Results, context: int) -> str:
        """The run's last log line, after ``done: <results.json>;``."""

    @staticmethod
    def check_reevaluation(run: Any) -> None:
        """Refuse (one line) what ``posbench eval`` cannot add to a saved run of this kind."""

    @staticmethod
    def saved_data(run: Any, log: Callable[[str], None]) -> PreparedData | None:
        """A saved run's own data for ``posbench eval`` (None: generated data)."""


class TextWorkload:
    """A text run: windows of a tokenized corpus (:class:`posbench.data.PreparedData`), scored by
    the loss at every position (:mod:`posbench.evaluation.loss`)."""

    def __init__(self, prepared: PreparedData, retrieval: RetrievalConfig | None = None) -> None:
        self.text = prepared
        self.data_dir = str(prepared.dir)
        self.retrieval = retrieval or RetrievalConfig()  # data.retrieval: inserted into training windows only

    @classmethod
    def from_spec(cls, spec: Any, log: Callable[[str], None]) -> TextWorkload:
        """The prepared text of ``data`` (tokenized once into the token cache)."""
        return cls(prepare_data(spec.data, log=log), spec.data.retrieval)

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    def train_batches(self, t: Any, seed: int, rank: int, world_size: int, device: torch.device) -> TrainBatches:
        # One pinned host buffer per step, copied without blocking (no per-token Python work).
        return TrainBatches(self.text.train_tokens(), t.context, t.batch_size, seed, rank=rank,
                            world_size=world_size, device=device, pin_memory=device.type == "cuda",
                            insert=make_inserter(self.retrieval, t.context, self.text, seed),
                            streams=t.state_passing == "carry")

    def micro_loss(self, loss: torch.Tensor, part: torch.Tensor, whole: torch.Tensor, accum: int) -> torch.Tensor:
        return loss  # every target counts: equal micro-batches hold equal numbers of them

    def validation_sets(self, model: nn.Module, t: Any, log: Callable[[str], None]) -> dict[str, torch.Tensor]:
        return validation_sets(self.text, model, t, log)

    def validation_row(self, model: nn.Module, sets: dict[str, torch.Tensor], context: int, batch_size: int,
                       device: torch.device, amp_dtype: torch.dtype | None) -> dict[str, float]:
        """``val_loss`` at C and ``val_loss_<C>_<2C>`` on the C-2C band, with the fp32-head
        evaluator, so val_loss is comparable with results.json's 0-C band."""
        row = {}
        for name, sequences in sets.items():
            losses = per_position_loss(model, sequences, batch_size, device, autocast_dtype=amp_dtype)
            row[name] = float(losses.mean() if name == "val_loss" else losses[context:2 * context].mean())
        return row

    def identity(self) -> dict[str, str]:
        # data.retrieval changes the training windows: a resume must keep it (off or its settings).
        shown = str(sorted(self.retrieval.to_dict().items())) if self.retrieval.active else "off"
        return {**data_identity(self.text), "retrieval": shown}

    def evaluate(self, model: nn.Module, spec: Any, device: torch.device, amp_dtype: torch.dtype | None,
                 log: Callable[[str], None]) -> EvaluatedRun:
        return evaluate_run(model, self.text, spec, device, amp_dtype, log)

    def record(self) -> dict[str, Any]:
        """results.json's ``data``: the token cache (relative to the repository, or from ``~``:
        no absolute path of this machine), its meta, and data.retrieval when it is on."""
        shown = recorded_path(self.text.dir)
        if not self.retrieval.active:
            return {"dir": shown, "meta": self.text.meta}
        return {"dir": shown, "meta": self.text.meta, "retrieval": self.retrieval.to_dict()}

    def summary(self, results: Results) -> dict[str, float]:
        return {}

    def done_line(self, results: Results, context: int) -> str:
        band = f"{context}-{2 * context}"
        return f"{band} loss {headline(results, band):.4f}"

    @staticmethod
    def check_reevaluation(run: Any) -> None:
        """``posbench eval`` adds entries to any finished text run."""

    @staticmethod
    def saved_data(run: Any, log: Callable[[str], None]) -> PreparedData:
        """A saved run's own data, for ``posbench eval`` (:func:`posbench.runs.load.run_data`)."""
        return run_data(run, log)


register_run_kind(TEXT, workload=TextWorkload)
register_run_kind(TASK, workload=TaskWorkload)


def saved_workload(config: Any) -> Any:
    """The workload class of a saved run, from its recorded config (its kind,
    :func:`posbench.runs.kinds.config_kind`): what ``posbench eval`` may do with it
    (``check_reevaluation``) and its data (``saved_data``)."""
    return get_run_kind(config_kind(config)).workload


def make_workload(spec: Any, log: Callable[[str], None]) -> Workload:
    """``spec`` (a :class:`posbench.runs.spec.RunSpec`) -> the workload of its kind: the task's
    generator for a task run (no token cache), the prepared text of ``data`` for a text run."""
    return get_run_kind(spec.kind).workload.from_spec(spec, log)


__all__ = ["TextWorkload", "Workload", "make_workload", "saved_workload"]
