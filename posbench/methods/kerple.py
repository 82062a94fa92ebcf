"""KERPLE: kernelized relative positional embedding (Chi et al. 2022, "KERPLE: Kernelized Relative
Positional Embedding for Length Extrapolation").

A conditionally positive definite kernel of the causal distance d = i - j is added to the logits,
with learnable positive r1, r2 per head and per layer:

- ``variant: log`` (the paper's best):   score += -r1 * log(1 + r2 * d)
- ``variant: power``:                    score += -r1 * d^r2, with r2 in (0, 2]

At init r1 ~ U(0, 2) and r2 ~ U(0, 1) for both variants, and the parameters are projected back
into their range (r >= 0.01, power r2 <= 2) in place before each use, as in the paper's code
(github.com/chijames/KERPLE, ``megatron/mpu/layers.py``), with two departures from that code (the
power variant's init, and r1, r2 per layer rather than shared by the layers):
docs/departures.md#departures-from-the-papers. The bias depends only on d, so any length works.
"""

import torch
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn, distance

EPS = 1e-2  # the paper's lower bound on r1, r2


@register
class Kerple(PositionMethod):
    name = "kerple"
    enters = "score"
    source = "Chi et al. 2022"
    past_context = "the learned log (or power) kernel keeps decaying with distance, with its learned shape"
    backend_note = "flex's backward: 5 % of rope, docs/benchmarks.md"
    relative_scores = True  # logits depend on positions only through i - j
    has_score_term = True

    def __init__(self, dims: ModelDims, *, variant: str = "log") -> None:
        super().__init__(dims)
        if variant not in ("log", "power"):
            raise ValueError(f"kerple variant must be log or power, got {variant!r}")
        self.variant = variant
        self.r1 = nn.Parameter(torch.empty(dims.n_layers, dims.n_heads))  # (L, H)
        self.r2 = nn.Parameter(torch.empty(dims.n_layers, dims.n_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.r1, 0.0, 2.0)
        nn.init.uniform_(self.r2, 0.0, 1.0)
        self.project_()

    def backend_limits(self) -> dict[str, str]:
        # Seen on an H100 (torch 2.11, model=small): compiled FlexAttention trained at 249 ms a
        # step, 5 % of rope's 12 ms, likely as its backward sums the gradient of r1, r2 (H scalars
        # a layer) by atomics from every (query, key) pair. SDPA with the dense term kept pace with
        # rope under load (docs/benchmarks.md).
        return {"flex": "FlexAttention's backward sums kerple's per-head scalars "
                        "(5% of rope's speed on an H100); SDPA kept pace with rope"}

    @torch.no_grad()
    def project_(self) -> None:
        """Keep r1, r2 in the kernel's valid range (the paper clamps the parameters in place)."""
        self.r1.clamp_(min=EPS)
        self.r2.clamp_(min=EPS, max=2.0 if self.variant == "power" else None)

    def before_step(self) -> None:
        self.project_()

    def score_term(self, q: Tensor, positions: Tensor, layer: int, **_) -> ScoreFn:
        # Compiled, the training step has projected already (before_step): an in-place update of
        # a parameter inside the graph would keep CUDA graphs from capturing it. The values are
        # the same either way (the projection is idempotent).
        if not torch.compiler.is_compiling():
            self.project_()
        # Copies, not views: the next layer's in-place projection bumps the version of r1 and r2,
        # which would invalidate a view that FlexAttention saved for its backward.
        r1, r2 = self.r1[layer].clone(), self.r2[layer].clone()  # (H,)
        power = self.variant == "power"

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            d = distance(positions, b, q_idx, kv_idx).clamp(min=0).float()
            if power:  # d^r2 with d = 0 kept out of the pow, whose r2-gradient there is 0 * log 0
                return torch.where(d > 0, -r1[h] * torch.where(d > 0, d, 1.0) ** r2[h], 0.0)
            return -r1[h] * torch.log1p(r2[h] * d)

        return bias

    def extra_repr(self) -> str:
        return f"variant={self.variant}"
