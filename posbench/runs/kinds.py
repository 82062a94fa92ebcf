"""The kinds of run: one registry, each kind with a training half and a report half.

A run's kind is a name: ``text`` (a token cache, scored by the loss at every position) or ``task``
(a synthetic task, scored by accuracy on its answers), or a kind a plug-in registers. It is chosen
once, from the run's config (:func:`config_kind`: the ``kind`` key, else ``task`` for
``task=<name>`` and ``text`` otherwise), and recorded in the run's ``config.yaml``, checkpoints and
``results.json`` (``kind``); a record from before the key is read by the same rule
(:func:`results_kind`: ``task`` when results.json holds a task).

Each :class:`RunKind` is filled in by the layers above: its training half ``workload`` (a
:class:`posbench.train.workload.Workload` class, attached by :mod:`posbench.train.workload` and
:mod:`posbench.train.task_workload`) and its report half ``report`` (a
:class:`posbench.report.kinds.ReportKind`, attached by :mod:`posbench.report.kinds`). The trainer,
``posbench eval``, ``posbench plot`` and the sweep summary ask the registry, never branch on the kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posbench.core.errors import PosbenchError

TEXT, TASK = "text", "task"


@dataclass
class RunKind:
    """One kind of run: its name and its two halves (None until their layer is imported)."""

    name: str
    workload: Any = None
    """The training half: a Workload class (``from_spec(spec, log)``, ``check_reevaluation``, ``saved_data``)."""
    report: Any = None
    """The report half: its comparison, a run's own figures, its part of a sweep's summary."""


RUN_KINDS: dict[str, RunKind] = {TEXT: RunKind(TEXT), TASK: RunKind(TASK)}
"""Every kind, in the order reports show them."""


def register_run_kind(name: str, *, workload: Any = None, report: Any = None) -> RunKind:
    """The kind ``name`` (added after the others when new), with the halves given attached."""
    kind = RUN_KINDS.setdefault(name, RunKind(name))
    if workload is not None:
        kind.workload = workload
    if report is not None:
        kind.report = report
    return kind


def unregister_run_kind(name: str) -> None:
    """Remove kind ``name`` (tests that register a throwaway kind); the built-in ones stay."""
    if name not in (TEXT, TASK):
        RUN_KINDS.pop(name, None)


def get_run_kind(name: str) -> RunKind:
    """The kind called ``name``; one line naming the known kinds otherwise."""
    if name not in RUN_KINDS:
        raise PosbenchError(f"unknown kind {name!r}; choose one of: {', '.join(RUN_KINDS)} (kind=<name>, or null)")
    return RUN_KINDS[name]


def config_kind(config: Any) -> str:
    """The kind of a run config (the composed one, or a saved run's): its ``kind``, else ``task``
    for a ``task=<name>`` run and ``text`` otherwise (configs from before the key)."""
    named = config.get("kind")
    if named:
        return str(get_run_kind(str(named)).name)
    return TASK if config.get("task") is not None else TEXT


def results_kind(results: Any) -> str:
    """The kind of a run from its results.json: its ``kind``, else ``task`` when it holds a task
    (files from before the key)."""
    named = results.get("kind")
    if named:
        return str(named)
    return TASK if "task" in results else TEXT


__all__ = ["RUN_KINDS", "RunKind", "TASK", "TEXT", "config_kind", "get_run_kind", "register_run_kind", "results_kind",
           "unregister_run_kind"]
