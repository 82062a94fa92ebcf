"""2D ALiBi on the grid: a fixed per-head linear penalty on the distance between two cells.

    score_ij += -m_h * dist(cell(i), cell(j)),

with ALiBi's geometric head slopes m_h (Press et al. 2022, :func:`alibi_slopes`, including its
rule for head counts that are not a power of two). No learned parameters; any grid works.

``distance``: ``euclidean`` (default), sqrt(dy^2 + dx^2), or ``manhattan``, |dy| + |dx|.
Euclidean is the default because it is rotation-invariant (the penalty depends on how far the
key is, not on the direction), and it is what the 2D ALiBi of CROMA (Fuller et al. 2023,
``get_2dalibi`` in their code: ALiBi's slopes times the Euclidean distance between patches)
uses. Manhattan is the sum of the two 1D ALiBi penalties, one per axis.
"""

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.alibi import alibi_slopes
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn, grid_offset

DISTANCES = ("euclidean", "manhattan")


def cell_distance(dy: Tensor, dx: Tensor, kind: str) -> Tensor:
    """Distance between two cells from their offsets (either sign) -> fp32, >= 0."""
    dy, dx = dy.float(), dx.float()
    if kind == "euclidean":
        return torch.sqrt(dy * dy + dx * dx)
    return dy.abs() + dx.abs()


@register
class ALiBi2D(PositionMethod):
    name = "alibi_2d"
    enters = "score (-m_h dist(i, j), ALiBi's fixed slopes)"
    source = "Press et al. 2022; CROMA (Fuller et al. 2023)"
    past_context = "the fixed penalty keeps growing linearly with the distance between cells"
    layouts = ("grid",)
    relative_scores = True  # logits depend on the cells only through (dy, dx)
    has_score_term = True

    def __init__(self, dims: ModelDims, *, distance: str = "euclidean") -> None:
        super().__init__(dims)
        if distance not in DISTANCES:
            raise ValueError(f"alibi_2d's distance must be one of {', '.join(DISTANCES)}, got {distance!r}")
        self.distance = distance
        self.register_buffer(
            "slopes", torch.tensor(alibi_slopes(dims.n_heads), dtype=torch.float32), persistent=False
        )

    def score_term(self, q: Tensor, positions: Tensor, layer: int, **_) -> ScoreFn:
        slopes, kind = self.slopes, self.distance

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            dy, dx = grid_offset(positions, b, q_idx, kv_idx)
            return -slopes[h] * cell_distance(dy, dx, kind)

        return bias

    def extra_repr(self) -> str:
        return f"distance={self.distance}"
