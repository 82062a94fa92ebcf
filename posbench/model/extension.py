"""Context extension at evaluation time: run a trained model past its context without retraining.

An extension changes how a trained model's position method is used at evaluation, never its
weights. :func:`extended` swaps ``model.position`` for an adjusted copy (an
:class:`~posbench.model.extended_position.ExtendedPosition` around the trained method, or around a
copy of it with new rotary frequencies) for the duration of a ``with`` block and restores it
afterwards; the trained module is never changed. Every extension declares the capabilities it needs (``applies_to``:
:class:`~posbench.methods.base.Rotary` methods, :class:`~posbench.methods.base.InputTable`
methods; ``None`` = every method), so a new method gets every extension its capabilities allow.

With training context ``C``, evaluated length ``L`` and factor ``s`` (``eval.extension_factor``,
default ``L / C``):

- ``linear``: position interpolation (Chen et al. 2023). RoPE angles ``(n / s) theta_i``;
  learned tables are read at ``n / s`` by linear interpolation between rows; sinusoidal tables
  are computed at ``n / s``.
- ``ntk``: NTK-aware base change (bloc97 2023): ``base' = base * s^(D / (D - 2))``.
- ``dynamic_ntk``: transformers' ``dynamic`` rule, recomputed for the evaluated length:
  ``base' = base * (f L / C - (f - 1))^(D / (D - 2))`` with ``f`` = ``eval.extension_factor``
  (default 1). A full forward pass of length ``L`` uses one base, as transformers does, so with
  the default ``f = 1`` it equals ``ntk`` at ``s = L / C``; with a fixed factor they differ.
- ``yarn``: YaRN (Peng et al. 2023): NTK-by-parts interpolation (frequencies whose wavelength is
  short against ``C`` kept, long ones interpolated by ``s``, a linear ramp between, beta_fast=32,
  beta_slow=1) and the attention temperature ``sqrt(1/t) = 0.1 ln(s) + 1`` applied to cos and
  sin, i.e. to q and k.
- ``llama3``: Llama 3.1's rule: wavelengths above ``C / low_freq_factor`` (1) interpolated by
  ``s``, below ``C / high_freq_factor`` (4) kept, smooth in between.
- ``log_scaling``: attention logits of the query at 0-based position ``n`` multiplied by
  ``max(1, log(n + 1) / log C)`` (Chiang & Cholak 2022): it sees ``n + 1`` keys, so the logits
  grow with the log of the number of keys past the context and the attention entropy stays
  bounded.
- ``window``: a sliding-window mask of width ``C``: the query at ``n`` sees keys
  ``n - C + 1 .. n``, never a distance it was not trained on.
- ``rerope``: ReRoPE (Su 2023, kexue.fm/archives/9708; reference bojone/rerope
  ``rerope_patch.py``): relative positions ``d < w`` stay exact, the others become ``w``
  (``eval.rerope.window``, default ``C / 8``: the reference's 512 of 4096); with
  ``eval.rerope.leaky=k``, Leaky ReRoPE's ``w + (d - w) / k`` (``leaky_rerope_patch.py``). As
  the reference patch, the queries are also scaled by ``max(1, log(n + 1) / log C)``
  (``eval.rerope.log_scaling``).
- ``self_extend``: Self-Extend (Jin et al. 2024, reference datamllab/LongLM
  ``self_extend_patch/Llama.py``): relative positions ``d < W`` stay exact (``eval.self_extend.window``,
  default ``C / 4``: LongLM's 1024 of 4096); farther keys see the grouped positions
  ``floor(i / G) + W - W / G`` (query) and ``floor(j / G)`` (key), ``G`` = ``eval.self_extend.group``
  (default 8), so the two regions join at ``d = W``.

- ``streaming_llm``, ``lm_infinite``, ``dual_chunk``, ``longrope``: StreamingLLM, LM-Infinite,
  Dual Chunk Attention and LongRoPE (:mod:`posbench.model.extension_rules`).

ReRoPE and Self-Extend (:class:`RelativeRemap`) compute two logit matrices, the plain one and one
with the queries and keys transformed at the remapped positions, and merge them by the mask
``d >= window``: densely, (B, H, T, T) fp32 per layer (the merge is a score term holding the
difference of the two). Every backend runs it; none is fused.

The RoPE frequencies and attention factors come from ``transformers.modeling_rope_utils``
(``ROPE_INIT_FUNCTIONS``), the code Llama, Qwen and Mistral users run. ``longrope`` is not offered:
its per-frequency factors come from an evolutionary search per model, and with uniform factors it
degenerates to ``linear`` with a temperature.

On the grid encoder (``model.layout=grid``, docs/grid.md) the rotary rules apply per axis, as FiT
and FiTv2 apply 1D rules to each axis: ``C`` and ``L`` are the sides of the training and evaluated
grids (8 and 32 for 64 and 1024 cells), so the default factor is the side ratio (4), not the cell
ratio (16). Axial RoPE rotates each axis by 1D RoPE's frequencies over its own ``rotary_dim``
channels, so the 1D rule for (train side, side) gives each axis its frequencies. The other rules
read sequence distances or indices and are refused on the grid, as are methods that are not
:class:`~posbench.methods.base.Rotary` (mixed_rope's learned 2D frequencies).

An extension whose parameters make it the identity (factor 1, or ``L <= C`` for ``dynamic_ntk``,
``log_scaling`` and ``window``) is not installed, so that evaluation is the plain one bit for bit.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from posbench.core.errors import PosbenchError
from posbench.evaluation.settings import ReRoPEConfig, SelfExtendConfig
from posbench.methods import list_methods, method_class
from posbench.methods.base import InputTable, PositionMethod, Rotary, grid_side
from posbench.model.extended_position import ExtendedPosition, RelativeRemap
from posbench.model.extension_rules import (
    dual_chunk,
    dual_chunk_options,
    lm_infinite,
    lm_infinite_options,
    longrope_options,
    longrope_params,
    streaming_llm,
    streaming_llm_options,
)
from posbench.model.layer_scope import check_scope, install_in_scope, reaches, scoped_options

NONE = "none"
CAPABILITY_NAMES = {Rotary: "rotary", InputTable: "input-table"}


@dataclass(frozen=True)
class Setting:
    """Where an extension is applied: training context, evaluated length and scaling factor."""

    train_context: int
    length: int
    factor: float | None
    options: Mapping[str, Any] = field(default_factory=dict)
    """Settings of the extensions that take some, by name (``rerope``: a ReRoPEConfig); a
    missing one takes its defaults."""


@dataclass(frozen=True)
class Extension:
    """One evaluation-time extension rule."""

    name: str
    applies_to: tuple[type, ...] | None
    """Capabilities a method needs for it (any one of them); None = every method."""
    summary: str
    """One line for listings and logs."""
    install: Callable[[PositionMethod, Setting], ExtendedPosition | None]
    """Build the adjusted method (None when the setting makes it the identity)."""
    default_factor: str | None = "L/C"
    """Its factor when ``eval.extension_factor`` is null: ``L/C``, ``1`` (dynamic_ntk, whose
    scale already follows the length), or None for rules that take no factor."""
    resolved_options: Callable[[Setting], dict[str, Any]] | None = None
    """Its own settings as used at a setting (defaults filled in), recorded in results."""
    layouts: tuple[str, ...] = ("sequence",)
    """The model layouts it applies to; on the grid a rule applies per axis (:func:`axis_lengths`)."""
    in_all: bool = True
    """Whether ``eval.extension=all`` includes it (False: a rule that needs a file of its own, longrope)."""

    def applies(self, method: str | PositionMethod | type[PositionMethod], layout: str = "sequence") -> bool:
        """Whether it applies to ``method`` (a name, a method or its class) on a model of ``layout``."""
        cls = method_type(method)
        return layout in self.layouts and (self.applies_to is None or issubclass(cls, self.applies_to))


def method_type(method: str | PositionMethod | type[PositionMethod]) -> type:
    """The method class of a name, an instance (an extended one: its trained method) or a class."""
    if isinstance(method, str):
        return method_class(method)
    if isinstance(method, ExtendedPosition):
        return type(method.inner)
    return method if isinstance(method, type) else type(method)


def model_layout(model: nn.Module) -> str:
    """The layout of ``model`` (``model.cfg.layout``); ``sequence`` for a model without one."""
    return getattr(getattr(model, "cfg", None), "layout", "sequence")


def axis_lengths(layout: str, train_context: int, length: int) -> tuple[int, int]:
    """(training context, evaluated length) as the rules read them: token counts on a sequence;
    on the grid the sides of the square grids of cells, so that 1D rules apply per axis."""
    if layout == "grid":
        return grid_side(train_context), grid_side(length)
    return train_context, length


# ----------------------------------------------------------------------------- rotary rules


def _from_transformers(method: PositionMethod, rope_type: str, setting: Setting, seq_len: float | None = None,
                       **params: float) -> ExtendedPosition:
    """``method`` with the frequencies (D/2,) and attention factor of transformers'
    ``ROPE_INIT_FUNCTIONS[rope_type]``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = hf_rope_config(method, rope_type, setting.train_context, params)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    return ExtendedPosition(method, inv_freq=inv_freq.float(), qk_scale=float(attention_factor))


