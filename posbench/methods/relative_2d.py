"""2D relative position embeddings on the grid (Shaw et al. 2018 carried to 2D, as in the
stand-alone self-attention of Ramachandran et al. 2019 and the attention-augmented convolutions
of Bello et al. 2019; the AI Summer article "How Positional Embeddings work in Self-Attention").

Each layer learns a row-offset table r_row and a column-offset table r_col of head-dim vectors
(shared across heads, as Shaw et al. and the 1D ``relative``), and the logit of query cell
(y_i, x_i) and key cell (y_j, x_j) gets

    score_ij += q_i . (r_row[clip(dy)] + r_col[clip(dx)]) / sqrt(D),   (dy, dx) = cell(i) - cell(j),

on the scale of the logits q.k / sqrt(D), as the 1D ``relative`` and Bello et al.'s
q_i^T (k_j + r^W + r^H) / sqrt(d_k). This is the sum form of Bello et al. and of the article's code
(BoTNet's R_h + R_w); Ramachandran et al. concatenate a row and a column embedding of D/2 channels
each, the special case where r_row lives in the first half of the channels and r_col in the
second. Offsets are clipped to
[-max_offset, max_offset] (2 max_offset + 1 vectors per axis), which lets the method run on any
grid. The default, 7, is the largest offset of the 8 x 8 training grid: every offset seen in
training has its own vector, and the farther offsets of a larger grid share the outermost one,
which training reached (with 8, the vectors for +-8 would never be trained and every far
offset would read an untrained one).

As the 1D ``relative``: the content-dependent term is a small table per layer,
``qr[b, h, i, k] = q_i . r[k] / sqrt(D)`` (B, H, T, 2 (2 max_offset + 1)), and the score term
only gathers from it by offset, so FlexAttention runs it as a ``score_mod`` (no scatter).
There is no value-side term (these 2D works add the key side only), so it runs in every backend.

``fast: true`` (the default) replaces the gather by a matmul with the one-hot offset grid
(T, T, 2 (2K+1)) and hands the term over dense, as the 1D ``relative``'s fast path: on a loaded
2-core CPU the term of a batch of 50 32 x 32 grids (4 heads, head dim 16) took 2-4 s instead of
the gather's (``fast: false``) 9-15 s per layer. Its memory grows as T^2 (2K+1) (126 MB at
T = 1024); the two equal each other to fp32 rounding (values and gradients, tested). Unlike the 1D
``relative``, whose recorded runs fix its default, the grid method starts with the faster path.
"""

import torch
from einops import einsum
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import DenseScore, ModelDims, PositionMethod, ScoreFn, cell_index_grid, grid_offset


@register
class Relative2D(PositionMethod):
    name = "relative_2d"
    enters = "score (q_i . (r_row[clip(dy)] + r_col[clip(dx)]) / sqrt(d_head))"
    source = "Shaw et al. 2018 in 2D, Bello et al. 2019's sum form"
    past_context = (
        "offsets past ``max_offset`` (7) share the outermost vectors, which the 8 x 8 training grid fills: no new "
        "offset"
    )
    layouts = ("grid",)
    relative_scores = True  # logits depend on the cells only through (dy, dx)
    has_score_term = True

    def __init__(self, dims: ModelDims, *, max_offset: int = 7, init_std: float = 0.02, fast: bool = True) -> None:
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
        self.fast = bool(fast)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for table in [*self.row_tables, *self.col_tables]:
            nn.init.normal_(table, std=self.init_std)

    def indices(self, positions: Tensor, b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> tuple[Tensor, Tensor]:
        """Where r_row[clip(dy)] and r_col[clip(dx)] sit in the concatenated (2 (2K+1), D) tables."""
        K = self.max_offset
        dy, dx = grid_offset(positions, b, q_idx, kv_idx)
        return dy.clamp(-K, K) + K, dx.clamp(-K, K) + 3 * K + 1  # the column table after the row table

    def score_term(self, q: Tensor, positions: Tensor, layer: int, **_) -> ScoreFn:
        tables = torch.cat((self.row_tables[layer], self.col_tables[layer])).to(q.dtype)  # (2 (2K+1), D)
        qr = einsum(q, tables, "b h t d, k d -> b h t k") * q.shape[-1] ** -0.5  # (B, H, T, 2 (2K+1))
        if self.fast:
            with torch.autocast(q.device.type, enabled=False):
                one_hot = self.one_hot(positions)  # (B|1, T, T, 2 (2K+1))
                if one_hot.shape[0] == 1:  # cells shared by the batch: one matmul per query, over the batch
                    return DenseScore(einsum(qr.float(), one_hot[0], "b h i k, i j k -> b h i j"))  # (B, H, T, T)
                return DenseScore(einsum(qr.float(), one_hot, "b h i k, b i j k -> b h i j"))

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            row, col = self.indices(positions, b, q_idx, kv_idx)
            return qr[b, h, q_idx, row] + qr[b, h, q_idx, col]

        return bias

    def one_hot(self, positions: Tensor) -> Tensor:
        """Both table indices of every (query, key) pair as one fp32 row with two ones: (B|1, T, T, 2 (2K+1))."""
        b, q_idx, kv_idx = cell_index_grid(positions)
        row, col = self.indices(positions, b, q_idx, kv_idx)  # (B|1, 1, T, T) each
        size = 2 * (2 * self.max_offset + 1)
        one_hot = torch.nn.functional.one_hot(row[:, 0], size) + torch.nn.functional.one_hot(col[:, 0], size)
        return one_hot.float()

    def extra_repr(self) -> str:
        return f"max_offset={self.max_offset}, fast={self.fast}"
