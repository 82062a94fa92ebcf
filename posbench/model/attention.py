"""Attention backends that all consume the same position-method description: causal for the
language model, bidirectional (``causal=False``) for the grid encoder.

- ``eager``: explicit fp32 softmax; the reference every other path is tested against. The only
  backend that holds the attention probabilities (:func:`eager_probabilities`, which ``posbench
  viz`` records), so the only one that adds a value term or runs a method's own normaliser in
  place of the softmax (``PositionMethod.normalizer``: stick-breaking).
- ``sdpa``: ``F.scaled_dot_product_attention``; ``is_causal=True`` (flash / cuDNN kernels) when
  the method has no score term and no window, otherwise the score term and mask materialised as
  an additive mask.
- ``flex``: FlexAttention with the score term as ``score_mod`` and a cached causal (optionally
  windowed) block mask; never materialises a (T, T) tensor.
- ``auto``: flex on CUDA for methods with a score term or with a window, sdpa otherwise; then the
  first backend the method can run in (``PositionMethod.backend_limits``: cope's gates and
  relative's value term need the dense attention matrix).

Masks are one definition too (:func:`visible`: causal, optionally a sliding window of W keys):
dense boolean masks for eager and sdpa, a BlockMask for flex. The window is per layer (a method
may give its layers their own, ``PositionMethod.attention_window``); the model builds one
BlockMask per distinct window.

:func:`attention_hook` lets a tool see (and compute) every attention call of a forward pass,
e.g. ``posbench viz`` recording the attention weights, without touching the model.

A method's key bias (``PositionMethod.key_bias``: a term per key, the same for every query) needs
no score function: sdpa and flex fold it into extra key channels (:func:`fold_key_bias`), so it
runs in fused kernels; eager and the hooks see it as an ordinary score term.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from posbench.core.errors import PosbenchError
from posbench.methods.base import Normalizer, PositionMethod, ScoreFn, ValueTerm, dense_score

BACKENDS = ("auto", "eager", "sdpa", "flex")

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    FLEX_AVAILABLE = True
except ImportError:  # pragma: no cover - torch < 2.5
    FLEX_AVAILABLE = False


def resolve_backend(
    name: str, method: PositionMethod | bool, device: torch.device, window: int | None = None
) -> str:
    """Map a configured backend (possibly ``auto``) to the one that will run on ``device``.

    ``method``: the position method (its ``has_score_term`` and ``backend_limits`` decide), or
    just whether it has a score term. An explicit backend the method cannot run in is a one-line
    error; ``auto`` picks the first of its preferences the method can run in.
    """
    if name not in BACKENDS:
        raise PosbenchError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "flex" and not FLEX_AVAILABLE:
        raise PosbenchError("model.attention=flex needs torch>=2.5 with FlexAttention; use sdpa")
    has_score = method if isinstance(method, bool) else method.has_score_term  # instance: wrappers set it
    limits = {} if isinstance(method, bool) else method.backend_limits()
    if name != "auto":
        if name in limits:
            raise PosbenchError(
                f"model.attention={name} cannot run method={method.name}: {limits[name]}; use model.attention=auto"
            )
        return name
    wants_flex = device.type == "cuda" and FLEX_AVAILABLE and (has_score or window is not None)
    preferences = ("flex", "sdpa", "eager") if wants_flex else ("sdpa", "eager")
    return next(backend for backend in preferences if backend not in limits)


def visible(q_idx: Tensor, kv_idx: Tensor, window: int | None = None, causal: bool = True) -> Tensor:
    """The one mask definition: key j is visible to query i if j <= i (and i - j < window);
    without ``causal`` (the grid encoder, which takes no window) every key is visible."""
    if not causal:
        return torch.ones_like(q_idx >= kv_idx)
    allowed = q_idx >= kv_idx
    if window is not None:
        allowed = allowed & (q_idx - kv_idx < window)
    return allowed


def causal_mask(length: int, device: torch.device, window: int | None = None, causal: bool = True) -> Tensor:
    """:func:`visible` on the full grid -> (T, T) bool."""
    idx = torch.arange(length, device=device)
    return visible(idx[:, None], idx[None, :], window, causal)


def add_value_term(out: Tensor, probs: Tensor, value: ValueTerm) -> Tensor:
    """out_i += sum_j p_ij table[bucket_ij]: probabilities summed per bucket, then one matmul."""
    if value.mass is not None:
        return out + torch.einsum("bhin,nd->bhid", value.mass(probs), value.table.to(probs.dtype))
    B, H, T, _ = probs.shape
    bucket = dense_score(value.bucket, B, H, T, probs.device).expand(B, H, T, T)  # (B, H, T, T)
    mass = probs.new_zeros(B, H, T, value.table.shape[0]).scatter_add(-1, bucket, probs)  # (B, H, T, n)
    return out + torch.einsum("bhin,nd->bhid", mass, value.table.to(probs.dtype))


def eager_probabilities(q: Tensor, k: Tensor, score: ScoreFn | None, window: int | None = None,
                        normalize: Normalizer | None = None, scale: float | None = None,
                        causal: bool = True) -> Tensor:
    """The eager backend's attention probabilities: softmax(q k^T / sqrt(D) + score) over the
    visible keys, in fp32 (also under autocast). ``normalize`` replaces the softmax over the
    masked logits (None: the softmax); ``causal=False``: every key is visible (the grid
    encoder). (B, H, T, D) -> (B, H, T, T)."""
    B, H, T, D = q.shape
    with torch.autocast(q.device.type, enabled=False):
        logits = torch.einsum("bhid,bhjd->bhij", q.float(), k.float()) * (D**-0.5 if scale is None else scale)
        if score is not None:
            logits = logits + dense_score(score, B, H, T, q.device).float()
        if causal:
            logits = logits.masked_fill(~causal_mask(T, q.device, window), float("-inf"))
        return logits.softmax(dim=-1) if normalize is None else normalize(logits)  # (B, H, T, T)


def eager_output(probs: Tensor, v: Tensor, value: ValueTerm | None = None) -> Tensor:
    """The eager backend's output from its probabilities (B, H, T, T): p v in fp32, plus the
    value term, in v's dtype. -> (B, H, T, D of v)."""
    with torch.autocast(probs.device.type, enabled=False):
        out = torch.einsum("bhij,bhjd->bhid", probs, v.float())
        if value is not None:
            out = add_value_term(out, probs, value)
        return out.to(v.dtype)