def hf_rope_config(method: PositionMethod, rope_type: str, train_context: int, params: dict):
    """A transformers ``LlamaConfig`` whose rotary embedding is ``method``'s under ``rope_type``."""
    import transformers
    from transformers import LlamaConfig

    head_dim = method.rotary_dim  # type: ignore[attr-defined]  # R rotated channels: R/2 frequencies
    scaling = {"rope_type": rope_type, **params}
    longest = train_context
    if rope_type in ("yarn", "llama3"):  # their configs name the extended length too
        scaling["original_max_position_embeddings"] = train_context
        longest = math.ceil(params["factor"] * train_context)
    shape = dict(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim, max_position_embeddings=longest)
    base = float(method.base)  # type: ignore[arg-type]
    if int(transformers.__version__.split(".")[0]) >= 5:  # v5 folds rope_theta into rope_parameters
        return LlamaConfig(**shape, rope_parameters={**scaling, "rope_theta": base})
    return LlamaConfig(**shape, rope_theta=base, rope_scaling=scaling)


def _rope_rule(rope_type: str, **params: float) -> Callable[[PositionMethod, Setting], ExtendedPosition | None]:
    def install(method: PositionMethod, setting: Setting) -> ExtendedPosition | None:
        if setting.factor == 1.0:
            return None
        return _from_transformers(method, rope_type, setting, factor=setting.factor, **params)

    return install


