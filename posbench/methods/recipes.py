"""Recipes: the per-layer position designs of released models, each a named configuration.

The long-context models of 2025-2026 do not use one position method: they mix layer types (a
sliding-window RoPE layer, a global layer with another RoPE base or none) and add parts around the
rotation: RMSNorm on q and k, a learned per-head sink logit, chunked masks, a query temperature.
A recipe is a :class:`~posbench.methods.layers.Layers` schedule whose entries are layer types
(:class:`LayerType`, named ``local``, ``global``, ``rope``, ``nope``, ``chunked``) instead of
registered methods, so every hook (rotation, mask, normaliser) is the layer type's, per layer:

- ``gemma3`` (``Gemma3Attention``): 5 local : 1 global; local = window + RoPE base 10k, global =
  full attention + RoPE base 1M; RMSNorm on q and k per head (weight ``1 + w`` in Gemma's form).
- ``gemma4`` (``Gemma4TextAttention``): 5 local : 1 global; local = window + full RoPE base 10k,
  global = full attention + proportional RoPE on 25 % of the dimensions, base 1M; q/k RMSNorm per
  head, logits not scaled by ``1/sqrt(D)`` (Gemma 4's ``scaling = 1``).
- ``gpt_oss`` (``GptOssAttention``): alternating banded (window) and dense layers, RoPE base 150k,
  and a learned per-head sink logit in every layer: one more softmax column, then dropped, so
  ``p_ij = exp(l_ij) / (sum_j exp(l_ij) + exp(s_h))``.
- ``llama4`` (``Llama4TextAttention``, iRoPE): 3 chunked RoPE layers (keys in the query's chunk
  only, interleaved RoPE base 500k, L2 norm of q and k: RMSNorm without weight) : 1 global NoPE
  layer with the floor-log query temperature ``q * (1 + attn_scale * log(1 + floor((n + 1) /
  floor_scale)))``.
- ``smollm3`` (``SmolLM3Attention``): RoPE (base 2M) removed from every 4th layer; full attention.
- ``cohere2`` (Command A, ``Cohere2Attention``): 3 sliding-window RoPE layers (interleaved, base
  50k) : 1 global NoPE layer. ``swan`` is this pattern in the other order and with Llama's rotation.
- ``olmo3`` (``Olmo3Attention``): sliding window on 3 of 4 layers, RoPE base 500k on all; RMSNorm
  of q and k over all heads at once (the whole projection).

**One rule scales the releases' windows and chunks to posbench's context**: a release's size ``S``
becomes ``S * C / 8192`` at training context ``C`` (8192 tokens, the pretraining context of most
of them, maps to ``C``); at ``C = 256``: 4096 -> 128 (olmo3, cohere2, as ``swan``), 1024 -> 32
(gemma3, gemma4), 128 -> 4 (gpt_oss), llama4's chunk 8192 -> 256 and its ``floor_scale`` 8192 ->
256. So llama4's chunks equal C (its chunked layers are full attention inside the training
context, chunked past it), and its temperature is 1 up to position C - 2 and grows by
``0.1 log(1 + floor((n + 1) / C))`` past it: with the release's 8192 it would be 1 at every tested
length. The defaults below are for ``C = 256``; give the option (``method.window=``) at another C.

Departures from the releases, the same at every recipe: one key/value head per query head (no
grouped-query attention), no biases (gpt-oss has them), the posbench block around the attention
(RMSNorm, SwiGLU; Gemma's extra norms, Cohere's parallel block and the MoE layers are not
reproduced), scaled windows; gemma4's value RMSNorm and its shared key/value projection on the
global layers are left out, and its global layers keep the local layers' head dimension.
The parts are checked against the transformers classes, layer by layer, in
``tests/unit/methods/test_recipes.py``.

Positions: the rotation and llama4's temperature read position ids, the masks (window, chunk)
sequence indices, as everywhere in posbench; with the default ids they are the same.
"""

from __future__ import annotations

import copy
import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posbench.methods import build_method, register
from posbench.methods.base import ModelDims, Normalizer, PositionMethod, ScoreFn
from posbench.methods.layers import LayerEntry, Layers

QK_NORMS = ("none", "head", "all", "l2")
"""``head``: RMSNorm of each head's q and k (weight per channel, Gemma); ``all``: RMSNorm over all
heads at once (weight per channel of the projection, OLMo); ``l2``: RMSNorm without weight (Llama 4's
``L2Norm``); ``none``."""


