"""The checks of ``posbench bench``'s settings that need the methods and the model shape, run
before any timing: every user error of the command is one line from here."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from posbench.bench.settings import BenchSettings, parse_peak
from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError
from posbench.methods import list_methods, method_class
from posbench.model.transformer import ModelConfig
from posbench.runs.spec import MethodSpec


def resolve_methods(value: Any) -> list[str]:
    """``all`` / a name / a list of names -> registered method names (order kept, deduplicated)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names:
        raise PosbenchError(f"methods must be all or a non-empty list like [rope,alibi], got {value!r}")
    if len(names) == 1 and isinstance(names[0], str) and names[0].strip().lower() == "all":
        return list_methods()
    out: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise PosbenchError(f"methods must list method names, got {name!r}; e.g. methods=[rope,alibi]")
        method_class(name)  # unknown -> PosbenchError naming the valid ones
        if name not in out:
            out.append(name)
    return out


def settings_from_config(cfg: DictConfig | dict[str, Any]) -> tuple[BenchSettings, ModelConfig]:
    """The composed bench config -> (settings, model shape), every user error a one-line
    :class:`PosbenchError`, each method checked against the shape before any timing."""
    values = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    values.pop("hydra", None)
    model_values = dict(values.pop("model", None) or {})
    peak = parse_peak(values.pop("peak_tflops", "auto"))  # a word or a number: no one type to check
    settings = from_section(BenchSettings, "", _expand_shorthands(values))
    settings.methods = resolve_methods(settings.methods)
    settings.peak_tflops = peak
    model_values["vocab_size"] = settings.vocab_size
    model_cfg = from_section(ModelConfig, "model", model_values)
    for name in settings.methods:
        _check_method(name, model_cfg, settings)
    return settings, model_cfg


def _expand_shorthands(values: dict[str, Any]) -> dict[str, Any]:
    """What the command line writes short: ``methods=null`` (all), ``eval_lengths=512`` (one
    length), ``eval_lengths=null`` (none), ``out=2024`` (a folder name Hydra reads as a number)."""
    if "methods" in values and values["methods"] is None:
        values["methods"] = "all"
    lengths = values.get("eval_lengths")
    if "eval_lengths" in values and lengths is None:
        values["eval_lengths"] = []
    elif isinstance(lengths, int) and not isinstance(lengths, bool):
        values["eval_lengths"] = [lengths]
    if values.get("out") is not None and not isinstance(values["out"], str):
        values["out"] = str(values["out"])
    return values


def method_config(name: str) -> dict[str, Any]:
    """The method's options from ``configs/method/<name>.yaml`` (constructor defaults if none)."""
    return MethodSpec.defaults(name).options


def _check_method(name: str, model_cfg: ModelConfig, settings: BenchSettings) -> None:
    """Build the method on the meta device: shape problems surface before any timing."""
    try:
        probe = MethodSpec.defaults(name).probe(model_cfg.dims)
    except PosbenchError as err:
        raise PosbenchError(f"{err}; pick another model= or methods=") from None
    if probe.max_positions is not None and settings.context > probe.max_positions:
        raise PosbenchError(
            f"method {name} supports positions up to {probe.max_positions} but context={settings.context}; "
            f"lower context or leave {name} out of methods"
        )


__all__ = ["method_config", "resolve_methods", "settings_from_config"]
