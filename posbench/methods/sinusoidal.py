"""Fixed sinusoidal absolute embeddings added to the input (Vaswani et al. 2017).

PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d)), base = 10000.
Computed from the positions on the fly, so any length works.
"""

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod


@register
class Sinusoidal(PositionMethod):
    name = "sinusoidal"

    def __init__(self, dims: ModelDims, *, base: float = 10000.0) -> None:
        super().__init__(dims)
        if dims.d_model % 2:
            raise ValueError("sinusoidal embeddings need an even d_model")
        self.base = base
        inv_freq = base ** (-torch.arange(0, dims.d_model, 2, dtype=torch.float64) / dims.d_model)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def input_embedding(self, positions: Tensor) -> Tensor:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # (T, d/2)
        # Interleave so even channels hold sin and odd channels cos, as in the paper.
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (T, d_model)
