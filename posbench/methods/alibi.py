"""ALiBi: attention with linear biases (Press et al. 2022).

score(i, j) += -m_h * (i - j) for keys j <= i, with fixed head slopes m_h. For H a power of two
the slopes are the geometric sequence 2^(-8/H), 2^(-16/H), ..., 2^(-8) (8 heads: 1/2 ... 1/256).
Otherwise the paper takes the slopes of the closest smaller power of two, p, and adds every other
slope of 2p heads (6 heads: [1/4, 1/16, 1/64, 1/256, 1/2, 1/8]).
"""

import math

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn, distance


def alibi_slopes(n_heads: int) -> list[float]:
    """The paper's per-head slopes, including its rule for head counts that are not 2^k."""

    def power_of_two_slopes(n: int) -> list[float]:
        ratio = 2.0 ** (-8.0 / n)
        return [ratio ** (i + 1) for i in range(n)]

    if n_heads & (n_heads - 1) == 0:
        return power_of_two_slopes(n_heads)
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return power_of_two_slopes(closest) + extra


@register
class ALiBi(PositionMethod):
    name = "alibi"
    enters = "score"
    source = "Press et al. 2022"
    past_context = "the fixed penalty -m_h (i - j) keeps growing linearly with distance"
    relative_scores = True  # logits depend on positions only through i - j
    has_score_term = True

    def __init__(self, dims: ModelDims) -> None:
        super().__init__(dims)
        self.register_buffer(
            "slopes", torch.tensor(alibi_slopes(dims.n_heads), dtype=torch.float32), persistent=False
        )

    def score_term(self, q: Tensor, positions: Tensor, layer: int, **_) -> ScoreFn:
        slopes = self.slopes

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return -slopes[h] * distance(positions, b, q_idx, kv_idx).float()

        return bias
