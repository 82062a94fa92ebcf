"""Per-layer schedules: a pattern of (method, options, attention window) repeated over the depth.

Recent long-context designs mix methods across layers instead of using one everywhere: global
NoPE layers interleaved with RoPE sliding-window layers (RNoPE-SWA, Yang et al. 2025, arXiv
2501.18795; SWAN-GPT, Puvvada et al. 2025, arXiv 2504.08719), or RoPE in some layers and NoPE in
others. ``method=layers`` takes the pattern as a list; layer ``l`` uses entry ``l mod len(pattern)``.
An entry is a string, ``<method>`` or ``<method>@<window>``, or a mapping
``{method: <name>, window: <W or null>, options: {<the method's options>}}``:

    method=layers 'method.pattern=[nope,rope@128,rope@128,rope@128]'

Entries with the same method and options share one sub-method (its parameters, e.g. t5's table
or relative's per-layer tables, are built for the layers that use it and indexed by their rank
among them); the window is per entry. Every hook of a layer delegates to its sub-method, so
score terms, value terms and normalisers (stick-breaking) apply layer by layer; backend limits
are the union of the sub-methods' and hold for every layer (``[rope, relative]`` runs eager
throughout); the window is the method's :meth:`attention_window`, which the model
intersects with ``model.attention_window``. Methods that add to the input embedding (learned,
sinusoidal) act before the first layer, not per layer, and are refused in a pattern.
Learned position parameters are logged as ``<group>.<name>``, the group being the sub-method's
name (``rope``, ``t5``), numbered when one method appears with different options (``t5_2``).

Evaluation-time extensions: the rotary rules (PI, NTK, YaRN, Llama 3) are refused for a schedule
with the usual one line (a schedule is not :class:`Rotary`; its rotary layers' frequencies are
not one method's), while ``log_scaling`` and ``window`` apply to every layer as for any method.
In a schedule whose rotary layers are windowed (swan), no rotary layer ever sees a distance of
W or more, at any length, so there is nothing for the rotary rules to repair.

``method=swan`` is the preset of SWAN-GPT's pattern (see :class:`Swan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from posbench.methods import build_method, register
from posbench.methods.base import ModelDims, Normalizer, PositionMethod, ScoreFn, ValueTerm

ENTRY_KEYS = ("method", "window", "options")


@dataclass(frozen=True)
class LayerEntry:
    """One entry of a pattern: a method with its options, under an optional attention window."""

    method: str
    window: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def short(self) -> str:
        """``rope@128``, ``t5(num_buckets=16)``: how the entry reads in a pattern."""
        opts = f"({','.join(f'{k}={v}' for k, v in sorted(self.options.items()))})" if self.options else ""
        return f"{self.method}{opts}" + (f"@{self.window}" if self.window is not None else "")


def parse_entry(entry: Any) -> LayerEntry:
    """A pattern entry (``"rope"``, ``"rope@128"`` or a mapping) -> :class:`LayerEntry`."""
    if isinstance(entry, str):
        method, _, window = entry.partition("@")
        if window and not window.isdigit():
            raise ValueError(f"pattern entry {entry!r}: the window after @ must be a positive integer")
        return check_entry(LayerEntry(method.strip(), int(window) if window else None))
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown or "method" not in entry:
            raise ValueError(f"pattern entry {entry!r}: needs 'method' and takes only {', '.join(ENTRY_KEYS)}")
        options = entry.get("options") or {}
        if not isinstance(options, dict):
            raise ValueError(f"pattern entry {entry!r}: 'options' must be a mapping of the method's options")
        return check_entry(LayerEntry(str(entry["method"]), entry.get("window"), dict(options)))
    raise ValueError(f"pattern entry {entry!r} must be a method name, '<method>@<window>' or a mapping")


def check_entry(entry: LayerEntry) -> LayerEntry:
    window = entry.window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"pattern entry {entry.short!r}: window must be a positive integer or null")
    return entry


@register
class Layers(PositionMethod):
    """A per-layer schedule of position methods (module docstring)."""

    name = "layers"
    enters = "per layer: a pattern of (method, options, window) repeated over the depth"
    source = "Yang et al. 2025 (RNoPE-SWA)"
    past_context = (
        "each layer's method's; a windowed layer never sees a distance past its window W "
        "(docs/methods.md#per-layer-schedules-layers-swan)"
    )
    backend_note = "per layer: on CUDA a windowed layer runs in flex, the others in sdpa"

    def __init__(self, dims: ModelDims, *, pattern: list = ["rope", "nope"]) -> None:  # noqa: B006 (never mutated)
        super().__init__(dims)
        if isinstance(pattern, (str, dict)):
            pattern = [pattern]
        entries = [parse_entry(e) for e in pattern]
        if not entries:
            raise ValueError("pattern is empty; give at least one entry, e.g. [rope]")
        self.entries = entries
        # One sub-method per distinct (method, options); layers -> (group, rank among its layers).
        keys: list[tuple[str, str]] = []
        self.layer_group: list[int] = []
        self.layer_rank: list[int] = []
        for layer in range(dims.n_layers):
            entry = entries[layer % len(entries)]
            key = (entry.method, repr(sorted(entry.options.items())))
            if key not in keys:
                keys.append(key)
            group = keys.index(key)
            self.layer_rank.append(self.layer_group.count(group))
            self.layer_group.append(group)
        self.layer_window = [entries[layer % len(entries)].window for layer in range(dims.n_layers)]
        subs, names = [], []
        for group, (method, _) in enumerate(keys):
            entry = next(entries[l % len(entries)] for l in range(dims.n_layers) if self.layer_group[l] == group)
            count = self.layer_group.count(group)
            sub = self.build_sub(entry, ModelDims(dims.d_model, dims.n_heads, count))
            if type(sub).input_embedding is not PositionMethod.input_embedding:
                raise ValueError(f"{method} adds to the input embedding, which is not per layer; "
                                 "it cannot be one layer's method in a pattern")
            subs.append(sub)
            repeats = sum(1 for m, _ in keys[:group] if m == method)
            names.append(method if repeats == 0 else f"{method}_{repeats + 1}")
        self.groups = nn.ModuleList(subs)
        self.group_names = names
        self.has_score_term = any(s.has_score_term for s in subs)  # type: ignore[misc]  # per instance
        self.uses_positions = any(s.uses_positions for s in subs)  # type: ignore[misc]

    def build_sub(self, entry: LayerEntry, dims: ModelDims) -> PositionMethod:
        """The sub-method of ``entry``'s layers (``dims.n_layers`` of them): the registered method
        it names, with its options (a recipe builds its own layer types instead)."""
        return build_method(entry.method, dims, **entry.options)

    def sub(self, layer: int) -> tuple[PositionMethod, int]:
        """The sub-method of ``layer`` and the layer's index among that sub-method's layers."""
        return self.groups[self.layer_group[layer]], self.layer_rank[layer]  # type: ignore[return-value]

    @property
    def max_positions(self) -> int | None:
        limits = [s.max_positions for s in self.groups if s.max_positions is not None]
        return min(limits) if limits else None

    def backend_limits(self) -> dict[str, str]:
        limits: dict[str, str] = {}
        for name, sub in zip(self.group_names, self.groups):
            for backend, reason in sub.backend_limits().items():
                limits.setdefault(backend, f"its {name} layers: {reason}")
        return limits

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        sub, rank = self.sub(layer)
        return sub.rotate_qk(q, k, positions, rank)

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None,
                   x: Tensor | None = None) -> ScoreFn | None:
        sub, rank = self.sub(layer)
        return sub.score_term(q, positions, rank, k=k, x=x) if sub.has_score_term else None

    def value_term(self, positions: Tensor, layer: int) -> ValueTerm | None:
        sub, rank = self.sub(layer)
        return sub.value_term(positions, rank)

    def key_bias(self, x: Tensor, layer: int) -> Tensor | None:
        sub, rank = self.sub(layer)
        return sub.key_bias(x, rank)

    def attention_window(self, layer: int) -> int | None:
        sub, rank = self.sub(layer)
        given = [w for w in (self.layer_window[layer], sub.attention_window(rank)) if w is not None]
        return min(given) if given else None

    def normalizer(self, layer: int) -> Normalizer | None:
        sub, rank = self.sub(layer)
        return sub.normalizer(rank)

    def position_parameters(self) -> dict[str, nn.Parameter]:
        return {f"{group}.{name}": p for group, sub in zip(self.group_names, self.groups)
                for name, p in sub.position_parameters().items()}

    def extra_repr(self) -> str:
        return f"pattern=[{', '.join(e.short for e in self.entries)}]"


@register
class Swan(Layers):
    """SWAN-GPT's pattern (Puvvada et al. 2025): one global NoPE layer, then three RoPE layers
    with a sliding window of ``window`` keys, repeated over the depth (docs/methods.md says
    why 128 at C = 256)."""

    name = "swan"
    enters = "per layer: 1 global NoPE : 3 RoPE layers windowed at 128"
    source = "Puvvada et al. 2025 (SWAN-GPT)"
    past_context = (
        "the windowed RoPE layers never see a distance past W; only the global NoPE layers reach far keys "
        "(docs/methods.md#per-layer-schedules-layers-swan)"
    )

    def __init__(self, dims: ModelDims, *, window: int = 128) -> None:
        super().__init__(dims, pattern=[{"method": "nope"}] + [{"method": "rope", "window": window}] * 3)
        self.window = window
