"""Registry of position methods: one module per method, registered by its ``name``.

Adding a method = a module here that subclasses :class:`PositionMethod` and is decorated with
``@register``, a ``configs/method/<name>.yaml``, and its tests. Nothing else in the model changes.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from posbench.config import listing_order
from posbench.config.settings import coerce_value
from posbench.core.errors import PosbenchError
from posbench.methods.base import (
    LAYOUTS,
    DenseScore,
    InputTable,
    ModelDims,
    ParameterDrift,
    PositionMethod,
    Rotary,
    ScoreFn,
    ValueTerm,
    cell_at,
    cell_index_grid,
    dense_score,
    distance,
    grid_offset,
    grid_positions,
    grid_side,
    index_grid,
    needs,
    position_at,
)

_REGISTRY: dict[str, type[PositionMethod]] = {}

# Every module of this package is a method and is imported (so registered) below; methods are
# listed by name in posbench.config.listing_order (METHOD_LISTING_ORDER, then alphabetically), the
# order that reading saved results takes from the method configs' names without importing these.


def register(cls: type[PositionMethod]) -> type[PositionMethod]:
    """Class decorator adding a position method to the registry under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} needs a non-empty `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"position method {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove method ``name`` from the registry (a method registered by a test or a notebook)."""
    _REGISTRY.pop(name, None)


def list_methods(layout: str | None = "sequence") -> list[str]:
    """Names of the registered position methods made for ``layout`` (``sequence``: the language
    model's, the default; ``grid``: the grid encoder's; None: all, the valid ``method=`` values)."""
    return [name for name in listing_order(_REGISTRY) if layout is None or layout in _REGISTRY[name].layouts]


def method_class(name: str) -> type[PositionMethod]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PosbenchError(
            f"unknown position method {name!r}; choose one of: {', '.join(_REGISTRY)}"
        ) from None


def _option_parameters(name: str) -> dict[str, inspect.Parameter]:
    """The method's options: its constructor's keyword-only arguments with a default."""
    sig = inspect.signature(method_class(name).__init__)
    return {p.name: p for p in sig.parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.default is not inspect.Parameter.empty}


def method_options(name: str) -> dict[str, Any]:
    """The method's own options and their defaults (its constructor's keyword arguments)."""
    return {option: p.default for option, p in _option_parameters(name).items()}


def saved_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of a saved run of method ``name``: one it does not record takes the value it
    had before the option existed (the method's ``options_before``), not today's default."""
    before = _REGISTRY[name].options_before if name in _REGISTRY else {}
    return {**before, **options}


def build_method(name: str, dims: ModelDims, **options: Any) -> PositionMethod:
    """Instantiate method ``name`` for a model of shape ``dims`` with its ``options``."""
    cls = method_class(name)
    known = _option_parameters(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise PosbenchError(
            f"method {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(known) or '(none)'}"
        )
    # Each value is checked against its constructor annotation, so `method.base=abc` or
    # `method.interleaved=maybe` is refused in one line for every method, new ones included.
    typed = {option: coerce_value("method", option, known[option].annotation, value)
             for option, value in options.items()}
    return cls(dims, **typed)


def build_base(owner: str, base: str, dims: ModelDims) -> PositionMethod:
    """The base method of a wrapper method (dape, ssmax: ``method.base``), with its defaults."""
    if base == owner:
        raise ValueError(f"{owner}'s base must be another method, not {owner} itself")
    if base not in _REGISTRY:
        raise PosbenchError(f"method.base={base!r} is not a position method; choose one of: {', '.join(_REGISTRY)}")
    return build_method(base, dims)


def _method_modules() -> list[str]:
    import pkgutil

    return listing_order(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base" and not m.name.startswith("_"))


for _module in _method_modules():
    importlib.import_module(f"posbench.methods.{_module}")

__all__ = [
    "LAYOUTS",
    "DenseScore",
    "InputTable",
    "ModelDims",
    "ParameterDrift",
    "PositionMethod",
    "ScoreFn",
    "ValueTerm",
    "build_base",
    "build_method",
    "cell_at",
    "cell_index_grid",
    "dense_score",
    "distance",
    "grid_offset",
    "grid_positions",
    "grid_side",
    "index_grid",
    "list_methods",
    "method_class",
    "method_options",
    "saved_options",
    "needs",
    "position_at",
    "register",
    "Rotary",
    "unregister",
]
