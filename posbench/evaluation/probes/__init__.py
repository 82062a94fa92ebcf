"""The probe registry: zero-shot measurements of a trained text model, run by ``eval.probes``.

A probe is one module in this package: a :class:`Probe` subclass decorated with
:func:`register_probe`, with its settings as a typed dataclass in the same module (read from the
``eval.<name>`` config section, which registering the probe adds to the eval config:
:data:`posbench.evaluation.settings.PROBE_SETTINGS`). Every module here is imported, and so registered, with the
package, alphabetically. The trainer (at the end of training) and ``posbench eval`` run the probes that
``eval.probes`` names through :func:`run_probes`, store each probe's entries under its
``results_key`` in results.json, merge re-evaluated entries with :meth:`Probe.merge` and log
:meth:`Probe.summary` to the tracker. See docs/adding-a-probe.md.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError
from posbench.evaluation.probes.merge import merge_probe_entries
from posbench.evaluation.settings import PROBE_SETTINGS
from posbench.runs.results_types import Results


@dataclass(frozen=True)
class ProbeRun:
    """What every probe is run with, beside its own settings: the run's training context, the
    evaluation's batch size, device and precision, and the extensions to measure under."""

    train_context: int
    batch_size: int = 16
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    autocast_dtype: torch.dtype | None = None
    extensions: Sequence[str] = ("none",)
    extension_factor: float | None = None
    extension_settings: dict[str, Any] | None = None
    log: Callable[[str], Any] = print

    @classmethod
    def of(cls, evaluation: Any, train_context: int, device: str | torch.device = "cpu",
           autocast_dtype: torch.dtype | None = None, log: Callable[[str], Any] = print) -> ProbeRun:
        """From an :class:`posbench.evaluation.settings.EvalConfig` (its extensions already resolved)."""
        return cls(train_context, evaluation.batch_size, torch.device(device), autocast_dtype,
                   tuple(evaluation.extension), evaluation.extension_factor, evaluation.extension_options(), log)


class Probe:
    """One probe. Subclasses set ``name`` (its ``eval.probes`` entry and ``eval.<name>`` section),
    ``settings`` (its settings dataclass: every field with its default, a ``validate()`` method
    raising :class:`PosbenchError`) and ``results_key`` (its results.json key), and override
    :meth:`run`; :meth:`check`, :meth:`merge` and :meth:`summary` have defaults, ``report`` is optional."""

    name: str = ""
    description: str = ""
    """One line for listings (docs/configuration.md's ``eval.probes`` row is generated from it)."""
    settings: type = object
    results_key: str = ""
    report: str | None = None
    """The module of ``posbench/report/`` that draws its figures (optional), by name: it defines
    ``compare_figures(runs, out_dir, formats, log) -> [paths]`` (``posbench plot``, across runs)
    and/or ``run_figures(results, out_dir, formats, title) -> [paths]`` (a run's ``figures/``)."""

    def check(self, settings: Any, train_context: int) -> None:
        """Refuse settings that cannot run at ``train_context``, before any work (default: none)."""

    def check_positions(self, settings: Any, max_positions: int) -> None:
        """Refuse settings that leave nothing to measure on a model whose positions stop at
        ``max_positions`` (a ``learned`` table), before any training or evaluation (default: none)."""

    def run(self, model: nn.Module, data: Any, settings: Any, run: ProbeRun) -> list[dict[str, Any]]:
        """The probe's results.json entries (one per extension of ``run.extensions``) on
        ``model``; ``data`` is the run's :class:`posbench.data.PreparedData` (held-out splits,
        vocabulary, tokenizer)."""
        raise NotImplementedError

    def merge(self, old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]], replace: bool,
              log: Callable[[str], Any], recorded: dict[str, Any] | None) -> list[dict[str, Any]]:
        """``posbench eval``'s entries ``new`` merged into the run's ``old`` ones
        (:func:`posbench.evaluation.probes.merge.merge_probe_entries`)."""
        return merge_probe_entries(old, new, replace, log, recorded)

    def summary(self, entries: Sequence[dict[str, Any]]) -> dict[str, float]:
        """Flat scalars of the run's own entries for the tracker's run summary (default: none)."""
        return {}


PROBES: dict[str, Probe] = {}


def register_probe(cls: type[Probe]) -> type[Probe]:
    """Class decorator: register ``cls`` (one instance) under ``cls.name``."""
    if not cls.name or not cls.results_key:
        raise ValueError(f"probe {cls.__name__} needs a name and a results_key")
    if cls.name in PROBES and type(PROBES[cls.name]) is not cls:
        raise ValueError(f"probe {cls.name!r} is already registered")
    PROBES[cls.name] = cls()
    PROBE_SETTINGS[cls.name] = cls.settings  # eval.<name>: a section of the eval config
    return cls


