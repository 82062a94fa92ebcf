"""CoPE: contextual position encoding (Golovneva et al. 2024, "Contextual Position Encoding:
Learning to Count What's Important").

Positions are counted by the content: each key j gets a gate ``g_ij = sigmoid(q_i . k_j / sqrt(D))``
(0 for future keys), query i assigns key j the contextual position ``p_ij = sum_{t=j..i} g_it``,
clamped to ``npos_max - 1``, and the logit gains ``q_i . e[p_ij]``, where e is a learned table of
``npos_max`` vectors (per layer, shared across heads, zero at init as in the paper) interpolated
linearly between the integer positions floor(p) and ceil(p). As in the paper's Appendix B code,
the gates use the scaled, masked logits and the position term is added unscaled.

p_ij is a cumulative sum over the dense (T, T) gate matrix, so the term is materialised densely
(eager and sdpa); FlexAttention cannot take it. Past the training context: p_ij only counts gated
tokens and is clamped at npos_max - 1, so no position is ever out of distribution as long as the
count saturates within the training context.
"""

import torch
from einops import einsum
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn, needs


@register
class CoPE(PositionMethod):
    name = "cope"
    enters = "score (content dependent: gates sigmoid(q.k) count positions)"
    source = "Golovneva et al. 2024"
    past_context = (
        "contextual positions are clamped at ``npos_max`` - 1; new only if counts past C exceed what training saw"
    )
    backend_note = "dense gates; flex refuses it"
    has_score_term = True
    uses_positions = False

    def __init__(self, dims: ModelDims, *, npos_max: int = 64) -> None:
        super().__init__(dims)
        if npos_max < 1:
            raise ValueError(f"cope needs npos_max >= 1, got {npos_max}")
        self.npos_max = npos_max
        self.tables = nn.ParameterList(
            nn.Parameter(torch.zeros(npos_max, dims.head_dim)) for _ in range(dims.n_layers)
        )

    def backend_limits(self) -> dict[str, str]:
        return {"flex": "cope's contextual positions are a cumulative sum over the dense (T, T) gate matrix"}

    def contextual_term(self, q: Tensor, k: Tensor, layer: int) -> Tensor:
        """The dense term q_i . e[p_ij] of shape (B, H, T, T), fp32."""
        T = q.shape[-2]
        logits = einsum(q.float(), k.float(), "b h i d, b h j d -> b h i j") * q.shape[-1] ** -0.5
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        gates = logits.sigmoid().masked_fill(future, 0.0)  # (B, H, T, T)
        pos = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.npos_max - 1)  # p_ij = sum_{t>=j} g_it
        per_integer = einsum(q.float(), self.tables[layer].float(), "b h i d, p d -> b h i p")
        floor = pos.floor()
        w = pos - floor
        at = lambda p: per_integer.gather(-1, p.long())  # noqa: E731  (B, H, T, T)
        return at(pos.ceil()) * w + at(floor) * (1 - w)

    def score_term(
        self, q: Tensor, positions: Tensor, layer: int, *, k: Tensor | None = None, **_
    ) -> ScoreFn:
        term = self.contextual_term(q, needs(k, "the keys k", self.name), layer)

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return term[b, h, q_idx, kv_idx]

        return bias

    def extra_repr(self) -> str:
        return f"npos_max={self.npos_max}"
