"""2D relative position embeddings on the grid (Shaw et al. 2018 carried to 2D, as in the
stand-alone self-attention of Ramachandran et al. 2019 and the attention-augmented convolutions
of Bello et al. 2019; the AI Summer article "How Positional Embeddings work in Self-Attention").

Each layer learns a row-offset table r_row and a column-offset table r_col of head-dim vectors
(shared across heads, as Shaw et al. and the 1D ``relative``), and the logit of query cell
(y_i, x_i) and key cell (y_j, x_j) gets

    score_ij += q_i . (r_row[clip(dy)] + r_col[clip(dx)]) / sqrt(D),   (dy, dx) = cell(i) - cell(j),

on the scale of the logits q.k / sqrt(D), as the 1D ``relative``. Offsets are clipped to
[-max_offset, max_offset] (2 max_offset + 1 vectors per axis), which lets the method run on any
grid. The default, 7, is the largest offset of the 8 x 8 training grid: every offset seen in
training has its own vector, and the farther offsets of a larger grid share the outermost one,
which training reached (with 8, the vectors for +-8 would never be trained and every far
offset would read an untrained one).

As the 1D ``relative``: the content-dependent term is a small table per layer,
``qr[b, h, i, k] = q_i . r[k] / sqrt(D)`` (B, H, T, 2 (2 max_offset + 1)), and the score term
only gathers from it by offset, so FlexAttention runs it as a ``score_mod`` (no scatter).
There is no value-side term (the 2D works add the key side only), so it runs in every backend.
"""

import torch
from einops import einsum
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn, grid_offset


@register
class Relative2D(PositionMethod):
    name = "relative_2d"
    layouts = ("grid",)
    relative_scores = True  # logits depend on the cells only through (dy, dx)
    has_score_term = True

    def __init__(self, dims: ModelDims, *, max_offset: int = 7, init_std: float = 0.02) -> None:
        super().__init__(dims)
        if max_offset < 0:
            raise ValueError(f"relative_2d needs max_offset >= 0, got {max_offset}")
        self.max_offset = max_offset
        size = 2 * max_offset + 1  # offsets -max_offset .. max_offset

        def per_layer_tables() -> nn.ParameterList:
            return nn.ParameterList(nn.Parameter(torch.empty(size, dims.head_dim)) for _ in range(dims.n_layers))

        self.row_tables = per_layer_tables()  # r_row: (2K+1, D) per layer
        self.col_tables = per_layer_tables()  # r_col: (2K+1, D) per layer
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for table in [*self.row_tables, *self.col_tables]:
            nn.init.normal_(table, std=self.init_std)

    def score_term(self, q: Tensor, positions: Tensor, layer: int, **_) -> ScoreFn:
        K = self.max_offset
        size = 2 * K + 1
        tables = torch.cat((self.row_tables[layer], self.col_tables[layer])).to(q.dtype)  # (2 (2K+1), D)
        qr = einsum(q, tables, "b h t d, k d -> b h t k") * q.shape[-1] ** -0.5  # (B, H, T, 2 (2K+1))

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            dy, dx = grid_offset(positions, b, q_idx, kv_idx)
            row = dy.clamp(-K, K) + K  # index of r_row[clip(dy)]
            col = dx.clamp(-K, K) + K + size  # index of r_col[clip(dx)], after the row table
            return qr[b, h, q_idx, row] + qr[b, h, q_idx, col]

        return bias

    def extra_repr(self) -> str:
        return f"max_offset={self.max_offset}"
