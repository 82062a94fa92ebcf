"""T5 relative position bias (Raffel et al. 2020).

A learned scalar per (head, bucket of the causal distance i - j) is added to the logits. Distances
below ``num_buckets / 2`` get a bucket each; larger ones share logarithmically wider buckets up to
``max_distance``, beyond which everything falls in the last bucket, so any length works. One table
is shared by all layers, as in T5.

The bias is ``bias_scale * table[bucket, h]``, ``bias_scale`` defaulting to sqrt(D) (D = head
dimension) as in x-transformers (``RelativePositionBias(scale=dim_head ** 0.5)``): the logits are
q.k / sqrt(D) here, and the scale lets the bias move on their scale with Adam at posbench's
learning rate (400 steps at lr 2e-3 move an unscaled entry by well under a nat). The table starts
at N(0, ``init_std`` = 0.02), so the initial bias has std 0.02 sqrt(D) (0.11 at D = 32), close to
T5's own initialisation d_model^-0.5 (0.088 at d_model = 128). ``bias_scale: 1`` reproduces the
unscaled bias of the first t5 parametrisation bitwise (docs/fidelity.md).

Two differences from ``transformers``' T5 worth knowing:
- Scaling: T5 applies no 1/sqrt(d) to q.k (its initialisation folds it into the weights) and
  adds the bias unscaled, training with Adafactor. posbench, like every method here, applies
  1/sqrt(D) to q.k; the bias follows x-transformers' port (scaled by ``bias_scale``).
- The last bucket: with the defaults (32 buckets, max_distance 128) bucket 31 starts at distance
  113, not 128: bucket = 16 + floor(16 * log(n / 16) / log(8)) reaches 31 once
  n >= 16 * 8^(15/16) = 112.4. Distances 113 and beyond all share it (as in T5 itself).

``fast: true`` builds the dense bias by a one-hot matmul, (T, T, buckets) x (buckets, H), whose
forward is the default's gather bitwise and whose backward is a matmul instead of an indexed
accumulation; the table's gradient then equals the default's to fp32 rounding. The table is
shared, so the grid is built once per forward (``per_forward``) and every layer adds the same one.
"""

import math

import torch
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import (
    DenseScore,
    ModelDims,
    PositionMethod,
    ScoreFn,
    distance,
    index_grid,
)


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
    enters = "score"
    source = "Raffel et al. 2020"
    past_context = (
        "distances >= 113 share the last bucket (with the defaults), which training at C = 256 already fills: no new "
        "distance"
    )
    backend_note = "flex fails or crawls on an H100, docs/benchmarks.md"
    relative_scores = True  # logits depend on positions only through i - j
    has_score_term = True
    options_before = {"bias_scale": 1.0, "fast": False}  # bias_scale: runs from before the option trained the unscaled bias

    def __init__(
        self, dims: ModelDims, *, num_buckets: int = 32, max_distance: int = 128, init_std: float = 0.02,
        bias_scale: float | None = None, fast: bool = False,
    ) -> None:
        """``bias_scale``: factor on the learned table; None = sqrt(head_dim) (x-transformers),
        1.0 = the unscaled bias of the first t5 parametrisation."""
        super().__init__(dims)
        if num_buckets < 2 or max_distance <= num_buckets // 2:
            raise ValueError("t5 needs num_buckets >= 2 and max_distance > num_buckets / 2")
        self.bias_scale = float(dims.head_dim**0.5 if bias_scale is None else bias_scale)
        if not self.bias_scale > 0:
            raise ValueError(f"t5 needs bias_scale > 0 (or null for sqrt(head_dim)), got {bias_scale}")
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bias = nn.Embedding(num_buckets, dims.n_heads)  # (buckets, H), shared across layers
        self.init_std = init_std
        self.fast = bool(fast)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.bias.weight, std=self.init_std)

    def backend_limits(self) -> dict[str, str]:
        # Seen on an H100 (torch 2.11, model=small, head dim 64): the compiled FlexAttention
        # forward needs 240 KiB of shared memory (limit 227 KiB), so no Triton config compiles;
        # with fewer stages it compiles but a training step took ~16x SDPA's (both under load),
        # likely as the backward accumulates the 32 x H table's gradient by atomics. SDPA with the
        # dense term kept pace with rope under the same load (docs/benchmarks.md).
        return {"flex": "FlexAttention does not compile t5's table gather at head dim 64 on an H100 "
                        "(out of shared memory) and trains ~16x slower than SDPA"}

    def table(self) -> Tensor:
        """The learned bias per (bucket, head), times ``bias_scale``: (buckets, H)."""
        return self.bias.weight if self.bias_scale == 1.0 else self.bias.weight * self.bias_scale

    def per_forward(self, positions: Tensor) -> DenseScore | None:
        return self.dense_bias(positions) if self.fast else None

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, shared: DenseScore | None = None,
                   **_) -> ScoreFn:
        if self.fast:  # one table for all layers: this forward's grid, or a fresh one
            return shared if shared is not None else self.dense_bias(positions)
        table = self.table()  # (buckets, H)
        num_buckets, max_distance = self.num_buckets, self.max_distance

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            bucket = causal_bucket(distance(positions, b, q_idx, kv_idx), num_buckets, max_distance)
            return table[bucket, h]

        return bias

    def dense_bias(self, positions: Tensor) -> DenseScore:
        """The bias on the full grid by a one-hot matmul: (B|1, H, T, T)."""
        b, q_idx, kv_idx = index_grid(positions)
        bucket = causal_bucket(distance(positions, b, q_idx, kv_idx), self.num_buckets, self.max_distance)
        with torch.autocast(positions.device.type, enabled=False):
            table = self.table()
            one_hot = torch.nn.functional.one_hot(bucket[:, 0], self.num_buckets).to(table.dtype)  # (B|1, T, T, n)
            grid = one_hot @ table  # (B|1, T, T, H)
        return DenseScore(grid.permute(0, 3, 1, 2))

    def extra_repr(self) -> str:
        return f"num_buckets={self.num_buckets}, max_distance={self.max_distance}, bias_scale={self.bias_scale:g}, fast={self.fast}"