class LayerType(PositionMethod):
    """One layer type of a recipe: an optional RoPE (``rope_base``; None = NoPE), QK-norm, a sink
    logit, a chunked mask, a query temperature and a logit scale. Built by :class:`Recipe` for the
    layers of its type (``dims.n_layers`` of them), not a method of its own."""

    name = "layer_type"

    def __init__(self, dims: ModelDims, *, rope_base: float | None = None, rotary_fraction: float = 1.0,
                 interleaved: bool = False, qk_norm: str = "none", qk_norm_eps: float = 1e-6, sink: bool = False,
                 chunk: int | None = None, floor_scale: float | None = None, attn_scale: float = 0.1,
                 logit_scale: float | None = None) -> None:
        super().__init__(dims)
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={qk_norm!r} is not one of {', '.join(QK_NORMS)}")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk={chunk!r} must be a positive integer or null")
        if floor_scale is not None and not floor_scale > 0:
            raise ValueError(f"floor_scale={floor_scale!r} must be positive or null")
        self.rope: PositionMethod | None = None
        if rope_base is not None:  # the proportional RoPE of Gemma 4: p_rope's frequencies base^(-2i/D)
            self.rope = (build_method("rope", dims, base=rope_base, interleaved=interleaved) if rotary_fraction == 1
                         else build_method("p_rope", dims, base=rope_base, interleaved=interleaved, p=rotary_fraction))
        self.qk_norm, self.qk_norm_eps = qk_norm, qk_norm_eps
        L, H, D = dims.n_layers, dims.n_heads, dims.head_dim
        if qk_norm in ("head", "all"):
            width = D if qk_norm == "head" else H * D
            self.q_norm = nn.Parameter(torch.ones(L, width))  # (L, D) or (L, H*D)
            self.k_norm = nn.Parameter(torch.ones(L, width))
        self.sinks = nn.Parameter(torch.zeros(L, H)) if sink else None  # (L, H) logits of the dropped column
        self.chunk, self.floor_scale, self.attn_scale, self.logit_scale = chunk, floor_scale, attn_scale, logit_scale
        self.has_score_term = chunk is not None  # type: ignore[misc]  # per instance
        self.uses_positions = self.rope is not None or floor_scale is not None  # type: ignore[misc]

    def with_rotation(self, rope: PositionMethod) -> LayerType:
        """A copy of this layer type rotating with ``rope`` (an evaluation-time extension of its
        RoPE, ``eval.extension_scope``); parameters are shared, this module is never changed."""
        clone = copy.copy(self)
        clone._modules = dict(self._modules)  # its own module dict
        clone._modules["rope"] = rope
        return clone

    def backend_limits(self) -> dict[str, str]:
        if self.sinks is None:
            return {}
        reason = "the sink logit is one more softmax column, which only eager adds"
        return {"sdpa": reason, "flex": reason}

    def norm(self, x: Tensor, layer: int, weight: Tensor | None) -> Tensor:
        """RMSNorm of x (B, H, T, D) in fp32: per head, or over all heads (``all``), times the
        layer's weight (none for ``l2``)."""
        xf = x.float()
        dims = (1, 3) if self.qk_norm == "all" else (3,)
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + self.qk_norm_eps)
        if weight is not None:
            w = weight[layer].float()
            xf = xf * (w.view(x.shape[1], 1, x.shape[3]) if self.qk_norm == "all" else w)
        return xf.to(x.dtype)

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        if self.qk_norm != "none":  # before the rotation (Gemma, OLMo); an L2 norm commutes with it (Llama 4)
            q = self.norm(q, layer, getattr(self, "q_norm", None))
            k = self.norm(k, layer, getattr(self, "k_norm", None))
        if self.rope is not None:
            q, k = self.rope.rotate_qk(q, k, positions, layer)
        if self.floor_scale is not None:  # (T,) or (B, T) -> (T, 1) or (B, 1, T, 1)
            n = positions.float()
            scale = 1 + self.attn_scale * torch.log1p(torch.floor((n + 1) / self.floor_scale))
            q = (q * (scale[:, None, :, None] if n.dim() == 2 else scale[:, None])).to(q.dtype)
        if self.logit_scale is not None:  # the backends divide by sqrt(D); the release scales by logit_scale
            q = q * (self.logit_scale * math.sqrt(q.shape[-1]))
        return q, k

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None,
                   x: Tensor | None = None) -> ScoreFn | None:
        if self.chunk is None:
            return None
        chunk = self.chunk

        def same_chunk(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            # keys outside the query's chunk are masked (sequence indices, as every mask)
            inside = torch.div(q_idx, chunk, rounding_mode="floor") == torch.div(kv_idx, chunk, rounding_mode="floor")
            return torch.where(inside, 0.0, float("-inf"))

        return same_chunk

    def normalizer(self, layer: int) -> Normalizer | None:
        if self.sinks is None:
            return None
        sink = self.sinks[layer]  # (H,)

        def with_sink(logits: Tensor) -> Tensor:
            s = sink.float().view(1, -1, 1, 1)  # (1, H, 1, 1)
            top = torch.maximum(logits.amax(dim=-1, keepdim=True), s)  # (B, H, T, 1)
            e = (logits - top).exp()
            return e / (e.sum(dim=-1, keepdim=True) + (s - top).exp())  # the sink column dropped

        return with_sink

    def describe(self) -> str:
        """What the layer type does, in a few words (docs/methods-overview.md's recipe table)."""
        if self.rope is None:
            parts = ["NoPE"]
        else:
            fraction = getattr(self.rope, "p", 1.0)
            parts = [f"RoPE {self.rope.base:.0f}" + (" interleaved" if self.rope.interleaved else "")
                     + (f" on {fraction:.0%} of pairs" if fraction != 1 else "")]
        norms = {"head": "RMSNorm q, k per head", "all": "RMSNorm q, k over all heads", "l2": "L2 norm q, k"}
        parts += [norms[self.qk_norm]] if self.qk_norm != "none" else []
        parts += [f"query temperature (floor_scale {self.floor_scale:g}, attn_scale {self.attn_scale:g})"
                  ] if self.floor_scale is not None else []
        parts += [f"logits x {self.logit_scale:g} (no 1/sqrt(D))"] if self.logit_scale is not None else []
        parts += ["sink logit per head"] if self.sinks is not None else []
        return ", ".join(parts)

    def extra_repr(self) -> str:
        parts = [f"rope={getattr(self.rope, 'base', None)}", f"qk_norm={self.qk_norm}"]
        parts += [f"{n}={getattr(self, n)}" for n in ("chunk", "floor_scale", "logit_scale") if getattr(self, n) is not None]
        return ", ".join(parts + (["sink"] if self.sinks is not None else []))


def layer(kind: str, window: int | None = None, **options: Any) -> dict[str, Any]:
    """A pattern entry of a recipe: layer type ``kind`` with its :class:`LayerType` options."""
    return {"method": kind, "window": window, "options": options}


class Recipe(Layers):
    """A released model's per-layer position design (module docstring): a :class:`Layers` schedule
    of :class:`LayerType` entries. Subclasses set ``release`` and build their pattern."""

    release: ClassVar[str] = ""
    """The transformers attention class the recipe's layers are checked against."""

    departures: ClassVar[str] = ""
    """How the recipe departs from its release beyond what every recipe shares (module docstring)."""

    def build_sub(self, entry: LayerEntry, dims: ModelDims) -> PositionMethod:
        return LayerType(dims, **entry.options)

    def layer_summary(self) -> list[str]:
        """The pattern as runs of equal entries: the layers each covers (``l mod period``), its
        layer type, its mask and what the type does."""
        period, runs = len(self.entries), []  # [first, last, entry]
        for index, entry in enumerate(self.entries):
            if runs and runs[-1][2] == entry:
                runs[-1][1] = index
            else:
                runs.append([index, index, entry])
        lines = []
        for first, last, entry in runs:
            sub = LayerType(ModelDims(self.dims.d_model, self.dims.n_heads, 1), **entry.options)
            mask = (f"window {entry.window}" if entry.window is not None
                    else f"chunk {sub.chunk}" if sub.chunk is not None else "full")
            layers = f"{first}" if first == last else f"{first}-{last}"
            lines.append(f"{layers} mod {period}: {entry.method} ({mask}; {sub.describe()})")
        return lines


@register
class Gemma3(Recipe):
    name = "gemma3"
    departures = "window 1024 -> 32; Gemma's q/k norm weight (1 + w) is held as one weight (same function)"
    release = "Gemma3Attention"
    enters = "per layer: 5 local (window 32, RoPE 10k) : 1 global (full, RoPE 1M); RMSNorm on q, k per head"
    source = "Gemma Team 2025 (Gemma 3); transformers gemma3"
    past_context = "local layers never see a distance past W; the global layers' RoPE (base 1M) sees distances >= C"

    def __init__(self, dims: ModelDims, *, window: int = 32, local_base: float = 10000.0,
                 global_base: float = 1000000.0, qk_norm_eps: float = 1e-6) -> None:
        norm = {"qk_norm": "head", "qk_norm_eps": qk_norm_eps}
        super().__init__(dims, pattern=[layer("local", window, rope_base=local_base, **norm)] * 5
                         + [layer("global", rope_base=global_base, **norm)])


@register
class Gemma4(Recipe):
    name = "gemma4"
    departures = ("window 1024 -> 32; no value RMSNorm; the global layers keep the local head dimension "
                  "and separate key and value projections")
    release = "Gemma4TextAttention"
    enters = ("per layer: 5 local (window 32, RoPE 10k) : 1 global (full, RoPE 1M on 25 % of dims); "
              "RMSNorm on q, k per head; logits unscaled")
    source = "Gemma Team 2026 (Gemma 4); transformers gemma4"
    past_context = ("local layers never see a distance past W; the global layers rotate only their 25 % "
                    "highest frequencies, the rest carry no position")

    def __init__(self, dims: ModelDims, *, window: int = 32, local_base: float = 10000.0,
                 global_base: float = 1000000.0, global_rotary_fraction: float = 0.25,
                 qk_norm_eps: float = 1e-6) -> None:
        norm = {"qk_norm": "head", "qk_norm_eps": qk_norm_eps, "logit_scale": 1.0}
        super().__init__(dims, pattern=[layer("local", window, rope_base=local_base, **norm)] * 5 + [
            layer("global", rope_base=global_base, rotary_fraction=global_rotary_fraction, **norm)])


@register
class GptOss(Recipe):
    name = "gpt_oss"
    departures = "window 128 -> 4; no biases; the sink column runs in eager only"
    release = "GptOssAttention"
    enters = "per layer: banded (window 4) and dense layers alternating, RoPE 150k; a learned sink logit per head"
    source = "OpenAI 2025 (gpt-oss); transformers gpt_oss"
    past_context = "banded layers never see a distance past W; the sinks let a head attend to nothing"
    backend_note = "the sink column: eager only"

    def __init__(self, dims: ModelDims, *, window: int = 4, base: float = 150000.0) -> None:
        super().__init__(dims, pattern=[layer("local", window, rope_base=base, sink=True),
                                        layer("global", rope_base=base, sink=True)])


@register
class Llama4(Recipe):
    name = "llama4"
    departures = ("chunk 8192 -> 256 and floor_scale 8192 -> 256; the temperature reads position ids "
                  "(the release: sequence indices, the same by default); no MoE")
    release = "Llama4TextAttention"
    enters = ("per layer: 3 chunked (chunk 256, RoPE 500k, L2 QK-norm) : 1 global NoPE with the floor-log "
              "query temperature (floor_scale 256)")
    source = "Meta 2025 (Llama 4); transformers llama4"
    has_score_term = True  # the chunked mask, a -inf score term
    past_context = ("chunked layers never see keys of an earlier chunk; the NoPE layers' query temperature, 1 "
                    "inside C, grows as 1 + 0.1 log(1 + floor((n + 1) / 256)) past it")

    def __init__(self, dims: ModelDims, *, chunk: int = 256, base: float = 500000.0, floor_scale: float = 256.0,
                 attn_scale: float = 0.1, qk_norm_eps: float = 1e-5) -> None:
        rope = layer("chunked", chunk=chunk, rope_base=base, interleaved=True, qk_norm="l2", qk_norm_eps=qk_norm_eps)
        super().__init__(dims, pattern=[rope] * 3 + [layer("nope", floor_scale=floor_scale, attn_scale=attn_scale)])


@register
class SmolLM3(Recipe):
    name = "smollm3"
    departures = "none beyond those every recipe shares"
    release = "SmolLM3Attention"
    enters = "per layer: 3 RoPE (base 2M) : 1 NoPE, full attention"
    source = "Hugging Face 2025 (SmolLM3); transformers smollm3"
    past_context = "the RoPE layers see distances >= C; the NoPE layers read none"

    def __init__(self, dims: ModelDims, *, base: float = 2000000.0) -> None:
        super().__init__(dims, pattern=[layer("rope", rope_base=base)] * 3 + [layer("nope")])


@register
class Cohere2(Recipe):
    name = "cohere2"
    departures = "window 4096 -> 128; posbench's pre-norm block, not Cohere's parallel block"
    release = "Cohere2Attention"
    enters = "per layer: 3 local (window 128, interleaved RoPE 50k) : 1 global NoPE"
    source = "Cohere 2025 (Command A); transformers cohere2"
    past_context = "local layers never see a distance past W; only the global NoPE layers reach far keys"

    def __init__(self, dims: ModelDims, *, window: int = 128, base: float = 50000.0) -> None:
        super().__init__(dims, pattern=[layer("local", window, rope_base=base, interleaved=True)] * 3
                         + [layer("global")])


@register
class Olmo3(Recipe):
    name = "olmo3"
    departures = "window 4096 -> 128"
    release = "Olmo3Attention"
    enters = "per layer: 3 local (window 128) : 1 global, RoPE 500k on all; RMSNorm on q, k over all heads"
    source = "Ai2 2025 (OLMo 3); transformers olmo3"
    past_context = "local layers never see a distance past W; the global layers' RoPE sees distances >= C"

    def __init__(self, dims: ModelDims, *, window: int = 128, base: float = 500000.0,
                 qk_norm_eps: float = 1e-6) -> None:
        norm = {"rope_base": base, "qk_norm": "all", "qk_norm_eps": qk_norm_eps}
        super().__init__(dims, pattern=[layer("local", window, **norm)] * 3 + [layer("global", **norm)])
