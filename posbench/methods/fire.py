"""FIRE: functional interpolation for relative positions (Li et al. 2024, "Functional
Interpolation for Relative Positions Improves Long Context Transformers", ICLR).

    b(i, j) = f_theta( psi(i - j) / psi(max(L, i)) ),   psi(x) = log(c * x + 1),

where i is the query position, f_theta is a small MLP (1 -> ``mlp_width`` -> H, ReLU) giving one
bias per head, and c and the threshold L are learnable. As in the paper's reference code, c starts
at ``init_c`` = 0.1, L = |L_multiplier * ``init_L``| with a learnable multiplier starting at 1 and
init_L = 512, and psi(x) = log(|c x| + 1) with ``eps`` added to the denominator. One FIRE module is
shared by all layers (like t5 here; the paper defines the module, not its sharing).

Past the training context the MLP's input stays in [0, 1] (that is the point of the
normalisation), but for i > L the same distance maps to a smaller input as i grows: nearby keys
look progressively "closer" to the MLP at long lengths.

The MLP is written as an explicit sum over its hidden units so that the same score function runs
on dense index grids and, scalar by scalar, inside FlexAttention's ``score_mod``. Training refuses
flex all the same: its compiled backward cannot give the MLP weights and the scalars c, L a
gradient (seen on an H100, docs/gpu.md), so ``auto`` runs fire in SDPA on CUDA.

``fast: true`` computes the same function as one batched MLP over the whole (T, T) grid (a
(..., T, T, W) hidden layer and one matmul, in fp32 also under autocast) instead of W summed
terms: equal to the default to fp32 rounding, not bitwise (docs/benchmarks.md).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import (
    DenseScore,
    ModelDims,
    PositionMethod,
    ScoreFn,
    distance,
    index_grid,
    position_at,
)


@register
class FIRE(PositionMethod):
    name = "fire"
    enters = "score"
    source = "Li et al. 2024"
    past_context = (
        "the MLP's input psi(i-j)/psi(max(L, i)) stays in [0, 1], but for i > L a fixed distance maps to smaller "
        "inputs as i grows"
    )
    backend_note = "flex's backward cannot train its MLP, docs/gpu.md"
    has_score_term = True
    options_before = {"fast": False}  # runs from before the fast path computed the loop

    def __init__(
        self, dims: ModelDims, *, mlp_width: int = 32, init_c: float = 0.1, init_L: float = 512.0, eps: float = 1e-6,
        fast: bool = False,
    ) -> None:
        super().__init__(dims)
        if mlp_width < 1 or not init_c > 0 or not init_L > 0:
            raise ValueError("fire needs mlp_width >= 1, init_c > 0 and init_L > 0")
        # No output bias: a per-head constant on every logit of a row cancels in the softmax, so
        # it could never receive a gradient (the function class is the paper's).
        self.mlp = nn.Sequential(nn.Linear(1, mlp_width), nn.ReLU(), nn.Linear(mlp_width, dims.n_heads, bias=False))
        self.c = nn.Parameter(torch.tensor(float(init_c)))
        self.L_multiplier = nn.Parameter(torch.tensor(1.0))
        self.init_L = init_L
        self.eps = eps
        self.fast = bool(fast)

    def backend_limits(self) -> dict[str, str]:
        # Seen on an H100 (torch 2.11): FlexAttention's backward takes gradients only of captured
        # tensors indexed once by the score function's indices; FIRE reads its MLP weights unit by
        # unit and its scalars c and L whole, so the compiled backward fails to lower.
        return {"flex": "FlexAttention's backward cannot give fire's MLP weights and scalars a gradient"}

    def normalised_distance(self, positions: Tensor, b: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The MLP's input u = psi(i - j) / (psi(max(L, i)) + eps), fp32, in [0, 1] for causal keys."""
        c, threshold = self.c, (self.L_multiplier * self.init_L).abs()

        def psi(x: Tensor) -> Tensor:
            return torch.log((c * x).abs() + 1)

        d = distance(positions, b, q_idx, kv_idx).clamp(min=0).float()
        normaliser = torch.maximum(position_at(positions, b, q_idx).float(), threshold)
        return psi(d) / (psi(normaliser) + self.eps)

    def per_forward(self, positions: Tensor) -> DenseScore | None:
        return self.dense_bias(positions) if self.fast else None

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, shared: DenseScore | None = None,
                   **_) -> ScoreFn:
        if self.fast:  # one module for all layers: the grid of this forward, or a fresh one
            return shared if shared is not None else self.dense_bias(positions)
        hidden, out = self.mlp[0], self.mlp[2]
        w1, b1 = hidden.weight[:, 0], hidden.bias  # (W,)
        w2 = out.weight  # (H, W)

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            u = self.normalised_distance(positions, b, q_idx, kv_idx)
            return sum(w2[h, n] * torch.relu(w1[n] * u + b1[n]) for n in range(w1.shape[0]))

        return bias

    def dense_bias(self, positions: Tensor) -> DenseScore:
        """The bias on the full grid: one batched MLP over (B|1, T, T) inputs, fp32 under autocast."""
        with torch.autocast(positions.device.type, enabled=False):
            u = self.normalised_distance(positions, *index_grid(positions))  # (B|1, 1, T, T)
            hidden = F.relu(self.mlp[0](u[..., None].float()))  # (B|1, 1, T, T, W)
            grid = self.mlp[2](hidden)  # (B|1, 1, T, T, H)
        return DenseScore(grid[:, 0].permute(0, 3, 1, 2))  # (B|1, H, T, T)

    def extra_repr(self) -> str:
        return f"mlp_width={self.mlp[0].out_features}, init_L={self.init_L}, fast={self.fast}"
