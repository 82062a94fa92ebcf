"""The position-method interface.

Following seed 003's framing (see DESIGN.md), a position method touches the transformer in up to
three places, and implements any subset of them:

1. ``input_embedding``: a ``(T, d_model)`` tensor added to the token embeddings (learned,
   sinusoidal).
2. ``rotate_qk``: a transform of queries and keys given their positions (rope).
3. ``score_term``: an additive term on the attention logits before softmax (alibi, t5, relative).

The score term is ONE function ``fn(b, h, q_idx, kv_idx) -> Tensor`` written with broadcasting
tensor ops. Every attention backend consumes that same function: the eager and SDPA paths call it
on broadcast index grids to materialise a dense ``(B|1, H, Tq, Tk)`` bias, FlexAttention calls it
as a ``score_mod`` on scalar indices. One definition means the backends cannot drift apart.

Positions are explicit (``arange(T)`` by default), so every method except ``learned`` runs at any
length without retraining.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import Tensor, nn

# fn(b, h, q_idx, kv_idx) -> additive logit term, broadcasting over its integer-tensor arguments.
ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class ModelDims:
    """The model shape a position method is built for."""

    d_model: int
    n_heads: int
    n_layers: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class PositionMethod(nn.Module):
    """Base class: no position information at all (every hook is the identity).

    Subclasses set ``name`` (the ``method=`` config value), override the hooks they use, and
    declare ``has_score_term`` so backends can pick a fast path (no score term -> fused causal
    attention) without running the model.
    """

    name: ClassVar[str] = ""
    has_score_term: ClassVar[bool] = False

    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.dims = dims

    @property
    def max_positions(self) -> int | None:
        """Largest supported position + 1, or None when any length works."""
        return None

    def input_embedding(self, positions: Tensor) -> Tensor | None:
        """(T,) positions -> (T, d_model) tensor added to the token embeddings, or None."""
        return None

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Transform q, k of shape (B, H, T, D) given their (T,) positions."""
        return q, k

    def score_term(self, q: Tensor, positions: Tensor, layer: int) -> ScoreFn | None:
        """Additive attention-logit term for ``layer``; ``q`` is (B, H, T, D) after ``rotate_qk``.

        Returned function maps broadcastable integer tensors (batch, head, query index, key
        index) to the term added to the *scaled* logits ``q.k / sqrt(D)``. Indices are positions
        in the sequence; map them through ``positions`` for the actual position ids.
        """
        return None

    def extra_repr(self) -> str:
        return f"name={self.name}"


def dense_score(fn: ScoreFn, batch: int, heads: int, length: int, device: torch.device) -> Tensor:
    """Materialise ``fn`` on the full index grid -> (B or 1, H, T, T) (B only if fn uses it)."""
    idx = torch.arange(length, device=device)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    out = fn(b, h, idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1))
    return out.expand(out.shape[0], heads, length, length)
