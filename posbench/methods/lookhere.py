"""LookHere on the grid (Fuller et al. 2024, "LookHere: Vision Transformers with Directed
Attention Generalize and Extrapolate"): each head looks in one direction and pays for distance.

A head sees only the keys in its field of view (the others are masked, -inf) and the keys it sees
get ALiBi's linear penalty on their Euclidean distance:

    score_ij += -global_slope * s_l * m_h * |cell(i) - cell(j)|   if j is in head h's view,
                -inf                                                otherwise.

``directions``: ``halves`` (LH-180, each head a half-plane: up, down, left, right; keys on the
dividing row or column included) or ``corners`` (LH-90, a quadrant: up-left, up-right, down-left,
down-right). As in their code (``create_lh_layer_tensor``), head h looks in direction h mod 4 with
slope m_h = 2^-(floor(h / 4) + 1) (4 heads: all 1/2; 8 heads: 1/2 then 1/4), so the head count must
be a multiple of 4; layer l's slope s_l runs linearly from ``first_layer_slope`` to
``last_layer_slope`` over the depth (their ``layer_slopes``), times ``global_slope``. "Up" is the
smaller row index. A query always sees its own cell, so no row of the attention is all masked.

The slopes the paper trained with are in its released checkpoints' configs, which we do not
reproduce: the defaults here (all 1) are ours. No learned parameters; any grid works.
"""

import torch
from torch import Tensor

from posbench.methods import register
from posbench.methods.base import ModelDims, PositionMethod, ScoreFn, grid_offset

# Per direction, the sign the offset (dy, dx) = cell(q) - cell(kv) must have (0: any) for the key
# to be in view: "up" sees keys with row <= the query's, i.e. dy >= 0.
FIELDS_OF_VIEW = {
    "halves": ((1, 0), (-1, 0), (0, 1), (0, -1)),  # up, down, left, right
    "corners": ((1, 1), (1, -1), (-1, 1), (-1, -1)),  # up-left, up-right, down-left, down-right
}


@register
class LookHere(PositionMethod):
    name = "lookhere"
    enters = "score (-inf outside head h's field of view, else a penalty linear in the distance)"
    source = "Fuller et al. 2024 (LookHere)"
    past_context = (
        "fixed directed masks and a penalty growing linearly with the distance between cells; no learned parameters, "
        "so nothing is untrained past the training grid"
    )
    layouts = ("grid",)
    relative_scores = True  # logits depend on the cells only through (dy, dx)
    has_score_term = True

    def __init__(self, dims: ModelDims, *, directions: str = "halves", global_slope: float = 1.0,
                 first_layer_slope: float = 1.0, last_layer_slope: float = 1.0) -> None:
        super().__init__(dims)
        if directions not in FIELDS_OF_VIEW:
            raise ValueError(f"lookhere's directions must be one of {', '.join(FIELDS_OF_VIEW)}, got {directions!r}")
        if dims.n_heads % 4:
            raise ValueError(f"lookhere needs a head count divisible by 4 (one direction each), got {dims.n_heads}")
        if not min(global_slope, first_layer_slope, last_layer_slope) > 0:
            raise ValueError("lookhere needs global_slope, first_layer_slope and last_layer_slope > 0")
        self.directions = directions
        self.global_slope, self.first_layer_slope, self.last_layer_slope = global_slope, first_layer_slope, last_layer_slope
        heads = torch.arange(dims.n_heads)
        signs = torch.tensor(FIELDS_OF_VIEW[directions])[heads % 4]  # (H, 2): (row sign, col sign)
        self.register_buffer("signs", signs, persistent=False)
        self.register_buffer("head_slopes", 2.0 ** -(heads // 4 + 1).float(), persistent=False)  # (H,)
        layer_slopes = torch.linspace(first_layer_slope, last_layer_slope, dims.n_layers, dtype=torch.float64)
        self.register_buffer("layer_slopes", (global_slope * layer_slopes).float(), persistent=False)  # (L,)

    def score_term(self, q: Tensor, positions: Tensor, layer: int, **_) -> ScoreFn:
        slopes = self.head_slopes * self.layer_slopes[layer]  # (H,)
        signs = self.signs

        def bias(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            dy, dx = grid_offset(positions, b, q_idx, kv_idx)
            in_view = (signs[h, 0] * dy >= 0) & (signs[h, 1] * dx >= 0)
            penalty = -slopes[h] * torch.sqrt((dy * dy + dx * dx).float())
            return torch.where(in_view, penalty, float("-inf"))

        return bias

    def extra_repr(self) -> str:
        return (f"directions={self.directions}, global_slope={self.global_slope}, "
                f"layer_slopes={self.first_layer_slope}..{self.last_layer_slope}")