def eager_attention(q: Tensor, k: Tensor, v: Tensor, score: ScoreFn | None, block_mask=None,
                    window: int | None = None, value: ValueTerm | None = None,
                    normalize: Normalizer | None = None, scale: float | None = None,
                    causal: bool = True) -> Tensor:
    """Reference: softmax(q k^T / sqrt(D) + score) v in fp32, also under autocast. (B, H, T, D).
    ``normalize`` replaces the softmax over the masked logits (None: the softmax)."""
    return eager_output(eager_probabilities(q, k, score, window, normalize, scale, causal), v, value)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, score: ScoreFn | None, block_mask=None,
                   window: int | None = None, value: ValueTerm | None = None,
                   normalize: Normalizer | None = None, scale: float | None = None,
                   causal: bool = True) -> Tensor:
    check_softmax_only("sdpa", value, normalize)
    if not causal:  # the grid encoder: every key visible, no window
        mask = None if score is None else dense_score(score, *q.shape[:3], q.device).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if score is None and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    B, H, T, _ = q.shape
    allowed = causal_mask(T, q.device, window)  # (T, T)
    if score is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    # SDPA wants the mask in q's dtype: under bf16 the bias is rounded (flex keeps it fp32,
    # which is one reason auto picks flex on CUDA for score-term methods).
    mask = dense_score(score, B, H, T, q.device).to(q.dtype)  # (B|1, H, T, T)
    mask = mask.masked_fill(~allowed, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def check_softmax_only(backend: str, value: ValueTerm | None, normalize: Normalizer | None) -> None:
    """A fused backend never holds the attention probabilities: refuse a value term or a
    normaliser (resolve_backend keeps such methods away; this guards direct calls)."""
    if value is not None:
        raise PosbenchError(f"{backend} cannot add a value term: it never holds the attention probabilities")
    if normalize is not None:
        raise PosbenchError(f"{backend} always normalises with the softmax; a method's own normaliser runs in eager only")


@functools.lru_cache(maxsize=32)
def causal_block_mask(length: int, device: str, window: int | None = None):
    """The causal (optionally windowed) BlockMask for one length, built once and reused by every
    layer and step; blocks wholly outside the window are skipped, never computed."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return visible(q_idx, kv_idx, window)

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=length, KV_LEN=length, device=device)


# torch.compiler.disable imports torch._dynamo where it decorates: about 1.5 s added to every
# start of every command, compiled or not. torch's lazy form of it (what torch's own optimizers
# use) imports dynamo at the first call instead; either way the call is one graph break in a
# compiled forward (tests/unit/model/test_fast_paths.py checks it).
_outside_compiled_graphs = getattr(torch, "_disable_dynamo", torch.compiler.disable)


@_outside_compiled_graphs
def prebuilt_block_mask(length: int, device: str, window: int | None = None):
    """:func:`causal_block_mask` from outside any compiled graph: called from a compiled forward,
    it is one graph break that returns the cached mask as an input to the rest of the graph,
    where tracing :func:`causal_block_mask` would rebuild the mask on every forward."""
    return causal_block_mask(length, device, window)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    # Evaluation meets several lengths and partial last batches; each shape is one compile.
    # The default limit (8) would silently drop to the slow O(T^2) eager path past it.
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_backend(q: Tensor, k: Tensor, v: Tensor, score: ScoreFn | None, block_mask=None,
                           window: int | None = None, value: ValueTerm | None = None,
                           normalize: Normalizer | None = None, scale: float | None = None,
                           causal: bool = True) -> Tensor:
    check_softmax_only("flex", value, normalize)
    if not q.is_cuda and torch.is_grad_enabled() and q.requires_grad:
        # Refuse before the forward: torch's CPU FlexAttention has no backward, and its
        # NotImplementedError would surface mid-step as a traceback.
        raise PosbenchError(
            "model.attention=flex cannot train on the CPU (FlexAttention has no CPU backward); "
            "use model.attention=sdpa (auto picks it on the CPU)"
        )
    T = q.shape[-2]
    if block_mask is None and causal:  # non-causal (the grid encoder): no mask, every block computed
        block_mask = causal_block_mask(T, str(q.device), window)
    score_mod = None
    if score is not None:

        def score_mod(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return s + score(b, h, q_idx, kv_idx)

    # FlexAttention is only fast compiled; inside an already compiled model it is inlined.
    run = flex_attention
    if q.is_cuda and not torch.compiler.is_compiling():
        run = _compiled_flex()
    return run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)


_IMPLEMENTATIONS = {"eager": eager_attention, "sdpa": sdpa_attention, "flex": flex_attention_backend}

# fn(q, k, v, score, window, value, normalize, causal) -> (B, H, T, D): computes attention in
# place of the backend.
AttentionHook = Callable[[Tensor, Tensor, Tensor, "ScoreFn | None", "int | None", "ValueTerm | None",
                          "Normalizer | None", bool], Tensor]
_HOOKS: list[AttentionHook] = []


@contextlib.contextmanager
def attention_hook(fn: AttentionHook) -> Iterator[None]:
    """Within the block, :func:`attend` calls ``fn(q, k, v, score, window, value, normalize, causal)``
    instead of the backend (the innermost hook wins), so ``fn`` sees exactly what the model hands it."""
    _HOOKS.append(fn)
    try:
        yield
    finally:
        _HOOKS.remove(fn)


KEY_BIAS_CHANNELS = 2  # a key bias in two channels, high and low part: exact to ~2^-16 relative in bf16


def fold_key_bias(q: Tensor, k: Tensor, v: Tensor, key_bias: Tensor) -> tuple[Tensor, Tensor, Tensor, float]:
    """q, k, v (B, H, T, D) and a key bias (B, H, T) -> q', k', v' (B, H, T, D') and the scale with
    which ``softmax(q' k'^T * scale) v'`` is the attention with ``key_bias[j]`` added to every
    query's logit of key j (the output's first D channels).

    The bias times sqrt(D) goes into two key channels, its part representable in q's dtype and
    the rest (0 in fp32; under bf16 the rest keeps it to ~2^-16 relative, where one channel would
    round a bias of 100 by up to 0.5), with query channels of 1; the scale stays 1/sqrt(D). All
    three are zero-padded to a multiple of 8 channels (the fused kernels' requirement).
    """
    D = q.shape[-1]
    scaled = key_bias.float() * D**0.5  # (B, H, T)
    high = scaled.to(q.dtype)
    low = (scaled - high.float()).to(q.dtype)
    pad = -(D + KEY_BIAS_CHANNELS) % 8
    zeros = q.new_zeros(*q.shape[:-1], pad)
    ones = q.new_ones(*q.shape[:-1], KEY_BIAS_CHANNELS)
    q = torch.cat((q, ones, zeros), dim=-1)
    k = torch.cat((k, high[..., None].to(k.dtype), low[..., None].to(k.dtype), zeros.to(k.dtype)), dim=-1)
    v = torch.cat((v, v.new_zeros(*v.shape[:-1], KEY_BIAS_CHANNELS + pad)), dim=-1)
    return q, k, v, D**-0.5


def with_key_bias(score: ScoreFn | None, key_bias: Tensor) -> ScoreFn:
    """``score`` plus the key bias (B, H, T) as one score function (eager, hooks)."""

    def biased(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        term = key_bias[b, h, kv_idx]
        return term if score is None else score(b, h, q_idx, kv_idx) + term

    return biased


def attend(q: Tensor, k: Tensor, v: Tensor, score: ScoreFn | None, backend: str, block_mask=None,
           window: int | None = None, value: ValueTerm | None = None, normalize: Normalizer | None = None,
           key_bias: Tensor | None = None, causal: bool = True) -> Tensor:
    """Causal attention with an optional additive score term. (B, H, T, D) -> (B, H, T, D).

    ``block_mask``: flex's BlockMask, built once per forward by the model and shared by its
    layers (inside torch.compile the lru_cache is not honoured, so building it per layer would
    recompute it per layer); it must agree with ``window``. ``window``: keys ``window`` or more
    positions back are masked (the window baseline). ``value``: a value-side term (eager only).
    ``normalize``: replaces the softmax (eager only; see ``PositionMethod.normalizer``).
    ``key_bias``: (B, H, T) added to every query's logit of key j (``PositionMethod.key_bias``).
    ``causal=False``: every key is visible to every query (the grid encoder; no window).
    """
    if key_bias is not None and (_HOOKS or backend == "eager"):
        score, key_bias = with_key_bias(score, key_bias), None
    if _HOOKS:  # an attention_hook is active (e.g. posbench viz recording the weights)
        return _HOOKS[-1](q, k, v, score, window, value, normalize, causal)
    if key_bias is None:
        return _IMPLEMENTATIONS[backend](q, k, v, score, block_mask, window, value, normalize, causal=causal)
    D = v.shape[-1]
    q, k, v, scale = fold_key_bias(q, k, v, key_bias)
    return _IMPLEMENTATIONS[backend](q, k, v, score, block_mask, window, value, normalize, scale,
                                     causal=causal)[..., :D]