def _ntk(method: PositionMethod, setting: Setting) -> ExtendedPosition | None:
    if setting.factor == 1.0:
        return None
    # transformers' dynamic rule with f = 1 at sequence length s * C is the static NTK-aware base
    # base * s^(D / (D - 2)) (tested against that formula).
    return _from_transformers(method, "dynamic", setting, seq_len=setting.factor * setting.train_context, factor=1.0)


def _dynamic_ntk(method: PositionMethod, setting: Setting) -> ExtendedPosition | None:
    if setting.length <= setting.train_context:
        return None
    return _from_transformers(method, "dynamic", setting, seq_len=setting.length, factor=setting.factor)


# ----------------------------------------------------------------------------- other rules


def _interpolate_positions(method: PositionMethod, setting: Setting) -> ExtendedPosition | None:
    if isinstance(method, Rotary):
        return _rope_rule("linear")(method, setting)
    if setting.factor == 1.0:
        return None
    return ExtendedPosition(method, position_scale=setting.factor, trained_positions=setting.train_context)


def _log_scaling(method: PositionMethod, setting: Setting) -> ExtendedPosition | None:
    return None if setting.length <= setting.train_context else ExtendedPosition(method, log_context=setting.train_context)


def _window(method: PositionMethod, setting: Setting) -> ExtendedPosition | None:
    return None if setting.length <= setting.train_context else ExtendedPosition(method, window=setting.train_context)


