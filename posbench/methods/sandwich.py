"""Sandwich (Chi et al. 2023, "Dissecting Transformer Length Extrapolation via the Lens of
Receptive Field Analysis").

A parameter-free bias: the inner product of two sinusoidal position embeddings of dimension d',
which depends only on the distance d = i - j,

    p_i . p_j = sum_{k=1..d'/2} cos(d / 10000^(2k / d')),

shifted by -d'/2 so that it is 0 at d = 0 and <= 0 elsewhere. It decays with distance at first
and then oscillates around -d'/2 (it never keeps decaying, unlike ALiBi), which the paper reads as
a soft receptive field. ``d_prime`` is the paper's d' (128 in its experiments). ``compress_heads``
divides head h's bias by 8h/H (h = 1..H), giving each head its own receptive field the way ALiBi's
slopes do (the form of the reference port in NeMo/Megatron).

``fast: true`` computes the same bias as the paper writes it, an inner product: the (T, d')
sinusoidal embeddings of the positions times each other, one matmul over the (T, T) grid
(cos(a - b) = cos a cos b + sin a sin b), handed over dense instead of d'/2 cosines evaluated per
(query, key) pair; equal to the default to fp32 rounding (docs/benchmarks.md).
"""

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import (
    DenseScore,
    ModelDims,
    PositionMethod,
    ScoreFn,
    distance,
)


@register
class Sandwich(PositionMethod):
    name = "sandwich"
    enters = "score"
    source = "Chi et al. 2023"
    past_context = (
        "parameter-free; the bias oscillates around -d'/2 (scaled per head) past the first few hundred positions "
        "rather than growing"
    )
    relative_scores = True  # logits depend on positions only through i - j
    has_score_term = True
    options_before = {"fast": False}  # runs from before the fast path summed the cosines

    def __init__(self, dims: ModelDims, *, d_prime: int = 128, compress_heads: bool = True,
                 fast: bool = False) -> None:
        super().__init__(dims)
        if d_prime < 2 or d_prime % 2:
            raise ValueError(f"sandwich needs an even d_prime >= 2, got {d_prime}")
        self.d_prime = d_prime
        self.compress_heads = compress_heads
        self.fast = bool(fast)
        # Python floats: the score function loops over them, which FlexAttention compiles.
        self.frequencies = [10000.0 ** (-2 * k / d_prime) for k in range(1, d_prime // 2 + 1)]
        heads = torch.arange(1, dims.n_heads + 1, dtype=torch.float32)
        divisor = 8 * heads / dims.n_heads if compress_heads else torch.ones_like(heads)
        self.register_buffer("head_divisor", divisor, persistent=False)  # (H,)

    def per_forward(self, positions: Tensor) -> DenseScore | None:
        return self.dense_bias(positions) if self.fast else None

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, shared: DenseScore | None = None,
                   **_) -> ScoreFn:
        if self.fast:  # the same bias in every layer: this forward's grid, or a fresh one
            return shared if shared is not None else self.dense_bias(positions)
        frequencies, half, divisor = self.frequencies, self.d_prime / 2, self.head_divisor

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            d = distance(positions, b, q_idx, kv_idx).float()
            inner = sum(torch.cos(d * f) for f in frequencies)  # p_i . p_j
            return (inner - half) / divisor[h]

        return bias

    def dense_bias(self, positions: Tensor) -> DenseScore:
        """The bias as p_i . p_j - d'/2 on the full grid, from the embeddings (one matmul)."""
        with torch.autocast(positions.device.type, enabled=False):
            freq = torch.tensor(self.frequencies, device=positions.device)  # (d'/2,)
            angle = positions.float()[..., None] * freq  # (B|., T, d'/2)
            p = torch.cat((angle.cos(), angle.sin()), dim=-1)  # (B|., T, d')
            inner = p @ p.transpose(-1, -2)  # (B|., T, T)
            inner = inner.view(-1, 1, *inner.shape[-2:])  # (B|1, 1, T, T)
            return DenseScore((inner - self.d_prime / 2) / self.head_divisor.view(1, -1, 1, 1))  # (B|1, H, T, T)

    def extra_repr(self) -> str:
        return f"d_prime={self.d_prime}, compress_heads={self.compress_heads}, fast={self.fast}"
