"""Rotary position embedding (Su et al. 2021, RoFormer), as used by Llama.

Each pair of query/key channels is rotated by angle ``pos * theta_i`` with
``theta_i = base^(-2i/D)``. Because both q and k are rotated, ``q_m . k_n`` depends on positions
only through ``m - n``.

Two channel pairings exist in the wild:
- ``interleaved=False`` (default, Hugging Face Llama): channel i pairs with channel i + D/2
  ("rotate_half").
- ``interleaved=True`` (the RoFormer paper, Meta's original Llama code): channel 2i pairs with 2i+1.
Both are true rotations; they differ only by a fixed permutation of the head channels.
"""

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: Tensor) -> Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x_odd, x_even), dim=-1).flatten(-2)


@register
class RoPE(PositionMethod):
    name = "rope"

    def __init__(self, dims: ModelDims, *, base: float = 10000.0, interleaved: bool = False) -> None:
        super().__init__(dims)
        if dims.head_dim % 2:
            raise ValueError(f"rope needs an even head dimension, got {dims.head_dim}")
        self.base = base
        self.interleaved = interleaved
        d = dims.head_dim
        inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (D/2,)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(T,) -> cos, sin of shape (T, D), laid out to match the channel pairing."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (T, D/2)
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos_sin(positions)  # (T, D) each, fp32
        turn = rotate_interleaved if self.interleaved else rotate_half
        # Rotate in fp32 and cast back: bf16 angles lose precision fast at large positions.
        def apply(x: Tensor) -> Tensor:
            xf = x.float()
            return (xf * cos + turn(xf) * sin).to(x.dtype)

        return apply(q), apply(k)

    def extra_repr(self) -> str:
        return f"base={self.base}, interleaved={self.interleaved}"
