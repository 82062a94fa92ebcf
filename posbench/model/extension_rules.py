"""Evaluation-time rules of the streaming and long-context papers, registered with the others in
:data:`posbench.model.extension.EXTENSIONS`:

- ``streaming_llm``: StreamingLLM (Xiao et al. 2024, reference mit-han-lab/streaming-llm
  ``kv_cache.py`` + ``pos_shift``): the cache keeps the first S tokens (attention sinks) and the
  R most recent ones (the query included); keys are rotated at their index in the cache, so a
  query past the first S + R tokens sits at S + R - 1, the recent keys keep their distance and
  sink j is seen at distance S + R - 1 - j.
- ``lm_infinite``: LM-Infinite (Han et al. 2024, reference Glaciohound/LM-Infinite
  ``models/llama.py`` + ``lambda_attention.py``): the Λ-shaped mask (the first n_global tokens
  and a local window of C) and distances capped at C: a global token beyond the window is seen
  with the query rotated at C and the key unrotated.
- ``dual_chunk``: Dual Chunk Attention (An et al. 2024, reference HKUNLP/ChunkLlama
  ``chunkllama_attn_replace.py``): keys at position m % L (chunks of L = s - w tokens); a query at
  n % L for keys of its own chunk (intra), at min(n % L + L, s) for the previous chunk
  (successive), at min(2L - 1, s) for every older one (inter); the three parts merged by their
  log-sum-exp, which is one softmax over all keys with these logits.
- ``longrope``: LongRoPE (Ding et al. 2024) as Phi-3 ships it: per-frequency rescale factors
  from a static file (``short_factor`` for L <= C, ``long_factor`` past it) and the attention
  factor sqrt(1 + ln s / ln C), from transformers' ``longrope`` rope type.

In a full forward pass of L tokens (posbench evaluates whole sequences, no cache) the first two
are a mask plus a remapping of the far keys (:class:`~posbench.model.extended_position.RelativeRemap`),
so they run on every backend like ReRoPE and Self-Extend (and cost what they cost:
docs/context-extension.md). ``setting`` is a :class:`posbench.model.extension.Setting`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posbench.core.errors import PosbenchError
from posbench.evaluation.settings import DualChunkConfig, LMInfiniteConfig, LongRoPEConfig, StreamingLLMConfig
from posbench.methods.base import PositionMethod, ScoreFn
from posbench.model.extended_position import ExtendedPosition, RelativeRemap, transform_apart

# ----------------------------------------------------------------------------- StreamingLLM


def streaming_llm_options(setting: Any) -> dict[str, Any]:
    opts = setting.options.get("streaming_llm") or StreamingLLMConfig()
    window = opts.window if opts.window is not None else max(1, setting.train_context - opts.sinks)
    return {"sinks": opts.sinks, "window": window}


def streaming_llm(method: PositionMethod, setting: Any) -> ExtendedPosition | None:
    o = streaming_llm_options(setting)
    S, R = o["sinks"], o["window"]
    if setting.length <= S + R:  # the cache never evicts: the plain model
        return None
    # The query at n sits at min(n, S + R - 1) in the cache; a key at distance >= R from it is a
    # sink (the others are evicted, masked), at its own index j.
    last = S + R - 1
    return ExtendedPosition(method, window=R, sinks=S, remap=RelativeRemap(
        R, lambda pos: pos.clamp(max=last).double(), lambda pos: pos.double()))


# ----------------------------------------------------------------------------- LM-Infinite


def lm_infinite_options(setting: Any) -> dict[str, Any]:
    opts = setting.options.get("lm_infinite") or LMInfiniteConfig()
    window = opts.window if opts.window is not None else setting.train_context
    return {"global_tokens": opts.global_tokens, "window": window}


def lm_infinite(method: PositionMethod, setting: Any) -> ExtendedPosition | None:
    o = lm_infinite_options(setting)
    G, W = o["global_tokens"], o["window"]
    if setting.length <= W:  # every key within the local branch: the plain model
        return None
    # Beyond the local branch only the global tokens are visible, each at distance W: the
    # reference's stationary query (rotated at the distance limit W) and unrotated key.
    return ExtendedPosition(method, window=W, sinks=G, remap=RelativeRemap(
        W, lambda pos: torch.full_like(pos, W, dtype=torch.float64), lambda pos: torch.zeros_like(pos, dtype=torch.float64)))


# ----------------------------------------------------------------------------- Dual Chunk Attention


class DualChunk(ExtendedPosition):
    """A trained rotary method under Dual Chunk Attention: every (query, key) logit is the method's
    own at the positions of the pair's part (intra, successive, inter; see the module docstring).

    :meth:`rotate_qk` returns the plain q, k (what the backend multiplies) and keeps the three
    remapped pairs; :meth:`score_term` adds, per pair, the remapped logit minus the plain one
    (dense (B, H, T, T) fp32, like ReRoPE's), so every backend computes the remapped attention."""

    def __init__(self, inner: PositionMethod, chunk_size: int, local_window: int) -> None:
        super().__init__(inner)  # no adjustment of its own: every other hook is the trained method's
        self.chunk_size, self.chunk_len = chunk_size, chunk_size - local_window
        self.has_score_term = True  # type: ignore[misc]
        self.parts: tuple[Tensor, Tensor, list[tuple[Tensor, Tensor]]] | None = None

    def query_positions(self, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(intra, successive, inter) query positions, float64, each of ``positions``' shape."""
        L, s = self.chunk_len, self.chunk_size
        within = torch.remainder(positions, L).double()
        return within, (within + L).clamp(max=s), torch.full_like(within, float(min(2 * L - 1, s)))

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        plain = self.inner.rotate_qk(q, k, positions, layer)  # (B, H, T, D) each
        keys = torch.remainder(positions, self.chunk_len).double()
        self.parts = (*plain, [transform_apart(self.inner, q, k, at, keys, layer) for at in self.query_positions(positions)])
        return plain

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None,
                   x: Tensor | None = None) -> ScoreFn | None:
        if self.parts is None or self.parts[0] is not q or self.parts[1] is not k:
            raise RuntimeError("the remapped q, k belong to the rotate_qk call of this layer; call it first")
        q_plain, k_plain, parts = self.parts
        self.parts = None
        inner = self.inner.score_term(q, positions, layer, k=k, x=x) if self.inner.has_score_term else None
        with torch.autocast(q.device.type, enabled=False):
            logits = [torch.einsum("bhid,bhjd->bhij", a.float(), b.float()) for a, b in parts]  # (B, H, T, T) each
            chunk = torch.div(positions, self.chunk_len, rounding_mode="floor")  # (T,) or (B, T)
            back = (chunk[..., :, None] - chunk[..., None, :])[..., None, :, :] if chunk.dim() == 2 else chunk[:, None] - chunk[None, :]
            term = torch.where(back == 0, logits[0], torch.where(back == 1, logits[1], logits[2]))
            term -= torch.einsum("bhid,bhjd->bhij", q_plain.float(), k_plain.float())
            term *= q.shape[-1] ** -0.5  # the backends' scale

        def score(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            remapped = term[b, h, q_idx, kv_idx]
            return remapped if inner is None else remapped + inner(b, h, q_idx, kv_idx)

        return score

    def extra_repr(self) -> str:
        return f"inner={self.inner.name}, chunk_size={self.chunk_size}, chunk_len={self.chunk_len}"


def dual_chunk_options(setting: Any) -> dict[str, Any]:
    opts = setting.options.get("dual_chunk") or DualChunkConfig()
    C = setting.train_context
    size = opts.chunk_size if opts.chunk_size is not None else max(2, C * 3 // 4)
    window = opts.local_window if opts.local_window is not None else max(1, C // 16)
    if window >= size:
        raise PosbenchError(f"eval.dual_chunk.local_window ({window}) must be below eval.dual_chunk.chunk_size ({size})")
    return {"chunk_size": size, "local_window": window}


def dual_chunk(method: PositionMethod, setting: Any) -> DualChunk | None:
    o = dual_chunk_options(setting)
    if setting.length <= o["chunk_size"] - o["local_window"]:  # one chunk: every query intra, the plain model
        return None
    return DualChunk(method, o["chunk_size"], o["local_window"])


# ----------------------------------------------------------------------------- LongRoPE


def read_factors(path: str, frequencies: int) -> tuple[list[float], list[float]]:
    """``short_factor`` and ``long_factor`` of a LongRoPE factor file (top level, or under
    ``rope_scaling`` / ``rope_parameters`` as in a model's config.json), ``frequencies`` numbers each."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PosbenchError(f"eval.longrope.factors={path} is not a readable JSON file ({type(err).__name__})") from None
    block = next((b for b in (data, data.get("rope_scaling"), data.get("rope_parameters"))
                  if isinstance(b, dict) and "long_factor" in b and "short_factor" in b), None)
    if block is None:
        raise PosbenchError(f"eval.longrope.factors={path} has no short_factor and long_factor "
                            "(at the top level, or under rope_scaling as in Phi-3's config.json)")
    short, long = block["short_factor"], block["long_factor"]
    for name, values in (("short_factor", short), ("long_factor", long)):
        if not isinstance(values, list) or len(values) != frequencies or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values):
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise PosbenchError(f"eval.longrope.factors={path}: {name} must be {frequencies} positive numbers "
                                f"(one per rotated frequency of this model), got {got}")
    return [float(v) for v in short], [float(v) for v in long]


def longrope_options(setting: Any) -> dict[str, Any]:
    opts = setting.options.get("longrope") or LongRoPEConfig()
    return {"factors": opts.factors}


def longrope_params(method: PositionMethod, setting: Any) -> dict[str, Any] | None:
    """transformers' ``longrope`` parameters for ``method`` at ``setting`` (the factor file's short
    and long factors, s = the setting's factor, C as the original context), or None where they are
    the identity (L <= C, short factors of 1, s = 1)."""
    path = longrope_options(setting)["factors"]
    if path is None:
        raise PosbenchError("eval.extension=longrope needs its factor file: eval.longrope.factors=<json with "
                            "short_factor and long_factor, as in Phi-3's config.json>")
    short, long = read_factors(path, method.rotary_dim // 2)  # type: ignore[attr-defined]
    factor = float(setting.factor or 1.0)
    if setting.length <= setting.train_context and factor == 1.0 and all(f == 1.0 for f in short):
        return None
    return {"factor": factor, "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": setting.train_context}
