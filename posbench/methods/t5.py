"""T5 relative position bias (Raffel et al. 2020).

A learned scalar per (head, bucket of the causal distance i - j) is added to the logits. Distances
below ``num_buckets / 2`` get a bucket each; larger ones share logarithmically wider buckets up to
``max_distance``, beyond which everything falls in the last bucket, so any length works. One table
is shared by all layers, as in T5.

Two differences from ``transformers``' T5 worth knowing:
- Scaling: T5 applies no 1/sqrt(d) to q.k (its initialisation folds it into the weights).
  posbench, like every method here, applies 1/sqrt(D) to q.k and adds the bias unscaled.
- The last bucket: with the defaults (32 buckets, max_distance 128) bucket 31 starts at distance
  113, not 128: bucket = 16 + floor(16 * log(n / 16) / log(8)) reaches 31 once
  n >= 16 * 8^(15/16) = 112.4. Distances 113 and beyond all share it (as in T5 itself).
"""

import math

import torch
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn, distance


def causal_bucket(distance: Tensor, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """Bucket index of the causal distance ``i - j`` (negative distances count as 0)."""
    n = distance.clamp(min=0)
    exact = num_buckets // 2
    # Logarithmic buckets for n >= exact; clamp before the log so n = 0 never reaches it.
    scaled = torch.log(n.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
    large = (exact + (scaled * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(n < exact, n, large)


@register
class T5Bias(PositionMethod):
    name = "t5"
    relative_scores = True  # logits depend on positions only through i - j
    has_score_term = True

    def __init__(
        self, dims: ModelDims, *, num_buckets: int = 32, max_distance: int = 128, init_std: float = 0.02
    ) -> None:
        super().__init__(dims)
        if num_buckets < 2 or max_distance <= num_buckets // 2:
            raise ValueError("t5 needs num_buckets >= 2 and max_distance > num_buckets / 2")
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bias = nn.Embedding(num_buckets, dims.n_heads)  # (buckets, H), shared across layers
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.bias.weight, std=self.init_std)

    def score_term(self, q: Tensor, positions: Tensor, layer: int, **_) -> ScoreFn:
        table = self.bias.weight
        num_buckets, max_distance = self.num_buckets, self.max_distance

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            bucket = causal_bucket(distance(positions, b, q_idx, kv_idx), num_buckets, max_distance)
            return table[bucket, h]

        return bias

    def extra_repr(self) -> str:
        return f"num_buckets={self.num_buckets}, max_distance={self.max_distance}"
