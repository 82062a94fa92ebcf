"""RoPE-Mixed on the grid (Heo et al. 2024, "Rotary Position Embedding for Vision Transformer").

Every channel pair of a head turns with both axes at once, by learnable 2D frequencies: pair i of
head h in layer l rotates by ``x * fx[l, h, i] + y * fy[l, h, i]`` for the cell at column x, row y
(Heo et al.'s ``compute_mixed_cis``). So a pair can follow any direction of the grid (a diagonal
too), not only a row or a column as in axial RoPE.

Initialisation as their ``init_random_2d_freqs(dim, num_heads, theta, rotate)``, per layer: the
magnitudes ``mag_i = base^(-4i/D)`` (``1 / theta ** (arange(0, D, 4)[:D // 4] / D)``, D/4 of them)
and one angle ``a ~ U(0, 2 pi)`` per head (0 with ``rotate=false``); the first D/4 pairs point
along ``a``, the last D/4 along ``a + pi / 2``:

    fx = cat(mag cos(a), mag cos(pi/2 + a)),   fy = cat(mag sin(a), mag sin(pi/2 + a))   # (D/2,) each

``freqs`` (2, L, H, D/2) is one learned parameter, as their ``self.freqs`` (kept out of weight
decay, as their ``no_weight_decay``). The angle is linear in (x, y), so ``q_m . k_n`` depends on
the cells only through their offset (dy, dx). Channel pairs (2i, 2i + 1), as their
``apply_rotary_emb``. ``base`` defaults to their RoPE-Mixed value, 10.

The learned frequencies are not :class:`Rotary`'s ``inv_freq``: the 1D extension rules (PI, NTK,
YaRN) do not apply to them and are refused.
"""

import math

import torch
from torch import Tensor, nn

from posbench.methods import register
from posbench.methods.axial_rope import rotate_pairs
from posbench.methods.base import ModelDims, PositionMethod


def random_2d_freqs(head_dim: int, n_heads: int, n_layers: int, base: float, rotate: bool) -> Tensor:
    """Heo et al.'s initial frequencies for every layer -> (2, L, H, D/2): fx then fy.
    The angles are drawn from the global generator, layer by layer, head by head, as their loop."""
    mag = 1 / base ** (torch.arange(0, head_dim, 4)[: head_dim // 4].float() / head_dim)  # (D/4,)
    angles = torch.rand(n_layers, n_heads, 1) * 2 * torch.pi if rotate else torch.zeros(n_layers, n_heads, 1)
    fx = torch.cat((mag * torch.cos(angles), mag * torch.cos(torch.pi / 2 + angles)), dim=-1)  # (L, H, D/2)
    fy = torch.cat((mag * torch.sin(angles), mag * torch.sin(torch.pi / 2 + angles)), dim=-1)  # (L, H, D/2)
    return torch.stack((fx, fy))


@register
class MixedRoPE(PositionMethod):
    name = "mixed_rope"
    enters = "q-k (pair i turns by x fx_i + y fy_i, fx and fy learned per layer and head)"
    source = "Heo et al. 2024 (RoPE-Mixed)"
    past_context = (
        "as ``axial_rope``: scores depend only on the offset, offsets past the training grid's are new, along learned "
        "directions; the 1D extension rules are refused"
    )
    layouts = ("grid",)
    relative_scores = True  # the angle is linear in (x, y): logits depend on the cells only through (dy, dx)

    def __init__(self, dims: ModelDims, *, base: float = 10.0, rotate: bool = True) -> None:
        super().__init__(dims)
        if dims.head_dim % 4:
            raise ValueError(f"{self.name} needs a head dimension divisible by 4 (two directions of pairs), "
                             f"got {dims.head_dim}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not 1 < base < math.inf:
            raise ValueError(f"method.base={base!r} must be a number > 1 (the magnitudes' base; 10 by default)")
        self.base, self.rotate = base, rotate
        self.freqs = nn.Parameter(random_2d_freqs(dims.head_dim, dims.n_heads, dims.n_layers, base, rotate))

    def angles(self, positions: Tensor, layer: int) -> Tensor:
        """(T, 2) or (B, T, 2) cells (row, col) -> (H, T, D/2) or (B, H, T, D/2) angles of ``layer``."""
        cells = positions.float()
        x, y = cells[..., None, :, 1, None], cells[..., None, :, 0, None]  # (..., 1, T, 1) each
        fx, fy = self.freqs[0, layer, :, None].float(), self.freqs[1, layer, :, None].float()  # (H, 1, D/2) each
        return x * fx + y * fy

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        with torch.autocast(q.device.type, enabled=False):  # fp32 angles, as their compute_mixed_cis
            angles = self.angles(positions, layer)
        return rotate_pairs(q, angles), rotate_pairs(k, angles)

    def extra_repr(self) -> str:
        return f"base={self.base}, rotate={self.rotate}"
