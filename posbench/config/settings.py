"""The machinery of typed settings: a config section -> a validated dataclass.

Each module owns the dataclass of its settings (``posbench/train/settings.py``: TrainerConfig,
``posbench/evaluation/settings.py``: EvalConfig, ...), where every field is typed, documented and
given its default. :func:`from_section` builds one from a composed config section, so a bad value
(``trainer.lr=-1``, ``trainer.context=abc``) is refused before any work with a message naming the
field.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, TypeVar, get_type_hints

from posbench.core.errors import PosbenchError

T = TypeVar("T")


def from_section(cls: type[T], section: str, values: dict[str, Any] | None) -> T:
    """Build dataclass ``cls`` from a config section, with one-line errors for bad keys/types.
    A field whose type is itself a settings dataclass (``eval.copy``) is built from its own
    section, ``<section>.<field>``; the object is validated (its ``validate()``) once built. A
    command's own top-level settings (``posbench bench``, ``posbench viz``) pass ``section=""``, so
    a message names the key as it is typed on the command line (``batch_size``, ``attention.layers``)."""
    values = dict(values or {})
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    types = _field_types(cls)
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise PosbenchError(
            f"unknown option(s) {', '.join(key_name(section, k) for k in unknown)}; "
            f"known: {', '.join(known)}"
        )
    for name, value in values.items():
        if is_dataclass(types.get(name)):
            if not isinstance(value, dict):
                raise PosbenchError(f"{key_name(section, name)} must be a mapping of settings, got {value!r}")
            values[name] = from_section(types[name], key_name(section, name), value)
        else:
            values[name] = coerce_value(section, name, known[name].type, value)
    obj = cls(**values)
    validate = getattr(obj, "validate", None)
    if validate:
        validate()
    return obj


def key_name(section: str, name: str) -> str:
    """``trainer.lr`` for a group's key; ``batch_size`` for a command's top-level key (section "")."""
    return f"{section}.{name}" if section else name


def _field_types(cls: type) -> dict[str, Any]:
    """The resolved field types of ``cls`` ({} where an annotation names what its module cannot
    resolve at run time; those fields are checked by their annotation's text alone)."""
    try:
        return get_type_hints(cls)
    except (NameError, TypeError):
        return {}


def coerce_value(section: str, name: str, annotation: Any, value: Any) -> Any:
    """Check ``value`` against the annotation of option ``section.name`` (a type or its string
    form, e.g. ``"int | None"``); ints are accepted for floats. One-line error when it does not fit."""
    spec = (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))).replace(" ", "")
    optional = "None" in spec.split("|")
    if value is None:
        if optional:
            return None
        raise PosbenchError(f"{key_name(section, name)} cannot be null")
    base = [t for t in spec.split("|") if t != "None"][0]

    def bad(kind: str) -> PosbenchError:
        return PosbenchError(f"{key_name(section, name)} must be {kind}, got {value!r}")

    if base == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
    elif base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
    elif base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        value = float(value)
    elif base == "str":
        if isinstance(value, bool):  # YAML reads `compile: true` / `resume: false` as booleans
            value = str(value).lower()
        if not isinstance(value, str):
            raise bad("a string")
    elif base.startswith("list"):
        if base == "list[str]" and isinstance(value, str):  # eval.extension=all, a single name
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise bad("a list, e.g. [512,1024]")
        value = list(value)
    return value


def require_positive(section: str, **values: Any) -> None:
    for name, value in values.items():
        if value is not None and not value > 0:
            raise PosbenchError(f"{key_name(section, name)} must be positive, got {value}")
