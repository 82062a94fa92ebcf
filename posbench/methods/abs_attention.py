"""Absolute positions inside self-attention (seed 000's "absolute PE": a trainable matrix R of shape
[tokens, dim_head] whose rows are dotted with the query and added to q.k before the softmax).

Each layer learns a table R in R^(max_positions x D), shared across heads, and

    score(i, j) += q_i . R_pos(j) / sqrt(D),

the same 1/sqrt(D) as q.k. Since q_i . k_j + q_i . R_j = q_i . (k_j + R_j), this is implemented
exactly as a key transform ``k_j += R_pos(j)``, which every backend (fused SDPA kernels included)
runs with no score term at all.

Past the training context: rows past it receive no gradient during training and stay at their
random initialisation, as for ``learned``; positions >= ``max_positions`` are an error that names
the option to raise.
"""

import torch
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, check_table_range


@register
class AbsAttention(PositionMethod):
    name = "abs_attention"
    enters = "q-k (k_j += R_pos(j), i.e. score += q_i . R_j)"
    source = "Adaloglou 2021 (seed 000)"
    past_context = "as ``learned``: rows past C stay at their init; positions >= ``max_positions`` (4096) are an error"

    def __init__(self, dims: ModelDims, *, max_positions: int = 4096, init_std: float = 0.02) -> None:
        super().__init__(dims)
        if max_positions < 1:
            raise ValueError(f"abs_attention needs max_positions >= 1, got {max_positions}")
        self.tables = nn.ParameterList(
            nn.Parameter(torch.empty(max_positions, dims.head_dim)) for _ in range(dims.n_layers)
        )
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for table in self.tables:
            nn.init.normal_(table, std=self.init_std)

    @property
    def max_positions(self) -> int:
        return self.tables[0].shape[0]

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        check_table_range(positions, self.max_positions, self.name)
        rows = self.tables[layer][positions].to(k.dtype)  # (T, D) or (B, T, D)
        return q, k + (rows if rows.dim() == 2 else rows[:, None])
