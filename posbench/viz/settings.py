"""The ``posbench viz`` settings: typed and documented, their defaults written once here (Hydra's
ConfigStore holds them as ``viz_settings``, which ``configs/viz.yaml`` composes; docs/configuration.md's
viz table is generated from these classes).

The sections are ``attention.*`` and ``decay.*``, each built with
:func:`posbench.config.settings.from_section`, so an unknown key or a value of the wrong type is
one line naming the key. A layer-1 module: the checks that need the extension menu and the figure
formats are :mod:`posbench.viz.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError


def _positive_integers(section: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PosbenchError(f"viz {section}{name} must be a positive integer, got {value!r}")


@dataclass
class AttentionSettings:
    """The attention of a trained run (``attention.*``)."""

    length_factor: int = 2
    """Attention is measured on held-out windows of length_factor x C (2 or 4)."""
    num_sequences: int = 4
    """Held-out windows averaged for entropy, distance and score terms."""
    layers: list[int] = field(default_factory=lambda: [0, -1])
    """Layers whose per-head attention maps are drawn (negative: from the end)."""
    split: str = "validation"
    """The held-out split the windows come from (a task run: validation or test)."""

    def validate(self) -> None:
        _positive_integers("attention.", self, "length_factor", "num_sequences")
        if any(isinstance(layer, bool) or not isinstance(layer, int) for layer in self.layers):
            raise PosbenchError(f"attention.layers must be layer numbers (negative: from the end), got {self.layers}")


@dataclass
class DecaySettings:
    """The long-term decay figure (``decay.*``)."""

    bases: list[float] = field(default_factory=lambda: [10000.0, 500000.0])
    """RoPE bases drawn in the long-term decay figure (the method's own too)."""
    rules: list[str] = field(default_factory=list)
    """Evaluation-time extensions drawn too (those that apply to the method): names of the
    ``eval.extension`` menu, e.g. ``[linear, ntk, yarn]`` (docs/context-extension.md)."""

    def validate(self) -> None:
        if any(isinstance(base, bool) or not isinstance(base, (int, float)) or base <= 0 for base in self.bases):
            raise PosbenchError(f"decay.bases must be positive numbers, got {self.bases}")
        self.bases = [float(base) for base in self.bases]
        self.rules = [str(rule) for rule in self.rules]  # names checked by posbench.viz.checks


@dataclass
class VizSettings:
    """The ``posbench viz`` options that shape the figures (the others, ``run``, ``out``, ``method``,
    ``model``, ``device``, ``wandb``, ``debug``: configs/viz.yaml)."""

    context: int = 256
    """The training context C marked in method=<name> figures (a run uses its own)."""
    span: int = 4
    """Distance / position axes of the signal figures run from 0 to span x C; a grid run's
    pictures are drawn at the training side doubled up to span x the side."""
    formats: list[str] = field(default_factory=lambda: ["png"])
    """Figure formats: any of png, pdf, svg."""
    attention: AttentionSettings = field(default_factory=AttentionSettings)
    """The attention of a trained run (:class:`AttentionSettings`)."""
    decay: DecaySettings = field(default_factory=DecaySettings)
    """The long-term decay figure (:class:`DecaySettings`)."""

    def validate(self) -> VizSettings:
        """Ranges and sections (the format names and decay rules: :mod:`posbench.viz.checks`)."""
        _positive_integers("", self, "context", "span")
        for name, section in (("attention", AttentionSettings), ("decay", DecaySettings)):
            value = getattr(self, name)
            if not isinstance(value, section):
                if not isinstance(value, dict):
                    raise PosbenchError(f"{name} must be a mapping of settings, got {value!r}")
                setattr(self, name, from_section(section, name, value))
            else:
                value.validate()
        return self

    def in_context(self, context: int) -> VizSettings:
        """The same settings with the training context of a run."""
        return replace(self, context=context)


__all__ = ["AttentionSettings", "DecaySettings", "VizSettings"]
