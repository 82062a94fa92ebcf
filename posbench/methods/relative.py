"""Shaw-style relative position representations (Shaw et al. 2018).

Each layer learns key-side relative embeddings a^K_0 ... a^K_k in R^D (shared across heads, as in
the paper) and adds ``q_i . a^K_clip(i - j) / sqrt(D)`` to the logit of query i and key j.
Distances beyond ``max_distance`` (the paper's clipping distance k, default 16 as in its
experiments) share a^K_k, which is what lets the method run at any length. Only causal distances
exist in a decoder, so there are k + 1 vectors rather than the paper's 2k + 1.

``value_term`` (default true, the paper's form, its eq. 3): each layer also learns value-side
embeddings a^V_0 ... a^V_k and the attention output becomes ``z_i = sum_j p_ij (v_j +
a^V_clip(i - j))``. Adding it needs the attention probabilities, which only the eager backend
holds, so with ``value_term: true`` every backend resolves to eager; ``value_term: false`` (the key
term alone) runs in sdpa and flex.

The content-dependent key term is computed once per layer as a small table
``qr[b, h, i, d] = q_i . a^K_d`` of shape (B, H, T, k + 1); the score term then only gathers from
it, which FlexAttention can do inside a ``score_mod``.

``fast: true`` replaces both gathers by matmuls with the one-hot bucket grid ``(T, T, k + 1)``:
the key term ``qr @ one_hot^T`` handed over dense, and the value term's per-bucket mass
``probs @ one_hot`` (no ``scatter_add``; the gradient is a matmul, not an indexed accumulation).
The one-hot grid is built from the distances themselves, so it holds for any positions
(randomised, interpolated), where a skew of the (T, k + 1) table assumes distance = i - j. The
key term is bitwise the default's; the value term and the gradients equal it to fp32 rounding.
"""

import torch
from einops import einsum
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import (
    DenseScore,
    ModelDims,
    PositionMethod,
    ScoreFn,
    ValueTerm,
    distance,
    index_grid,
)


@register
class ShawRelative(PositionMethod):
    name = "relative"
    enters = "score (q_i . a^K_(i-j)) and values (a^V_(i-j))"
    source = "Shaw et al. 2018"
    past_context = (
        "distances > ``max_distance`` (16) share the k-th vectors, which training already fills: no new distance"
    )
    backend_note = "the value term needs the probabilities; ``value_term=false``: sdpa / flex"
    relative_scores = True  # logits depend on positions only through i - j
    has_score_term = True
    options_before = {"fast": False}  # runs from before the fast path gathered the tables

    def __init__(
        self, dims: ModelDims, *, max_distance: int = 16, value_term: bool = True, init_std: float = 0.02,
        fast: bool = False,
    ) -> None:
        super().__init__(dims)
        if max_distance < 0:
            raise ValueError("relative needs max_distance >= 0")
        self.max_distance = max_distance
        self.use_value_term = value_term

        def per_layer_tables() -> nn.ParameterList:
            return nn.ParameterList(
                nn.Parameter(torch.empty(max_distance + 1, dims.head_dim)) for _ in range(dims.n_layers)
            )

        self.tables = per_layer_tables()  # a^K
        self.value_tables = per_layer_tables() if value_term else None  # a^V
        self.init_std = init_std
        self.fast = bool(fast)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for table in [*self.tables, *(self.value_tables or [])]:
            nn.init.normal_(table, std=self.init_std)

    def backend_limits(self) -> dict[str, str]:
        if not self.use_value_term:
            return {}
        reason = "relative's value term needs the attention probabilities (eager only); or set method.value_term=false"
        return {"sdpa": reason, "flex": reason}

    def bucket(self, positions: Tensor) -> ScoreFn:
        """(b, h, q_idx, kv_idx) -> clip(i - j, 0, k): the index into both tables."""
        k = self.max_distance

        def clipped(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return distance(positions, b, q_idx, kv_idx).clamp(0, k)

        return clipped

    def one_hot(self, positions: Tensor) -> Tensor:
        """The bucket of every (query, key) pair as one-hot fp32 rows: (B|1, T, T, k + 1)."""
        b, q_idx, kv_idx = index_grid(positions)
        bucket = self.bucket(positions)(b, None, q_idx, kv_idx)[:, 0]  # (B|1, T, T)
        return torch.nn.functional.one_hot(bucket, self.max_distance + 1).float()

    def score_term(self, q: Tensor, positions: Tensor, layer: int, **_) -> ScoreFn:
        table = self.tables[layer].to(q.dtype)
        qr = einsum(q, table, "b h t d, k d -> b h t k") * q.shape[-1] ** -0.5  # (B, H, T, k+1)
        bucket = self.bucket(positions)
        if self.fast:
            with torch.autocast(q.device.type, enabled=False):
                one_hot = self.one_hot(positions).expand(q.shape[0], -1, -1, -1)  # (B, T, T, k+1)
                return DenseScore(einsum(qr.float(), one_hot, "b h i k, b i j k -> b h i j"))  # (B, H, T, T)

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return qr[b, h, q_idx, bucket(b, h, q_idx, kv_idx)]

        return bias

    def value_term(self, positions: Tensor, layer: int) -> ValueTerm | None:
        if self.value_tables is None:
            return None
        mass = None
        if self.fast:
            one_hot = self.one_hot(positions)  # (B|1, T, T, k+1)

            def mass(probs: Tensor) -> Tensor:  # (B, H, T, T) -> (B, H, T, k+1)
                with torch.autocast(probs.device.type, enabled=False):
                    return einsum(probs.float(), one_hot.expand(probs.shape[0], -1, -1, -1), "b h i j, b i j k -> b h i k")

        return ValueTerm(bucket=self.bucket(positions), table=self.value_tables[layer], mass=mass)

    def extra_repr(self) -> str:
        return f"max_distance={self.max_distance}, value_term={self.use_value_term}, fast={self.fast}"
