"""Rotary position embedding (Su et al. 2021, RoFormer), as used by Llama.

Each pair of query/key channels is rotated by angle ``pos * theta_i`` with
``theta_i = base^(-2i/R)`` (R = rotary channels, the head dim by default). Because both q and k are
rotated, ``q_m . k_n`` depends on positions only through ``m - n``.

Two channel pairings exist in the wild:
- ``interleaved=False`` (default, Hugging Face Llama): channel i pairs with channel i + R/2
  ("rotate_half").
- ``interleaved=True`` (the RoFormer paper, Meta's original Llama code): channel 2i pairs with 2i+1.
Both are true rotations; they differ only by a fixed permutation of the head channels.

``partial_rotary_factor`` (GPT-NeoX's ``rotary_pct``, Hugging Face's ``partial_rotary_factor``):
only the first ``R = int(D * factor)`` channels of each head are rotated, with frequencies
computed for R channels; the rest pass through unchanged.

This module holds the one rotation implementation: :class:`RoPE` is :class:`Rotary` (``inv_freq``, a
buffer of R/2 frequencies, ``base``, ``rotary_dim``) and ``attention_scaling`` (multiplies cos and sin, 1 for plain RoPE; YaRN-style
extensions set it), and xpos and p_rope subclass it.
"""

import math

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, Rotary


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: Tensor) -> Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x_odd, x_even), dim=-1).flatten(-2)


@register
class RoPE(Rotary, PositionMethod):
    name = "rope"
    enters = "q-k"
    source = "Su et al. 2021 (RoFormer); Llama"
    past_context = "angles computed for any position; scores depend only on i - j, but distances >= C were never seen"
    relative_scores = True  # logits depend on positions only through i - j
    llama_equivalent = True  # with default options, the model is transformers' LlamaForCausalLM

    def __init__(
        self, dims: ModelDims, *, base: float = 10000.0, interleaved: bool = False, partial_rotary_factor: float = 1.0
    ) -> None:
        super().__init__(dims)
        if dims.head_dim % 2:
            raise ValueError(f"{self.name} needs an even head dimension, got {dims.head_dim}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not 1 < base < math.inf:
            # base <= 0 gives NaN frequencies: the loss is NaN from the first step, whatever the lr.
            raise ValueError(f"method.base={base!r} must be a number > 1 (RoPE's wavelength base; 10000 by default)")
        rotary_dim = int(dims.head_dim * partial_rotary_factor)
        if not 0 < partial_rotary_factor <= 1 or rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={partial_rotary_factor} gives {rotary_dim} rotary channels of "
                f"{dims.head_dim}; it must be in (0, 1] and give an even number >= 2"
            )
        self.base = base
        self.interleaved = interleaved
        self.partial_rotary_factor = partial_rotary_factor
        self.rotary_dim = rotary_dim
        self.attention_scaling = 1.0
        inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)  # (R/2,)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def per_channel(self, per_frequency: Tensor) -> Tensor:
        """(..., R/2) values per frequency -> (..., R) laid out to match the channel pairing."""
        if self.interleaved:
            return per_frequency.repeat_interleave(2, dim=-1)
        return torch.cat((per_frequency, per_frequency), dim=-1)

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(..., T) -> cos, sin of shape (..., T, R), fp32, times ``attention_scaling``."""
        angles = self.per_channel(positions.float()[..., None] * self.inv_freq)  # (..., T, R)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate the first R channels of x (B, H, T, D) by (T, R) or (B, 1, T, R) cos/sin.

        Rotates in fp32 and casts back: bf16 angles lose precision fast at large positions.
        """
        turn = rotate_interleaved if self.interleaved else rotate_half
        xf = x.float()
        rotary, passthrough = xf[..., : self.rotary_dim], xf[..., self.rotary_dim :]
        rotated = rotary * cos + turn(rotary) * sin
        return torch.cat((rotated, passthrough), dim=-1).to(x.dtype)

    @staticmethod
    def broadcast_heads(table: Tensor) -> Tensor:
        """(T, R) stays; (B, T, R) from per-sequence positions -> (B, 1, T, R)."""
        return table if table.dim() == 2 else table[:, None]

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        cos, sin = (self.broadcast_heads(t) for t in self.cos_sin(positions))
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)

    def extra_repr(self) -> str:
        return (f"base={self.base}, interleaved={self.interleaved}, "
                f"partial_rotary_factor={self.partial_rotary_factor}")
