"""MAE's fixed 2D sin-cos embedding added to the input (He et al. 2022, "Masked Autoencoders Are
Scalable Vision Learners"; their ``get_2d_sincos_pos_embed``).

Half of the d_model channels encode one axis, half the other, each with the 1D sin-cos of Vaswani
et al. over D/2 channels, not interleaved: for a coordinate p,
``[sin(p * omega_0..D/4-1), cos(p * omega_0..D/4-1)]`` with ``omega_i = base^(-i / (D/4))``.
Which half is which follows their code: its grid is ``np.meshgrid(grid_w, grid_h)`` ("w goes
first"), so the half their code calls ``emb_h`` reads the *column* (w). Channels [0, D/2) encode
the cell's column, [D/2, D) its row; their tokens are row-major, as posbench's cells.

A formula of the cell, so any grid works (the table of a grid of another side is the formula
there). ``scale`` (0.02) plays the same part as :mod:`posbench.methods.sinusoidal`'s: MAE adds
the raw table to patch embeddings of RMS ~1; posbench's token embeddings start at std 0.02, so
the table is multiplied by 0.02 to keep tokens and positions in proportion. ``scale=1`` is the
raw table of their code.
"""

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod


@register
class SinCos2D(PositionMethod):
    name = "sincos_2d"
    enters = "input (2D sin-cos: half the channels the column, half the row)"
    source = "He et al. 2022 (MAE)"
    past_context = "a formula of the cell: any grid side works; the model meets cells it never saw"
    layouts = ("grid",)

    def __init__(self, dims: ModelDims, *, base: float = 10000.0, scale: float = 0.02) -> None:
        super().__init__(dims)
        if dims.d_model % 4:
            raise ValueError(f"sincos_2d needs a d_model divisible by 4 (two axes of sin and cos), got {dims.d_model}")
        if not base > 1:
            raise ValueError(f"method.base={base!r} must be > 1")
        if not scale > 0:
            raise ValueError(f"method.scale={scale!r} must be > 0")
        self.base = base
        self.scale = scale
        quarter = dims.d_model // 4
        omega = base ** (-torch.arange(quarter, dtype=torch.float64) / quarter)  # (D/4,)
        self.register_buffer("omega", omega, persistent=False)

    def axis(self, coordinate: Tensor) -> Tensor:
        """(..., T) coordinates -> (..., T, D/2): sin of every frequency, then cos."""
        angles = coordinate.double()[..., None] * self.omega  # (..., T, D/4)
        return torch.cat((angles.sin(), angles.cos()), dim=-1)

    def input_embedding(self, positions: Tensor) -> Tensor:
        cols, rows = self.axis(positions[..., 1]), self.axis(positions[..., 0])  # (..., T, D/2) each
        return (self.scale * torch.cat((cols, rows), dim=-1)).float()  # (..., T, d_model)

    def extra_repr(self) -> str:
        return f"base={self.base}, scale={self.scale}"