def _rerope_options(setting: Setting) -> dict[str, Any]:
    opts = setting.options.get("rerope") or ReRoPEConfig()
    window = opts.window if opts.window is not None else max(1, setting.train_context // 8)
    return {"window": window, "leaky": opts.leaky, "log_scaling": opts.log_scaling}


def _rerope(method: PositionMethod, setting: Setting) -> ExtendedPosition | None:
    o = _rerope_options(setting)
    w, k = o["window"], o["leaky"]
    log_context = setting.train_context if o["log_scaling"] and setting.length > setting.train_context else None
    if setting.length <= w and log_context is None:  # no key at distance >= w: the plain model
        return None
    if k is None:  # ReRoPE: the query at w, the key at 0 -> relative position w
        remap = RelativeRemap(w, lambda pos: torch.full_like(pos, w, dtype=torch.float32),
                              lambda pos: torch.zeros_like(pos, dtype=torch.float32))
    else:  # Leaky ReRoPE: (n + w (k - 1)) / k - m / k = w + (n - m - w) / k
        remap = RelativeRemap(w, lambda pos: (pos.double() + w * (k - 1)) / k, lambda pos: pos.double() / k)
    return ExtendedPosition(method, log_context=log_context, remap=remap if setting.length > w else None)


def _self_extend_options(setting: Setting) -> dict[str, Any]:
    opts = setting.options.get("self_extend") or SelfExtendConfig()
    window = opts.window if opts.window is not None else max(1, setting.train_context // 4)
    return {"window": window, "group": opts.group}


def _self_extend(method: PositionMethod, setting: Setting) -> ExtendedPosition | None:
    o = _self_extend_options(setting)
    W, G = o["window"], o["group"]
    if setting.length <= W:  # every key within the neighbour window: the plain model
        return None
    # LongLM: group_query_position = query_position // G + W - W / G (W / G a true division),
    # group_key_position = key_position // G. (LongLM drops the shift when no query reaches W;
    # then no key is grouped either, and this rule is not installed.)
    return ExtendedPosition(method, remap=RelativeRemap(
        W, lambda pos: torch.div(pos, G, rounding_mode="floor").double() + (W - W / G),
        lambda pos: torch.div(pos, G, rounding_mode="floor").double()))


def _longrope(method: PositionMethod, setting: Setting) -> ExtendedPosition | None:
    params = longrope_params(method, setting)  # the factor file's, s, C; None: the identity
    return None if params is None else _from_transformers(method, "longrope", setting, seq_len=setting.length, **params)


PER_AXIS = ("sequence", "grid")  # the rotary rules: on the grid, per axis

EXTENSIONS: dict[str, Extension] = {
    e.name: e
    for e in (
        Extension("linear", (Rotary, InputTable), "position interpolation: positions scaled by 1/s",
                  _interpolate_positions, layouts=PER_AXIS),
        Extension("ntk", (Rotary,), "NTK-aware base change: base * s^(D/(D-2))", _ntk, layouts=PER_AXIS),
        Extension("dynamic_ntk", (Rotary,), "transformers' dynamic NTK for the evaluated length",
                  _dynamic_ntk, default_factor="1", layouts=PER_AXIS),
        Extension("yarn", (Rotary,), "YaRN: NTK-by-parts + attention temperature 0.1 ln(s) + 1",
                  _rope_rule("yarn"), layouts=PER_AXIS),
        Extension("llama3", (Rotary,), "Llama 3.1 rule (low/high frequency factors 1 / 4)",
                  _rope_rule("llama3", low_freq_factor=1.0, high_freq_factor=4.0), layouts=PER_AXIS),
        Extension("log_scaling", None, "logits x max(1, log(n+1)/log C)", _log_scaling, default_factor=None),
        Extension("window", None, "sliding-window mask of width C", _window, default_factor=None),
        Extension("rerope", (Rotary,), "ReRoPE: relative positions past w (C/8) clamped to w; logn queries",
                  _rerope, default_factor=None, resolved_options=_rerope_options),
        Extension("self_extend", (Rotary,), "Self-Extend: exact within W (C/4), grouped floor(n/G) past it (G=8)",
                  _self_extend, default_factor=None, resolved_options=_self_extend_options),
        Extension("streaming_llm", (Rotary,), "StreamingLLM: 4 sinks + the last C - 4 keys, positions in the cache",
                  streaming_llm, default_factor=None, resolved_options=streaming_llm_options),
        Extension("lm_infinite", (Rotary,), "LM-Infinite: 10 global tokens + a window of C, distances capped at C",
                  lm_infinite, default_factor=None, resolved_options=lm_infinite_options),
        Extension("dual_chunk", (Rotary,), "Dual Chunk Attention: intra/successive/inter chunk positions (3C/4, C/16)",
                  dual_chunk, default_factor=None, resolved_options=dual_chunk_options),
        Extension("longrope", (Rotary,), "LongRoPE: per-frequency factors from eval.longrope.factors",
                  _longrope, resolved_options=longrope_options, in_all=False),
    )
}


def list_extensions() -> list[str]:
    """Valid ``eval.extension`` values (besides ``none`` and ``all``)."""
    return list(EXTENSIONS)


def check_names(requested: Sequence[str] | str) -> None:
    """Refuse an ``eval.extension`` entry that names no extension (before any work)."""
    for name in [requested] if isinstance(requested, str) else requested:
        if str(name) not in (NONE, "all", *EXTENSIONS):
            raise PosbenchError(f"unknown eval.extension {name!r}; choose from none, all, {', '.join(EXTENSIONS)}")


def resolve_extensions(requested: Sequence[str] | str, method: str | PositionMethod | type[PositionMethod],
                       log: Callable[[str], object] = print, layout: str = "sequence", scope: str = "all",
                       attention: bool = True) -> list[str]:
    """The extensions of ``eval.extension`` to evaluate for ``method`` (a name, a method or its
    class) on a model of ``layout``, always ``none`` first (the plain evaluation every extension
    is compared with).

    ``scope`` (``eval.extension_scope``): the layers the extensions go on; other than ``all`` an
    extension applies when it reaches a layer of that type (:mod:`posbench.model.layer_scope`).
    ``all`` means every extension that applies. A named extension that does not apply is skipped
    with one line; when only such extensions were asked for, the request is refused.
    ``attention=False`` (a recurrent model, docs/mixers.md): every extension changes attention
    (its positions, logits or window), so ``all`` is ``none`` alone and a named one is refused.
    """
    names = [str(n) for n in ([requested] if isinstance(requested, str) else requested)]
    check_scope(scope)

    def applies(ext: Extension) -> bool:
        return ext.applies(method, layout) if scope == "all" else reaches(ext, method, scope)

    if not attention:
        asked = [name for name in names if name != NONE]
        if asked and asked != ["all"]:
            raise PosbenchError(f"eval.extension={','.join(asked)} changes attention, and this model has no "
                                "attention layer (model.mixer); use eval.extension=none")
        if asked:
            log("eval.extension=all: no extension applies to a model without attention layers; evaluating none")
        return [NONE]
    chosen: list[str] = [NONE]
    refused: list[str] = []
    for name in names:
        if name == "all":
            chosen += [e for e, ext in EXTENSIONS.items() if applies(ext) and ext.in_all]
        elif name == NONE:
            continue
        elif name not in EXTENSIONS:
            raise PosbenchError(f"unknown eval.extension {name!r}; choose from none, all, {', '.join(EXTENSIONS)}")
        elif applies(EXTENSIONS[name]):
            chosen.append(name)
        else:
            refused.append(name)
    for name in refused:
        line = refusal(name, method, layout) if scope == "all" else (
            f"extension {name} applies to no {scope} layer of method={method_type(method).name} "
            "(eval.extension_scope: a per-layer method's global, local or rope layers)")
        if len(chosen) == 1:
            raise PosbenchError(line)
        log(f"skipping {line}")
    return list(dict.fromkeys(chosen))


def applies_text(name: str, layout: str = "sequence") -> str:
    """Which methods extension ``name`` applies to, by capability and the registered methods of ``layout``."""
    needed = EXTENSIONS[name].applies_to
    if needed is None:
        return "every method"
    kinds = " or ".join(CAPABILITY_NAMES.get(c, c.__name__) for c in needed)
    methods = [m for m in list_methods(layout) if EXTENSIONS[name].applies(m, layout)]
    return f"{kinds} methods ({', '.join(methods)})"


def refusal(name: str, method: str | PositionMethod | type[PositionMethod], layout: str = "sequence") -> str:
    """The one line saying why extension ``name`` does not apply to ``method`` on ``layout``."""
    if layout not in EXTENSIONS[name].layouts:
        per_axis = ", ".join(e for e, ext in EXTENSIONS.items() if layout in ext.layouts)
        return (f"extension {name} does not apply to the {layout} layout (it reads sequence distances); "
                f"on the grid the rotary rules apply per axis: {per_axis}")
    return f"extension {name} does not apply to method={method_type(method).name}; it applies to {applies_text(name, layout)}"


def extension_factor(name: str, length: int, train_context: int, factor: float | None) -> float | None:
    """The factor used for ``name`` at ``length``: ``factor`` if set, else the rule's default
    (L / C, at least 1; dynamic_ntk: 1); None for ``none`` and the rules without a factor."""
    default = EXTENSIONS[name].default_factor if name != NONE else None
    if default is None:
        return None
    if factor is not None:
        if not factor >= 1.0:
            raise PosbenchError(f"eval.extension_factor must be >= 1 (or null for L / C), got {factor}")
        return float(factor)
    return 1.0 if default == "1" else max(1.0, length / train_context)


def extension_options(name: str, train_context: int, length: int,
                      options: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The settings extension ``name`` uses (defaults filled in) for results; None for those
    without settings."""
    resolve = EXTENSIONS[name].resolved_options if name != NONE else None
    return None if resolve is None else resolve(Setting(train_context, length, None, options or {}))


def evaluation_order(extensions: Sequence[str]) -> list[str]:
    """The passes of an evaluation: ``none`` first (the plain model, every extension's
    reference), then the other extensions in the order given."""
    return [NONE, *(e for e in extensions if e != NONE)]


def record_extension(entry: dict[str, Any], name: str, factor: float | None, train_context: int, length: int,
                     options: Mapping[str, Any] | None = None, layout: str = "sequence") -> None:
    """Stamp a results entry with the pass it came from: ``extension``, ``extension_factor`` and,
    for an extension with settings of its own, ``extension_options``; on the grid, where a rule
    applies per axis, ``extension_per_axis``: the sides its factor is the ratio of."""
    entry["extension"], entry["extension_factor"] = name, factor
    if name != NONE and scoped_options(options) != "all":  # runs without a scope record none
        entry["extension_scope"] = scoped_options(options)
    used = extension_options(name, train_context, length, options)
    if used is not None:
        entry["extension_options"] = used
    if layout == "grid" and name != NONE:
        train_side, side = axis_lengths(layout, train_context, length)
        entry["extension_per_axis"] = {"train_side": train_side, "side": side}


@contextlib.contextmanager
def extended(model: nn.Module, name: str, train_context: int, length: int, factor: float | None = None,
             options: Mapping[str, Any] | None = None) -> Iterator[float | None]:
    """Evaluate ``model`` under extension ``name`` inside the block; yields the factor used
    (None for ``none``). ``options``: the settings of the extensions that take some, by name
    (:meth:`posbench.evaluation.settings.EvalConfig.extension_options`). ``model.position`` is restored on
    exit (the trained method itself is never changed). On a grid model ``train_context`` and
    ``length`` count cells and the rule applies per axis, to the sides (:func:`axis_lengths`)."""
    if name == NONE:
        yield None
        return
    original: PositionMethod = model.position  # type: ignore[assignment]
    ext, layout, scope = EXTENSIONS[name], model_layout(model), scoped_options(options)
    if scope == "all" and not ext.applies(original, layout):
        raise PosbenchError(refusal(name, original, layout))
    train_context, length = axis_lengths(layout, train_context, length)
    used = extension_factor(name, length, train_context, factor)
    setting = Setting(train_context, length, used, options or {})
    # eval.extension_scope: on the layers of one type of a per-layer method (posbench.model.layer_scope)
    wrapped = ext.install(original, setting) if scope == "all" else install_in_scope(ext, original, setting, scope)
    if wrapped is None:  # the identity at this setting: the plain model, bit for bit
        yield used
        return
    try:
        model.position = wrapped
        yield used
    finally:
        model.position = original


__all__ = ["EXTENSIONS", "ExtendedPosition", "NONE", "RelativeRemap", "applies_text", "axis_lengths",
           "evaluation_order", "extended", "extension_factor", "extension_options", "list_extensions",
           "method_type", "model_layout", "record_extension", "refusal", "resolve_extensions"]
