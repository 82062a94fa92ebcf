"""The order methods are listed in (tables, figure colours), read without importing a method.

``posbench.list_methods()`` is the registry's order: the method modules imported in
:func:`posbench.config.listing_order`, each registering its ``@register`` classes in the order it
defines them (``layers.py`` registers ``layers``, then ``swan``). Importing the methods imports
torch, which reading saved results never needs; the same order is read here from the modules'
source instead.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path
from typing import Iterable

from posbench.config import listing_order


def _registered(source: str) -> list[str]:
    """The ``name`` of every ``@register`` class of a method module's source, in order."""
    names = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        if not any(isinstance(d, ast.Name) and d.id == "register" for d in node.decorator_list):
            continue
        for statement in node.body:
            targets = statement.targets if isinstance(statement, ast.Assign) else \
                [statement.target] if isinstance(statement, ast.AnnAssign) else []
            value = getattr(statement, "value", None)
            if (any(isinstance(t, ast.Name) and t.id == "name" for t in targets)
                    and isinstance(value, ast.Constant) and isinstance(value.value, str)):
                names.append(value.value)
    return names


@cache
def method_names() -> tuple[str, ...]:
    """Every method of the ``posbench.methods`` modules, in the registry's order."""
    spec = importlib.util.find_spec("posbench.methods")  # imports posbench, not posbench.methods
    folder = Path(next(iter(spec.submodule_search_locations)))
    modules = [p.stem for p in folder.glob("*.py") if p.stem != "base" and not p.stem.startswith("_")]
    return tuple(name for module in listing_order(modules) for name in _registered((folder / f"{module}.py").read_text()))


def method_order(methods: Iterable[str]) -> list[str]:
    """Listing order (``posbench.list_methods()``), unknown names after, alphabetically."""
    known = method_names()
    present = set(methods)
    return [m for m in known if m in present] + sorted(present - set(known))
