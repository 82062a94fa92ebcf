"""2D T5 relative bias on the grid: T5's bidirectional buckets per axis, a learned bias per
(row bucket, column bucket, head).

T5's bucket function (Raffel et al. 2020; ``transformers``' ``T5Attention._relative_position_bucket``
with ``bidirectional=True``) maps the key-minus-query offset along each axis to one of
``num_buckets`` buckets: half for offsets <= 0, half for offsets > 0; in each half the first
quarter of ``num_buckets`` are exact offsets and the rest logarithmically wider up to
``max_distance``, beyond which everything shares the last bucket. It is applied to the row offset
and to the column offset separately, and the bias is

    score_ij += bias_scale * table[bucket(y_j - y_i), bucket(x_j - x_i), h],

a 2D table as Swin's relative position bias (Liu et al. 2021), but log-bucketed, so it extends
to any grid.

Defaults (``num_buckets`` 16, ``max_distance`` 8), chosen for the 8 x 8 training grid: per sign,
offsets 0..3 are exact and 4, 5, 6 have a bucket each, and every offset of 7 or more shares the
last one (8 x 2^(-1/4) = 6.7 starts it). So each offset of the training grid has its own bucket and
the farther offsets of larger grids all read the last bucket, which training reached. T5's own
defaults (32, 128) would give offsets 0..7 exact buckets and leave every bucket of offsets 8 and
more untrained on an 8 x 8 grid.

As the 1D ``t5``: one table shared by all layers (as T5), ``bias_scale`` defaulting to sqrt(D)
(x-transformers' scaling of the bias onto the logits q.k / sqrt(D)), table init N(0, init_std).
Checked in eager, sdpa and flex on the CPU only: compiled FlexAttention on a GPU is untested here
(the 1D t5's table gather did not compile at head dim 64 on an H100, see its backend_limits).
"""

import torch
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn, grid_offset
from posbench.methods.t5 import causal_bucket


def bidirectional_bucket(relative: Tensor, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bidirectional bucket of the offset ``key - query`` (either sign): half the buckets
    for offsets > 0, each half bucketed as T5's causal distances."""
    half = num_buckets // 2
    return (relative > 0).long() * half + causal_bucket(relative.abs(), half, max_distance)


@register
class T5Bias2D(PositionMethod):
    name = "t5_2d"
    enters = "score (a learned bias per (row bucket, column bucket, head))"
    source = "Raffel et al. 2020's buckets per axis"
    past_context = (
        "with the defaults offsets of 7 or more share the last bucket, which the 8 x 8 training grid fills: no new "
        "offset"
    )
    layouts = ("grid",)
    relative_scores = True  # logits depend on the cells only through (dy, dx)
    has_score_term = True

    def __init__(
        self, dims: ModelDims, *, num_buckets: int = 16, max_distance: int = 8, init_std: float = 0.02,
        bias_scale: float | None = None,
    ) -> None:
        """``bias_scale``: factor on the learned table; None = sqrt(head_dim), as the 1D t5."""
        super().__init__(dims)
        if num_buckets < 4 or num_buckets % 2 or max_distance <= num_buckets // 4:
            raise ValueError(f"t5_2d needs an even num_buckets >= 4 and max_distance > num_buckets / 4, "
                             f"got {num_buckets} and {max_distance}")
        self.bias_scale = float(dims.head_dim**0.5 if bias_scale is None else bias_scale)
        if not self.bias_scale > 0:
            raise ValueError(f"t5_2d needs bias_scale > 0 (or null for sqrt(head_dim)), got {bias_scale}")
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bias = nn.Parameter(torch.empty(num_buckets, num_buckets, dims.n_heads))  # (rows, cols, H), all layers
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.bias, std=self.init_std)

    def buckets(self, dy: Tensor, dx: Tensor) -> tuple[Tensor, Tensor]:
        """(row bucket, column bucket) of the offsets ``(dy, dx)`` = cell(q) - cell(kv)."""
        return (bidirectional_bucket(-dy, self.num_buckets, self.max_distance),
                bidirectional_bucket(-dx, self.num_buckets, self.max_distance))

    def score_term(self, q: Tensor, positions: Tensor, layer: int, **_) -> ScoreFn:
        table = self.bias * self.bias_scale  # (rows, cols, H)

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            row, col = self.buckets(*grid_offset(positions, b, q_idx, kv_idx))
            return table[row, col, h]

        return bias

    def extra_repr(self) -> str:
        return f"num_buckets={self.num_buckets}, max_distance={self.max_distance}, bias_scale={self.bias_scale:g}"
