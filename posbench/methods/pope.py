"""PoPE: polar coordinate position embedding (Gopalakrishnan et al. 2025, "Decoupling the "What"
and "Where" With Polar Coordinate Positional Embeddings", arXiv 2509.10534).

Following the reference code, x-transformers' ``PolarEmbedding`` and ``apply_polar_pos_emb``:
each of the D channels of a query or key becomes a complex number whose magnitude is the
channel's softplus (the "what") and whose phase is its position times one frequency (the "where"),

    q'_c = softplus(q_c) e^{i n theta_c},   k'_c = softplus(k_c) e^{i (m theta_c + delta_{h,c})},
    theta_c = base^(-c/D), c = 0 .. D-1,

stored as the 2D real channels ``[mu cos(phase), mu sin(phase)]``, so that

    q' . k' = sum_c softplus(q_c) softplus(k_c) cos((n - m) theta_c - delta_{h,c}).

``delta`` (H, D) is a learned phase bias of the keys, one per head and channel, shared by all
layers (as the reference's one ``PolarEmbedding`` per model), initialised to zero (the
reference's default; ``bias_uniform_init=True``: uniform in [-2 pi, 0]) and clamped to
[-2 pi, 0] where it is used. The logits keep the reference's scale ``q'.k' / sqrt(D)`` (D = the
head dimension, not the 2D channels): the backends divide by sqrt(2D), so q' is multiplied by
sqrt(2). The transform runs in fp32 and casts back, as the reference does (autocast off).

Unlike RoPE there are D frequencies (one per channel, not per pair), i.e. RoPE's layout
``base^(-2i/R)`` with R = 2D rotated channels: PoPE is :class:`Rotary` with ``rotary_dim = 2D``,
so PI / NTK / YaRN / Llama 3 change its phases and ReRoPE / Self-Extend its relative phases.
Logits depend on positions only through n - m (``relative_scores``). Past the training context:
the phases of the low frequencies reach angles never seen in training, as RoPE's do; what the
magnitudes carry (content) has no position in it at all.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, Rotary


@register
class PoPE(Rotary, PositionMethod):
    name = "pope"
    enters = "q-k (polar: magnitude softplus(q), phase n θ)"
    source = "Gopalakrishnan et al. 2025 (PoPE)"
    past_context = "phases as RoPE's (new angles past C), magnitudes carry content only (docs/methods.md#pope)"
    relative_scores = True  # q'.k' = sum mu_q mu_k cos((n - m) theta - delta)

    def __init__(self, dims: ModelDims, *, base: float = 10000.0, bias_uniform_init: bool = False) -> None:
        super().__init__(dims)
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not 1 < base < math.inf:
            raise ValueError(f"method.base={base!r} must be a number > 1 (PoPE's wavelength base; 10000 by default)")
        self.base = base
        self.bias_uniform_init = bias_uniform_init
        D = dims.head_dim
        self.rotary_dim = 2 * D  # the polar q', k' have 2D real channels: D phases
        inv_freq = base ** (-torch.arange(D, dtype=torch.float64) / D)  # (D,) = base^(-2i/R), R = 2D
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.key_phase_bias = nn.Parameter(torch.zeros(dims.n_heads, D))  # (H, D) delta
        if bias_uniform_init:
            with torch.no_grad():
                self.key_phase_bias.uniform_(-2 * math.pi, 0.0)

    def polar(self, x: Tensor, phase: Tensor) -> Tensor:
        """(B, H, T, D) channels, phases broadcastable to it -> (B, H, T, 2D) [mu cos, mu sin], fp32."""
        mu = F.softplus(x.float())
        return torch.cat((mu * phase.cos(), mu * phase.sin()), dim=-1)

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        with torch.autocast(q.device.type, enabled=False):
            phase = positions.float()[..., None] * self.inv_freq  # (T, D) or (B, T, D)
            if phase.dim() == 3:
                phase = phase[:, None]  # (B, 1, T, D): one row per sequence
            bias = self.key_phase_bias.float().clamp(-2 * math.pi, 0.0)[:, None, :]  # (H, 1, D)
            # sqrt(2): the backends scale q'.k' by 1/sqrt(2D); the reference's scale is 1/sqrt(D).
            q_polar = self.polar(q, phase) * math.sqrt(2.0)  # (B, H, T, 2D)
            k_polar = self.polar(k, phase + bias)  # (B, H, T, 2D)
        return q_polar.to(q.dtype), k_polar.to(k.dtype)

    def extra_repr(self) -> str:
        return f"base={self.base}, bias_uniform_init={self.bias_uniform_init}"