def unregister_probe(name: str) -> None:
    """Remove probe ``name`` (tests that register a throwaway probe)."""
    PROBES.pop(name, None)
    PROBE_SETTINGS.pop(name, None)


def list_probes() -> list[str]:
    """Registered probe names, in registration order (the order they run and are stored in)."""
    return list(PROBES)


def get_probe(name: str) -> Probe:
    """The probe called ``name``; one-line error listing the valid names otherwise."""
    if name not in PROBES:
        raise PosbenchError(f"unknown eval.probes entry {name!r}; choose from {', '.join(PROBES)}")
    return PROBES[name]


def probe_settings(evaluation: Any, name: str) -> Any:
    """Probe ``name``'s settings in ``evaluation`` (an :class:`posbench.evaluation.settings.EvalConfig`):
    its ``eval.<name>`` section, built and validated with the eval section (or now, when it was
    given before the probe was registered), else the defaults of its settings dataclass."""
    probe = get_probe(name)
    section = evaluation.section(name)
    if section is None or isinstance(section, dict):
        section = from_section(probe.settings, f"eval.{name}", section or {})
    if not isinstance(section, probe.settings):
        raise PosbenchError(f"eval.{name} must be a mapping of {name} probe settings, got {section!r}")
    return section


def configure_probes(evaluation: Any, train_context: int, max_positions: int | None = None) -> None:
    """Check ``evaluation.probes`` (an :class:`posbench.evaluation.settings.EvalConfig`) and refuse the
    asked-for probes' settings that cannot run at ``train_context`` (or, given the model's
    ``max_positions``, on its positions): before any work. Nothing is changed: the settings were
    validated when the eval section was built."""
    if not isinstance(evaluation.probes, list) or not all(isinstance(n, str) for n in evaluation.probes):
        raise PosbenchError(f"eval.probes must be a list of probe names, got {evaluation.probes!r}")
    for name in evaluation.probes:
        get_probe(name)  # an unknown name is refused first, with the valid ones
    unknown = sorted(set(evaluation.probe_settings) - set(PROBES))
    if unknown:
        raise PosbenchError(f"unknown option(s) {', '.join(f'eval.{n}' for n in unknown)}: not a probe's section; "
                            f"the probes are {', '.join(PROBES)}")
    for name in evaluation.probe_settings:
        probe_settings(evaluation, name)  # every probe section given is valid, asked for or not
    for name in evaluation.probes:
        PROBES[name].check(probe_settings(evaluation, name), train_context)
        if max_positions is not None:
            PROBES[name].check_positions(probe_settings(evaluation, name), max_positions)


def asked(evaluation: Any) -> list[Probe]:
    """The probes ``evaluation.probes`` names, in registration order."""
    return [probe for name, probe in PROBES.items() if name in evaluation.probes]


def run_probes(model: nn.Module, data: Any, evaluation: Any, run: ProbeRun) -> dict[str, list[dict[str, Any]]]:
    """Every probe ``evaluation.probes`` names (configured by :func:`configure_probes`) on
    ``model``: ``{results_key: entries}``, only for probes that wrote some."""
    out = {}
    for probe in asked(evaluation):
        entries = probe.run(model, data, probe_settings(evaluation, probe.name), run)
        if entries:
            out[probe.results_key] = entries
    return out


def merge_probe_results(results: Results, new: dict[str, list[dict[str, Any]]], replace: bool,
                        log: Callable[[str], Any], recorded: dict[str, Any] | None) -> None:
    """Merge :func:`run_probes`' ``new`` entries into ``results`` (a run's results.json), probe by probe."""
    for probe in PROBES.values():
        if probe.results_key in new:
            results[probe.results_key] = probe.merge(results.get(probe.results_key, []), new[probe.results_key],
                                                     replace, log, recorded)


def probe_summaries(results: Results) -> dict[str, float]:
    """Every registered probe's :meth:`Probe.summary` of its entries in ``results``."""
    out: dict[str, float] = {}
    for probe in PROBES.values():
        out.update(probe.summary(results.get(probe.results_key, [])))
    return out


# Every module of this package, alphabetically (so the probes run and are stored in that order):
# each probe module registers its probe.
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["PROBES", "Probe", "ProbeRun", "asked", "configure_probes", "get_probe", "list_probes",
           "merge_probe_results", "probe_settings", "probe_summaries", "register_probe", "run_probes", "unregister_probe"]
