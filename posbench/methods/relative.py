"""Shaw-style relative position representations (Shaw et al. 2018).

Each layer learns key-side relative embeddings r_0 ... r_k in R^D (shared across heads, as in the
paper) and adds ``q_i . r_clip(i - j) / sqrt(D)`` to the logit of query i and key j. Distances
beyond ``max_distance`` (the paper's clipping distance k, default 16 as in its experiments) share
r_k, which is what lets the method run at any length. Only causal distances exist in a decoder,
so there are k + 1 vectors rather than the paper's 2k + 1.

The content-dependent term is computed once per layer as a small table
``qr[b, h, i, d] = q_i . r_d`` of shape (B, H, T, k + 1); the score term then only gathers from it,
which FlexAttention can do inside a ``score_mod``.
"""

import torch
from einops import einsum
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn


@register
class ShawRelative(PositionMethod):
    name = "relative"
    has_score_term = True

    def __init__(self, dims: ModelDims, *, max_distance: int = 16, init_std: float = 0.02) -> None:
        super().__init__(dims)
        if max_distance < 0:
            raise ValueError("relative needs max_distance >= 0")
        self.max_distance = max_distance
        self.tables = nn.ParameterList(
            nn.Parameter(torch.empty(max_distance + 1, dims.head_dim)) for _ in range(dims.n_layers)
        )
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for table in self.tables:
            nn.init.normal_(table, std=self.init_std)

    def score_term(self, q: Tensor, positions: Tensor, layer: int) -> ScoreFn:
        table = self.tables[layer].to(q.dtype)
        qr = einsum(q, table, "b h t d, k d -> b h t k") * q.shape[-1] ** -0.5  # (B, H, T, k+1)
        k = self.max_distance

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            distance = (positions[q_idx] - positions[kv_idx]).clamp(0, k)
            return qr[b, h, q_idx, distance]

        return bias

    def extra_repr(self) -> str:
        return f"max_distance={self.max_distance}"
