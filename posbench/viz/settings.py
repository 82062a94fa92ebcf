"""The ``posbench viz`` settings: typed, documented, validated (configs/viz.yaml holds the defaults).

The sections mirror the YAML (``attention.*``, ``decay.*``), each built with
:func:`posbench.config.settings.from_section`, so an unknown key or a value of the wrong type is
one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError
from posbench.model.extension import EXTENSIONS
from posbench.report.figures import check_formats


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
    """Evaluation-time extensions drawn too (those that apply to the method; any of
    :data:`posbench.model.extension.EXTENSIONS`)."""

    def validate(self) -> None:
        if any(isinstance(base, bool) or not isinstance(base, (int, float)) or base <= 0 for base in self.bases):
            raise PosbenchError(f"decay.bases must be positive numbers, got {self.bases}")
        self.bases = [float(base) for base in self.bases]
        self.rules = [str(rule) for rule in self.rules]
        for rule in self.rules:
            if rule not in EXTENSIONS:
                raise PosbenchError(f"unknown decay rule {rule!r}; choose from the extensions "
                                    f"{', '.join(EXTENSIONS)} (decay.rules=[...])")


@dataclass
class VizSettings:
    """The ``posbench viz`` options that shape the figures (see configs/viz.yaml)."""

    context: int = 256
    """The training context C marked in method=<name> figures (a run uses its own)."""
    span: int = 4
    """Distance / position axes of the signal figures run from 0 to span x C."""
    formats: list[str] = field(default_factory=lambda: ["png"])
    """Figure formats: any of png, pdf, svg."""
    attention: AttentionSettings = field(default_factory=AttentionSettings)
    """The attention of a trained run (:class:`AttentionSettings`)."""
    decay: DecaySettings = field(default_factory=DecaySettings)
    """The long-term decay figure (:class:`DecaySettings`)."""

    def validate(self) -> VizSettings:
        self.formats = check_formats(self.formats)
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


KEYS = ("context", "span", "formats", "attention", "decay")
"""The keys of the viz config that are settings (the others: run, out, method, model, device, wandb, ...)."""


def settings_from_config(cfg: DictConfig | dict[str, Any]) -> VizSettings:
    """The ``posbench viz`` config -> validated settings; a key it lacks keeps the
    :class:`VizSettings` default (the one place defaults live besides viz.yaml, tested equal)."""
    values = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    return from_section(VizSettings, "", {key: values[key] for key in KEYS if key in values})


__all__ = ["AttentionSettings", "DecaySettings", "VizSettings", "settings_from_config"]
