"""A learned absolute embedding per grid cell added to the input (ViT, Dosovitskiy et al. 2021).

The table holds one d_model vector per cell (row, col) and is trained on the training grid,
side = isqrt(``train_context``) (a run fills ``train_context`` with ``trainer.context``). At a grid
of another side the method does one of two things (``interpolate``):

* ``true`` (ViT / DeiT fine-tuned at a new resolution; DeiT's and MAE's ``interpolate_pos_embed``):
  the trained (side, side, d_model) block is resized bicubically to the new (s, s) grid,
  ``F.interpolate(mode="bicubic", align_corners=False)``, then read by cell. The new grid is the
  square of the T cells evaluated, s = isqrt(T) (the model's default grid). (timm's newer
  ``resample_abs_pos_embed`` defaults to ``antialias=True``, another bicubic kernel, not this one.)
* ``false`` (the un-interpolated control): the cell's own row of the table, as the 1D ``learned``
  reads rows past C. Cells outside the training square got no gradient in training: they keep
  their random initialisation. A cell at row or column >= ``max_side`` is an error naming
  ``method.max_side``.

Both modes hold the same (max_side, max_side, d_model) parameter, drawn the same way, of which
training reaches only the top-left side x side block (no weight decay touches position
parameters, so the other cells stay exactly at their draw). The two modes therefore train
identically, bit for bit, and differ only in how a grid of another side is read.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posbench.core.errors import PosbenchError
from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, grid_side

DEFAULT_CONTEXT = 256  # trainer.context's default (a 16 x 16 grid), for a table built outside a run


def resize_cells(table: Tensor, side: int) -> Tensor:
    """(s0, s0, d) table -> (side, side, d), bicubic, align_corners=False (DeiT's resize)."""
    grid = table.permute(2, 0, 1)[None]  # (1, d, s0, s0): channels first, as F.interpolate reads
    grid = F.interpolate(grid, size=(side, side), mode="bicubic", align_corners=False)  # (1, d, side, side)
    return grid[0].permute(1, 2, 0)  # (side, side, d)


def check_cells(positions: Tensor, side: int, what: str) -> None:
    """One clear error when a cell lies outside ``side`` x ``side``; as ``check_table_range``, the
    exact cells are read only from CPU tensors (a GPU would sync every forward for it)."""
    if torch.compiler.is_compiling() or not positions.numel() or positions.device.type != "cpu":
        return
    low, high = int(positions.min()), int(positions.max())
    if low < 0 or high >= side:
        raise PosbenchError(f"learned_2d reads cells of a {side} x {side} table but cell index "
                            f"{high if high >= side else low} was requested; {what}")


@register
class Learned2D(PositionMethod):
    name = "learned_2d"
    enters = "input (a learned vector per cell)"
    source = "ViT (Dosovitskiy et al. 2021); DeiT's resize"
    past_context = (
        "``interpolate=true``: the trained block resized bicubically to the new side; ``false``: cells outside the "
        "training square keep their random init, and a side past ``max_side`` (32) is an error "
        "(docs/grid.md#absolute-methods)"
    )
    layouts = ("grid",)
    context_option = "train_context"  # a run fills it with trainer.context

    def __init__(self, dims: ModelDims, *, train_context: int | None = None, interpolate: bool = True,
                 max_side: int = 32, init_std: float = 0.02) -> None:
        super().__init__(dims)
        if train_context is None:  # outside a run (create_model): posbench's default context
            train_context = DEFAULT_CONTEXT
        if isinstance(train_context, bool) or not isinstance(train_context, int) or train_context < 1:
            raise ValueError(f"method.train_context={train_context!r} must be a positive integer (cells)")
        if math.isqrt(train_context) ** 2 != train_context:
            raise ValueError(f"method.train_context={train_context} is not a square grid (side**2 cells, e.g. 64)")
        if isinstance(max_side, bool) or not isinstance(max_side, int) or max_side < 1:
            raise ValueError(f"method.max_side={max_side!r} must be a positive integer")
        if not init_std > 0:
            raise ValueError(f"method.init_std={init_std!r} must be > 0")
        self.train_context = train_context
        self.train_side = math.isqrt(train_context)
        if self.train_side > max_side:
            raise ValueError(f"the training grid is {self.train_side} x {self.train_side} but the table "
                             f"{max_side} x {max_side}; raise method.max_side to at least {self.train_side}")
        self.interpolate = interpolate
        self.init_std = init_std
        self.table = nn.Parameter(torch.empty(max_side, max_side, dims.d_model))  # (S, S, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.table, std=self.init_std)

    @property
    def max_side(self) -> int:
        return self.table.shape[0]

    @property
    def max_positions(self) -> int | None:
        """The most cells a grid can have: max_side**2 un-interpolated; any grid interpolated."""
        return None if self.interpolate else self.max_side**2

    def length_fix(self, length: int) -> str:
        return f"raise method.max_side to at least {math.isqrt(length - 1) + 1}"

    def cell_table(self, length: int) -> Tensor:
        """The (s, s, d_model) table a grid of ``length`` cells reads (s = its side)."""
        if not self.interpolate:
            return self.table
        side = grid_side(length)
        trained = self.table[: self.train_side, : self.train_side]  # (side0, side0, d_model)
        return trained if side == self.train_side else resize_cells(trained, side)

    def input_embedding(self, positions: Tensor) -> Tensor:
        table = self.cell_table(positions.shape[-2])  # (s, s, d_model)
        if self.interpolate:
            check_cells(positions, table.shape[0], f"the grid of {positions.shape[-2]} cells is "
                        f"{table.shape[0]} x {table.shape[0]} and its cells must lie in it")
        else:
            check_cells(positions, self.max_side, "raise method.max_side")
        return table[positions[..., 0], positions[..., 1]]  # (..., T, d_model)

    def extra_repr(self) -> str:
        return (f"train_side={self.train_side}, interpolate={self.interpolate}, "
                f"max_side={self.max_side}, init_std={self.init_std}")
