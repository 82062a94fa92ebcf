"""xPos: extrapolatable position embedding (Sun et al. 2023, "A Length-Extrapolatable Transformer").

RoPE (the rotation of :mod:`posbench.methods.rope`, reused) plus an exponential scale per frequency,

    zeta_i = (2i / R + gamma) / (1 + gamma),   i = 0 .. R/2 - 1,

applied as ``zeta^(n / scale_base)`` to the query at position n and ``zeta^(-m / scale_base)`` to
the key at position m, so ``q_n . k_m`` carries ``zeta^((n - m) / scale_base)``: a decay with
distance on top of RoPE's rotation (the paper's gamma = 0.4, scale_base = 512). As in the paper's
code (torchscale) and rotary-embedding-torch, the exponent is centred on the middle position of
the sequence, which leaves every score unchanged and keeps the scales near 1.

Past the training context the decay keeps growing with distance (zeta^(d/512) with zeta_0 = 0.29
for the fastest-decaying pair), so far keys fade as they did in training, only more.
"""

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import ModelDims
from posbench.methods.rope import RoPE


@register
class XPos(RoPE):
    llama_equivalent = False
    name = "xpos"
    enters = "q-k"
    source = "Sun et al. 2023"
    past_context = "RoPE plus a decay zeta^((i-j)/512) that keeps shrinking far keys with distance"

    def __init__(
        self, dims: ModelDims, *, base: float = 10000.0, interleaved: bool = False,
        scale_base: float = 512.0, gamma: float = 0.4,
    ) -> None:
        super().__init__(dims, base=base, interleaved=interleaved)
        if not scale_base > 0 or not gamma > 0:
            raise ValueError("xpos needs scale_base > 0 and gamma > 0")
        self.scale_base = scale_base
        self.gamma = gamma
        zeta = (torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim + gamma) / (1 + gamma)
        self.register_buffer("zeta", zeta.float(), persistent=False)  # (R/2,)

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos_sin(positions)  # (..., T, R)
        centre = (positions.amax(dim=-1, keepdim=True) + 1) // 2
        power = (positions - centre).float() / self.scale_base  # (..., T)
        scale = self.per_channel(self.zeta ** power[..., None])  # (..., T, R)
        cos, sin, scale = (self.broadcast_heads(t) for t in (cos, sin, scale))
        return self.rotate(q, cos * scale, sin * scale), self.rotate(k, cos / scale, sin / scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale_base={self.scale_base}, gamma={self.gamma}"
