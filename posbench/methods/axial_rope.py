"""Axial RoPE on the grid (Heo et al. 2024, "Rotary Position Embedding for Vision Transformer").

Each head's channels are split in two halves: the first half is rotated by the cell's column
(x), the second by its row (y), each half with 1D RoPE's frequencies over its own R = D/2
channels, ``theta_i = base^(-2i/R)`` = ``base^(-4i/D)`` (Heo et al.'s ``compute_axial_cis``:
``1 / theta ** (arange(0, D, 4)[:D // 4] / D)``). So ``q_m . k_n`` depends on the cells only
through their offset (dy, dx), and each axis is 1D RoPE on its own.

Channel pairing as in their code (``torch.view_as_complex`` of ``(..., D/2, 2)``): channel 2i
pairs with 2i + 1. ``base`` defaults to their ViT value, 100 (a grid side is tens of cells, not
thousands of tokens). As :class:`Rotary`, it holds ``inv_freq`` (R/2 = D/4 frequencies, shared by
both axes) and ``rotary_dim`` R = D/2, the channels of one axis, so 1D extension rules
(PI / NTK / YaRN) apply per axis, as FiT applies them.
"""

import math

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, Rotary


def rotate_pairs(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate channel pairs (2i, 2i + 1) of ``x`` (..., D) by ``angles`` (..., D/2), in fp32."""
    xf = x.float()
    even, odd = xf[..., 0::2], xf[..., 1::2]  # (..., D/2) each
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


@register
class AxialRoPE(Rotary, PositionMethod):
    name = "axial_rope"
    enters = "q-k (pairs i < D/4 turn with the column x, the others with the row y)"
    source = "Heo et al. 2024 (RoPE-Axial)"
    past_context = (
        "angles computed for any cell; scores depend only on the offset (dy, dx), but offsets past the training grid's "
        "were never seen"
    )
    layouts = ("grid",)
    relative_scores = True  # logits depend on the cells only through (dy, dx)

    def __init__(self, dims: ModelDims, *, base: float = 100.0) -> None:
        super().__init__(dims)
        if dims.head_dim % 4:
            raise ValueError(f"{self.name} needs a head dimension divisible by 4 (two axes of pairs), got {dims.head_dim}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not 1 < base < math.inf:
            raise ValueError(f"method.base={base!r} must be a number > 1 (the wavelength base; 100 by default)")
        self.base = base
        self.rotary_dim = dims.head_dim // 2  # the channels of one axis
        inv_freq = base ** (-torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim)  # (D/4,)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def angles(self, positions: Tensor) -> Tensor:
        """(..., T, 2) cells (row, col) -> (..., T, D/2) angles: columns first, then rows."""
        cells = positions.float()
        x = cells[..., 1, None] * self.inv_freq  # (..., T, D/4)
        y = cells[..., 0, None] * self.inv_freq  # (..., T, D/4)
        return torch.cat((x, y), dim=-1)

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        angles = self.angles(positions)  # (T, D/2) or (B, T, D/2)
        if angles.dim() == 3:
            angles = angles[:, None]  # (B, 1, T, D/2)
        return rotate_pairs(q, angles), rotate_pairs(k, angles)

    def extra_repr(self) -> str:
        return f"base={self.base}"
