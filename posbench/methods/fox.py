"""FoX: the Forgetting Transformer (Lin et al. 2025, "Forgetting Transformer: Softmax Attention with
a Forget Gate", ICLR).

Each layer computes a scalar forget gate per head and token from the attention input x_t (after
the block's RMSNorm), ``f_t = sigmoid(w_h . x_t + b_h)``, and adds to the logit of query i and key j

    D_ij = sum_{l = j+1..i} log f_l = c_i - c_j,   c_t = sum_{l <= t} log f_l,

so attention to old keys decays at a rate the content decides. As the difference of a per-token
cumulative sum, the bias is a gather from a captured (B, H, T) tensor, which FlexAttention takes
as a ``score_mod``. There is no other position signal, as in the paper. Initialisation as in the
paper's code (Hugging Face style): gate weights ~ N(0, ``init_std``), bias 0 (f ~ 0.5 at init).
Past the training context nothing is out of distribution by construction: the gate sees content,
never positions.

``fast: true`` drops the query side: c_i is the same for every key of query i's softmax row, so it
cancels exactly, and softmax_j(q_i.k_j / sqrt(D) + c_i - c_j) = softmax_j(q_i.k_j / sqrt(D) - c_j).
The key-side -c_j is handed over as a :meth:`key_bias`, which the backends fold into extra key
channels (with query channels of 1), so fox runs in fused SDPA (flash) without a score function;
equal to the default to fp32 rounding (docs/benchmarks.md).
"""

import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn, needs


@register
class FoX(PositionMethod):
    name = "fox"
    enters = "score (content dependent: forget gate from the layer input)"
    source = "Lin et al. 2025"
    past_context = (
        "no position signal at all; decay is decided by the content, so nothing is out of range by construction"
    )
    has_score_term = True
    uses_positions = False
    options_before = {"fast": False}  # runs from before the fast path folded the gate into keys

    def __init__(self, dims: ModelDims, *, init_std: float = 0.02, fast: bool = False) -> None:
        super().__init__(dims)
        self.gates = nn.ModuleList(nn.Linear(dims.d_model, dims.n_heads) for _ in range(dims.n_layers))
        self.init_std = init_std
        self.fast = bool(fast)
        self.has_score_term = not self.fast  # the fast path's term is a key bias, no score function
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for gate in self.gates:
            nn.init.normal_(gate.weight, std=self.init_std)
            nn.init.zeros_(gate.bias)

    def log_forget_cumsum(self, x: Tensor, layer: int) -> Tensor:
        """(B, T, d_model) attention input -> c of shape (B, H, T), fp32."""
        gate = self.gates[layer]
        log_f = F.logsigmoid(gate(x.to(gate.weight.dtype)).float())  # (B, T, H)
        return rearrange(log_f.cumsum(dim=1), "b t h -> b h t")

    def key_bias(self, x: Tensor, layer: int) -> Tensor | None:
        """-c_j (B, H, T) fp32 on the fast path (the query side c_i cancels in the softmax)."""
        return -self.log_forget_cumsum(x, layer) if self.fast else None

    def score_term(self, q: Tensor, positions: Tensor, layer: int, *, x: Tensor | None = None, **_) -> ScoreFn | None:
        if self.fast:
            return None
        c = self.log_forget_cumsum(needs(x, "the layer input x", self.name), layer)
        c_key = c.clone()  # FlexAttention's backward cannot index one grad-requiring tensor twice

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return c[b, h, q_idx] - c_key[b, h, kv_idx]

        return bias

    def extra_repr(self) -> str:
        return f"fast={self.fast}"
