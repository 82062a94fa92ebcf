"""Fixed sinusoidal absolute embeddings added to the input (Vaswani et al. 2017).

PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(pos / base^(2i/d)), base = 10000.
Computed from the positions on the fly, so any length works.

Scale: what the model sees is token embedding + PE, so their ratio matters. The paper multiplies
its token embeddings (initialised at std d^-1/2) by sqrt(d_model), which puts tokens at RMS ~1 per
channel against the table's ~0.71. posbench's token embeddings are initialised at std 0.02
(GPT-2 style) and not rescaled, so the table is multiplied by ``scale`` = 0.02 by default, which
restores the paper's token : position ratio (1 : 0.71). ``scale=1`` adds the raw table, whose
position signal is then ~35x the token signal and swamps it at the start of training.
"""

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import InputTable, ModelDims, PositionMethod


@register
class Sinusoidal(InputTable, PositionMethod):
    name = "sinusoidal"
    enters = "input"
    source = "Vaswani et al. 2017"
    past_context = "computed for any position; the model meets absolute positions it never saw"

    def __init__(self, dims: ModelDims, *, base: float = 10000.0, scale: float = 0.02) -> None:
        super().__init__(dims)
        if dims.d_model % 2:
            raise ValueError("sinusoidal embeddings need an even d_model")
        if not scale > 0:
            raise ValueError(f"sinusoidal needs scale > 0, got {scale}")
        self.base = base
        self.scale = scale
        inv_freq = base ** (-torch.arange(0, dims.d_model, 2, dtype=torch.float64) / dims.d_model)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def input_embedding(self, positions: Tensor) -> Tensor:
        angles = positions.float()[..., None] * self.inv_freq  # (..., T, d/2)
        # Interleave so even channels hold sin and odd channels cos, as in the paper.
        table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (..., T, d_model)
        return self.scale * table
