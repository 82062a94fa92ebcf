"""lookhere: directed attention masks with a distance penalty (Fuller et al. 2024), against the
bias of their code (``create_lh_bias_tensor`` / ``create_lh_layer_tensor``, GreenCUBIC/lookhere)
written out from its steps here."""

from __future__ import annotations

import pytest
import torch
from grid_score_checks import assert_backends_agree, assert_scores_depend_only_on_offsets, dense_term
from model_checks import assert_matches_reference

from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method, grid_positions
from posbench.model.transformer import ModelConfig, build_model

SHORTHAND = {"halves": [["up"], ["down"], ["left"], ["right"]],
             "corners": [["up", "left"], ["up", "right"], ["down", "left"], ["down", "right"]]}


def lookhere_reference(directions: str, grid_y: int, grid_x: int, heads: int, depth: int, global_slope: float,
                       layer_slopes: tuple[float, float]) -> torch.Tensor:
    """Their bias (depth, H, T, T), fp64, with -inf where they put -bf16 max: coordinates (x, y) of
    a row-major meshgrid; direction masks "right": key x < query x, "left": key x > query x, "up":
    key y > query y, "down": key y < query y (the keys a head does NOT see); Euclidean distance;
    head slopes repeat(2^-(1..H/4), 4); heads cycle through the 4 directions; layer slopes
    linspace(first, last, depth) times the global slope; the result negated."""
    xs, ys = torch.meshgrid(torch.arange(grid_x), torch.arange(grid_y), indexing="xy")  # (gy, gx) each
    coords = torch.stack((xs, ys), dim=-1).reshape(-1, 2).double()  # (T, 2): (x, y)
    qx, qy, kx, ky = coords[:, None, 0], coords[:, None, 1], coords[None, :, 0], coords[None, :, 1]
    hidden = {"right": kx < qx, "left": kx > qx, "up": ky > qy, "down": ky < qy}
    dist = torch.cdist(coords, coords)  # (T, T)
    head_slopes = (2.0 ** -torch.arange(1, heads // 4 + 1, dtype=torch.float64)).repeat_interleave(4)
    head_dirs = SHORTHAND[directions] * (heads // 4)
    layer = []
    for h in range(heads):
        mask = torch.zeros_like(dist, dtype=torch.bool)
        for d in head_dirs[h]:
            mask |= hidden[d]
        layer.append(head_slopes[h] * dist.masked_fill(mask, float("inf")))
    lh = torch.stack(layer)  # (H, T, T)
    scales = global_slope * torch.linspace(*layer_slopes, depth, dtype=torch.float64)
    return -(scales[:, None, None, None] * lh)


@pytest.mark.parametrize("directions", ["halves", "corners"])
@pytest.mark.parametrize("heads, slopes", [(4, (1.0, 1.0, 1.0)), (8, (1.5, 2.0, 0.5))])
def test_lookhere_matches_their_bias(directions, heads, slopes):
    """A 4 x 5 grid (4 rows, 5 columns), every layer: the same cells masked, the same penalties."""
    global_slope, first, last = slopes
    method = build_method("lookhere", ModelDims(d_model=8 * heads, n_heads=heads, n_layers=3), directions=directions,
                          global_slope=global_slope, first_layer_slope=first, last_layer_slope=last)
    want = lookhere_reference(directions, 4, 5, heads, 3, global_slope, (first, last))
    q = torch.randn(1, heads, 20, 8)
    for layer in range(3):
        got = dense_term(method, q, grid_positions(4, 5), layer)[0].double()
        assert torch.equal(got.isinf(), want[layer].isinf())
        finite = want[layer].isfinite()  # the masked keys: -inf in both; the penalties: compared and logged
        assert torch.equal(got[~finite], want[layer][~finite])
        assert_matches_reference(got[finite], want[layer][finite], method="lookhere",
                                 reference=f"GreenCUBIC/lookhere create_lh_bias_tensor ({directions})", atol=1e-6, rtol=1e-6)


def test_lookhere_heads_see_their_own_cell_and_only_their_direction():
    """Halves, 4 heads, the centre of a 5 x 5 grid: the 'up' head sees rows 0-2, 'right' columns 2-4."""
    method = build_method("lookhere", ModelDims(d_model=32, n_heads=4, n_layers=1))
    term = dense_term(method, torch.randn(1, 4, 25, 8), grid_positions(5, 5))[0, :, 12].view(4, 5, 5)  # (H, rows, cols)
    seen = term.isfinite()
    assert seen[:, 2, 2].all()
    assert seen[0, :3].all() and not seen[0, 3:].any()  # up
    assert seen[3, :, 2:].all() and not seen[3, :, :2].any()  # right


@pytest.mark.parametrize("directions", ["halves", "corners"])
def test_lookhere_runs_alike_in_eager_sdpa_and_flex(directions):
    assert_backends_agree("lookhere", {"directions": directions}, heads=4)


def test_lookhere_scores_depend_only_on_offsets():
    assert_scores_depend_only_on_offsets("lookhere", {"directions": "corners"}, heads=4)


@pytest.mark.parametrize("heads, options, message", [
    (2, {}, "lookhere needs a head count divisible by 4"),
    (4, {"directions": "diagonals"}, "lookhere's directions must be one of halves, corners"),
    (4, {"global_slope": 0.0}, "lookhere needs global_slope, first_layer_slope and last_layer_slope > 0"),
])
def test_lookhere_refuses_bad_shapes_and_options(heads, options, message):
    with pytest.raises(PosbenchError, match=message):
        build_model(ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=heads, layout="grid"), "lookhere", options)
