"""The trained position method as an extension uses it at evaluation: :class:`ExtendedPosition`
delegates every hook to the trained method, with the adjustments an extension rule
(:mod:`posbench.model.extension`) asks for; :class:`RelativeRemap` is ReRoPE's and Self-Extend's
remapping of far keys."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from posbench.core.errors import PosbenchError
from posbench.methods.base import OverBase, PositionMethod, ScoreFn, distance


@dataclass(frozen=True)
class RelativeRemap:
    """Keys at distance ``d >= window`` (position ids) from the query are scored with the query
    transformed at ``query_at(positions)`` and the key at ``key_at(positions)`` (float position
    ids, same shape as ``positions``) instead of at their own positions."""

    window: int
    query_at: Callable[[Tensor], Tensor]
    key_at: Callable[[Tensor], Tensor]


def transform_apart(method: PositionMethod, q: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor,
                    layer: int) -> tuple[Tensor, Tensor]:
    """q (B, H, T, D) transformed at ``q_positions`` and k at ``k_positions`` by ``method.rotate_qk``.

    ONE call on the sequence ``[q; q]`` / ``[k; k]`` at positions ``[q_positions; k_positions]``
    (2T tokens): a transform that reads the whole row of positions (xpos centres its scales on
    it) sees one row for queries and keys, so their scores stay those of the method."""
    T = q.shape[-2]
    qq, kk = method.rotate_qk(torch.cat((q, q), dim=-2), torch.cat((k, k), dim=-2),
                              torch.cat((q_positions, k_positions), dim=-1), layer)
    return qq[..., :T, :], kk[..., T:, :]


class ExtendedPosition(OverBase):
    """A trained position method with evaluation-time adjustments; every hook delegates to it.

    Adjustments (each optional):
      ``inv_freq``: rotary frequencies (R/2,): ``inner`` is replaced by its copy rotating with
          them (:meth:`Rotary.with_frequencies`; its rotation code stays the trained one).
      ``position_scale``: input tables are read at ``position / position_scale``
          (:meth:`InputTable.input_embedding_at`; learned tables: at most at row
          ``trained_positions - 1``, the last trained row).
      ``qk_scale``: q and k multiplied by it after the rotation (transformers multiplies cos and
          sin by the rope attention factor, which is the same linear map).
      ``log_context``: logits of query position n scaled by ``max(1, log(n + 1) / log(C))``.
      ``window``: keys farther than ``window - 1`` positions behind the query are masked.
      ``sinks``: with ``window``, keys at positions below ``sinks`` stay visible at every
          distance (StreamingLLM's attention sinks, LM-Infinite's global tokens).
      ``remap``: keys at distance >= ``remap.window`` scored at remapped positions (ReRoPE,
          Self-Extend): :meth:`rotate_qk` also transforms q and k at those positions and keeps
          them for the :meth:`score_term` call of the same layer that follows it, whose term adds
          the difference of the two logits there.
    """

    def __init__(self, inner: PositionMethod, *, inv_freq: Tensor | None = None, position_scale: float | None = None,
                 qk_scale: float = 1.0, log_context: int | None = None, window: int | None = None,
                 trained_positions: int | None = None, remap: RelativeRemap | None = None,
                 sinks: int = 0) -> None:
        super().__init__(inner.dims)
        if inv_freq is not None:
            inner = inner.with_frequencies(inv_freq)  # type: ignore[attr-defined]  # a Rotary copy
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # logs and results keep the trained method's name
        self.position_scale = position_scale
        self.trained_positions = trained_positions
        self.qk_scale = qk_scale
        self.log_context = log_context
        self.window = window
        self.sinks = sinks
        self.remap = remap
        self.remapped: tuple[Tensor, Tensor, Tensor, Tensor] | None = None  # q, k, q at remap, k at remap
        # The window is a score term (-inf past the window), so every backend applies it unchanged.
        # log_scaling alone needs no score term: scaling q scales q.k; a method's bias is scaled in
        # score_term below.
        self.has_score_term = inner.has_score_term or window is not None or remap is not None  # type: ignore[misc]
        self.uses_positions = inner.uses_positions  # type: ignore[misc]

    def input_embedding(self, positions: Tensor) -> Tensor | None:
        if self.position_scale is None:
            return self.inner.input_embedding(positions)
        scaled = positions.double() / self.position_scale  # (T,) fractional positions
        return self.inner.input_embedding_at(scaled, self.trained_positions)  # type: ignore[attr-defined]

    def query_scale(self, positions: Tensor) -> Tensor:
        """(T,) positions -> (T,) logit multipliers max(1, log(n + 1) / log C)."""
        assert self.log_context is not None
        ratio = torch.log(positions.double() + 1) / math.log(self.log_context)
        return ratio.clamp(min=1.0).float()

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        pairs = [self.inner.rotate_qk(q, k, positions, layer)]  # (B, H, T, D) each
        if self.remap is not None:
            pairs.append(transform_apart(self.inner, q, k, self.remap.query_at(positions),
                                         self.remap.key_at(positions), layer))
        if self.qk_scale != 1.0:
            pairs = [(q * self.qk_scale, k * self.qk_scale) for q, k in pairs]
        if self.log_context is not None:
            scale = self.query_scale(positions)[..., None]  # scales q.k / sqrt(D) per query
            pairs = [(q * scale.to(q.dtype), k) for q, k in pairs]
        if self.remap is not None:
            self.remapped = (*pairs[0], *pairs[1])
        return pairs[0]

    def key_bias(self, x: Tensor, layer: int) -> Tensor | None:
        bias = self.inner.key_bias(x, layer)
        if bias is not None and self.log_context is not None:  # it would need the per-query scale too
            raise PosbenchError(f"eval.extension=log_scaling cannot scale {self.name}'s key bias (method.fast=true); "
                                "evaluate this run without log_scaling")
        return bias

    def remap_term(self, q: Tensor, k: Tensor | None, positions: Tensor) -> Tensor:
        """(B, H, T, T) fp32: the remapped logits minus the plain ones where d >= window, else 0."""
        if self.remapped is None or self.remapped[0] is not q or self.remapped[1] is not k:
            raise RuntimeError("the remapped q, k belong to the rotate_qk call of this layer; call it first")
        q, k, q_far, k_far = (t.float() for t in self.remapped)
        self.remapped = None
        with torch.autocast(q.device.type, enabled=False):
            term = torch.einsum("bhid,bhjd->bhij", q_far, k_far)  # (B, H, T, T)
            term -= torch.einsum("bhid,bhjd->bhij", q, k)
            term *= q.shape[-1] ** -0.5  # the backends' scale
        idx = torch.arange(q.shape[-2], device=q.device)
        batch = torch.arange(positions.shape[0] if positions.dim() == 2 else 1, device=q.device).view(-1, 1, 1, 1)
        near = distance(positions, batch, idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1)) < self.remap.window  # type: ignore[union-attr]
        return term.masked_fill_(near, 0.0)

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None,
                   x: Tensor | None = None) -> ScoreFn | None:
        remapped = self.remap_term(q, k, positions) if self.remap is not None else None  # before q is unscaled
        query_scale = self.query_scale(positions) if self.log_context is not None else None
        if query_scale is not None:
            # ``q`` arrives already scaled by rotate_qk; a term that reads q (relative, cope) must
            # see the trained model's q, or it would be scaled twice (s(n)^2) below.
            q = q / query_scale[..., None].to(q.dtype)
        inner = self.inner.score_term(q, positions, layer, k=k, x=x) if self.inner.has_score_term else None
        if self.log_context is None and self.window is None and remapped is None:
            return inner
        window, sinks = self.window, self.sinks

        def score(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            term = torch.zeros((), device=q_idx.device)
            if inner is not None:
                term = inner(b, h, q_idx, kv_idx)
                if query_scale is not None:  # the whole logit is scaled, the method's bias too
                    term = term * query_scale[q_idx]
            if remapped is not None:
                term = term + remapped[b, h, q_idx, kv_idx]
            if window is not None:
                too_far = positions[q_idx] - positions[kv_idx] >= window
                if sinks:
                    too_far = too_far & (positions[kv_idx] >= sinks)
                term = torch.where(too_far, float("-inf"), term)
            return term

        return score

    def extra_repr(self) -> str:
        return (f"inner={self.inner.name}, position_scale={self.position_scale}, qk_scale={self.qk_scale}, "
                f"log_context={self.log_context}, window={self.window}, sinks={self.sinks}, "
                f"remap_window={None if self.remap is None else self.remap.window}")
