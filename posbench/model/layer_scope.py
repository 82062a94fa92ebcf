"""An evaluation-time extension on one layer type of a per-layer schedule (``eval.extension_scope``).

Gemma 3 scales RoPE on its global layers only (transformers' ``rope_parameters`` per layer type),
OLMo 3 applies YaRN to its full-attention layers only. ``eval.extension_scope`` says which layers
an extension of ``eval.extension`` applies to:

- ``all`` (default): every layer, the extension wrapping the whole method as it always has;
- ``global``: the layers without a window or chunk (full attention);
- ``local``: the windowed or chunked layers;
- ``rope``: the layers that rotate q and k (a :class:`~posbench.methods.base.Rotary` sub-method,
  or a recipe layer type with RoPE).

A scope other than ``all`` needs a per-layer schedule (``layers``, ``swan``, a recipe): the rule
is installed on the sub-method of each layer in scope (a rotary rule on its rotation), and every
other layer computes what it did in training. A rule that applies to no layer in scope is refused
in one line, as is a scope on a method that is one method for all layers.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from posbench.core.errors import PosbenchError
from posbench.methods.base import Normalizer, OverBase, PositionMethod, Rotary, ScoreFn, ValueTerm
from posbench.methods.layers import Layers

# ``ext`` below is a posbench.model.extension.Extension and ``setting`` its Setting (typed Any:
# that module imports this one).
Extension = Setting = Any

SCOPES = ("all", "global", "local", "rope")


def is_rotary(sub: PositionMethod) -> bool:
    """Whether the sub-method rotates q and k: Rotary, or a recipe layer type holding a RoPE."""
    return isinstance(sub, Rotary) or isinstance(getattr(sub, "rope", None), Rotary)


def layers_in_scope(method: Layers, scope: str) -> list[int]:
    """The layers of ``method`` that ``scope`` names (module docstring)."""
    chosen = []
    for layer in range(method.dims.n_layers):
        sub, _ = method.sub(layer)
        local = method.attention_window(layer) is not None or getattr(sub, "chunk", None) is not None
        if (scope == "rope" and is_rotary(sub)) or (scope == "local" and local) or (scope == "global" and not local):
            chosen.append(layer)
    return chosen


def check_scope(scope: str) -> None:
    if scope not in SCOPES:
        raise PosbenchError(f"eval.extension_scope={scope!r} is not a scope; choose one of {', '.join(SCOPES)}")


def install_on(ext: Extension, sub: PositionMethod, setting: Setting) -> PositionMethod | None | bool:
    """``sub`` (one group of a schedule) with ``ext``: installed on the sub-method itself where the
    rule applies to it, or on the rotation of a recipe layer type (a rotary rule that only changes
    the rotation: new frequencies, a q-k factor). None: the identity at this setting; False: the
    rule cannot apply to this sub-method."""
    if ext.applies(type(sub)):
        return ext.install(sub, setting)
    rope = getattr(sub, "rope", None)
    if not isinstance(rope, Rotary) or not ext.applies(type(rope)):
        return False
    installed = ext.install(rope, setting)  # type: ignore[arg-type]
    if installed is None:
        return None
    if any(getattr(installed, part, None) is not None for part in ("remap", "window", "log_context")):
        return False  # a rule with a score term of its own (rerope, self_extend) needs the whole layer
    return sub.with_rotation(installed)  # type: ignore[attr-defined]


def install_in_scope(ext: Extension, method: PositionMethod, setting: Setting, scope: str) -> PositionMethod | None:
    """``method`` (a schedule) with extension ``ext`` on the layers of ``scope``; None when the rule
    is the identity there. Refuses, in one line, a method that is not a schedule and a rule that
    reaches no layer of the scope."""
    if not isinstance(method, Layers):
        raise PosbenchError(f"eval.extension_scope={scope} needs a per-layer method (layers, swan, a recipe); "
                            f"method={method.name} is one method on every layer: use eval.extension_scope=all")
    extended: dict[int, PositionMethod | None] = {}  # group index -> its sub-method extended (None: identity)
    for layer in layers_in_scope(method, scope):
        group = method.layer_group[layer]
        if group not in extended:
            installed = install_on(ext, method.groups[group], setting)  # type: ignore[arg-type]
            if installed is not False:
                extended[group] = installed  # type: ignore[assignment]
    if not extended:
        raise PosbenchError(f"extension {ext.name} applies to no {scope} layer of method={method.name}; "
                            f"choose another eval.extension_scope ({', '.join(SCOPES)})")
    changed = {g: m for g, m in extended.items() if m is not None}
    if not changed:
        return None
    layers = {l for l in layers_in_scope(method, scope) if method.layer_group[l] in changed}
    return ScopedExtension(method, changed, layers)


class ScopedExtension(OverBase):
    """A schedule whose layers in ``layers`` use their sub-method's extended copy; every other
    layer, and everything not per layer, is the trained schedule's."""

    def __init__(self, inner: Layers, extended: dict[int, PositionMethod], layers: set[int]) -> None:
        super().__init__(inner.dims)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # results keep the trained method's name
        self.extended = nn.ModuleDict({str(g): m for g, m in extended.items()})
        self.scoped = layers
        self.has_score_term = inner.has_score_term or any(m.has_score_term for m in extended.values())  # type: ignore[misc]
        self.uses_positions = inner.uses_positions  # type: ignore[misc]

    def at(self, layer: int) -> tuple[PositionMethod, int] | None:
        """The extended sub-method of ``layer`` and its rank among the group's layers, or None."""
        if layer not in self.scoped:
            return None
        inner: Layers = self.inner  # type: ignore[assignment]
        return self.extended[str(inner.layer_group[layer])], inner.layer_rank[layer]  # type: ignore[return-value]

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        found = self.at(layer)
        return self.inner.rotate_qk(q, k, positions, layer) if found is None else found[0].rotate_qk(q, k, positions, found[1])

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None,
                   x: Tensor | None = None) -> ScoreFn | None:
        found = self.at(layer)
        if found is None:
            return self.inner.score_term(q, positions, layer, k=k, x=x) if self.inner.has_score_term else None
        sub, rank = found
        return sub.score_term(q, positions, rank, k=k, x=x) if sub.has_score_term else None

    def value_term(self, positions: Tensor, layer: int) -> ValueTerm | None:
        found = self.at(layer)
        return self.inner.value_term(positions, layer) if found is None else found[0].value_term(positions, found[1])

    def key_bias(self, x: Tensor, layer: int) -> Tensor | None:
        found = self.at(layer)
        return self.inner.key_bias(x, layer) if found is None else found[0].key_bias(x, found[1])

    def normalizer(self, layer: int) -> Normalizer | None:
        found = self.at(layer)
        return self.inner.normalizer(layer) if found is None else found[0].normalizer(found[1])

    def extra_repr(self) -> str:
        return f"inner={self.inner.name}, layers={sorted(self.scoped)}"


def scoped_options(options: dict[str, Any] | None) -> str:
    """The scope in an extension's options mapping (``all`` when not given)."""
    scope = str((options or {}).get("scope", "all"))
    check_scope(scope)
    return scope


def reaches(ext: Extension, method: Any, scope: str) -> bool:
    """Whether ``ext`` applies to some layer of ``scope`` in ``method`` (a built schedule)."""
    if not isinstance(method, Layers):
        return False
    for layer in layers_in_scope(method, scope):
        sub = method.sub(layer)[0]
        rope = getattr(sub, "rope", None)
        if ext.applies(type(sub)) or (isinstance(rope, Rotary) and ext.applies(type(rope))):
            return True
    return False
