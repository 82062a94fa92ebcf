"""The order methods are listed in (tables, figure colours), read without importing a method.

``posbench.list_methods()`` lists the registered methods by name in
:func:`posbench.config.listing_order`. Every method ships ``configs/method/<name>.yaml``, so the
same order comes from the method configs' names here: reading saved results never imports the
methods (nor torch).
"""

from __future__ import annotations

from functools import cache
from typing import Iterable

from posbench.config import config_names, listing_order


@cache
def method_names() -> tuple[str, ...]:
    """Every shipped method (``configs/method/*.yaml``), in the registry's listing order."""
    return tuple(listing_order(config_names("method")))


def method_order(methods: Iterable[str]) -> list[str]:
    """Listing order (``posbench.list_methods()``), unknown names after, alphabetically."""
    known = method_names()
    present = set(methods)
    return [m for m in known if m in present] + sorted(present - set(known))
