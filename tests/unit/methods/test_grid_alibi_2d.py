"""alibi_2d: ALiBi's slopes times the distance between cells, against CROMA's 2D ALiBi and the
formula written out pair by pair."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from grid_score_checks import assert_backends_agree, assert_scores_depend_only_on_offsets, dense_term
from model_checks import assert_matches_reference
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method, grid_positions
from posbench.model.transformer import ModelConfig, build_model


def press_slopes(n: int) -> torch.Tensor:
    """ALiBi's slopes (Press et al.'s code, which CROMA copies), read off transformers' BLOOM
    ALiBi tensor: the bias of a key 1 position away is its head's slope -> (n,)."""
    return build_alibi_tensor(torch.ones(1, 2), n, torch.float64)[:, 0, 1]


def croma_2dalibi(num_heads: int, side: int) -> torch.Tensor:
    """CROMA's ``get_2dalibi`` (Fuller et al. 2023), written from its steps: every pair of
    patches of a side x side grid (itertools.product order = row-major), minus the slope times
    their Euclidean distance -> (1, H, T, T)."""
    points = list(itertools.product(range(side), range(side)))
    slopes = press_slopes(num_heads).float()
    dists = torch.tensor([math.sqrt((p[0] - r[0]) ** 2 + (p[1] - r[1]) ** 2) for p in points for r in points])
    return (-slopes[:, None] * dists[None]).view(1, num_heads, side * side, side * side)


@pytest.mark.parametrize("heads", [2, 6, 8])
def test_alibi_2d_matches_cromas_2d_alibi(heads):
    method = build_method("alibi_2d", ModelDims(d_model=8 * heads, n_heads=heads, n_layers=1))
    q = torch.randn(1, heads, 36, 8)
    assert_matches_reference(dense_term(method, q, grid_positions(6, 6)), croma_2dalibi(heads, 6), method="alibi_2d",
                             reference="CROMA get_2dalibi (6 x 6 grid)")


@pytest.mark.parametrize("distance", ["euclidean", "manhattan"])
def test_alibi_2d_matches_the_formula_pair_by_pair(distance):
    """Per-row cells (B, T, 2), a 3 x 4 grid and its transpose spread out: -m_h dist(i, j)."""
    method = build_method("alibi_2d", ModelDims(d_model=32, n_heads=4, n_layers=1), distance=distance)
    cells = torch.stack((grid_positions(3, 4), grid_positions(3, 4).flip(-1) * 3))  # (2, 12, 2)
    slopes = press_slopes(4)
    want = torch.zeros(2, 4, 12, 12)
    for b, h, i, j in itertools.product(range(2), range(4), range(12), range(12)):
        dy, dx = (cells[b, i] - cells[b, j]).tolist()
        dist = math.hypot(dy, dx) if distance == "euclidean" else abs(dy) + abs(dx)
        want[b, h, i, j] = -slopes[h].item() * dist
    assert_matches_reference(dense_term(method, torch.randn(2, 4, 12, 8), cells), want, method="alibi_2d",
                             reference=f"formula -m_h dist(i, j), pair by pair ({distance})")


@pytest.mark.parametrize("distance", ["euclidean", "manhattan"])
def test_alibi_2d_runs_alike_in_eager_sdpa_and_flex(distance):
    assert_backends_agree("alibi_2d", {"distance": distance})


@pytest.mark.parametrize("distance", ["euclidean", "manhattan"])
def test_alibi_2d_scores_depend_only_on_offsets(distance):
    assert_scores_depend_only_on_offsets("alibi_2d", {"distance": distance})


def test_alibi_2d_refuses_an_unknown_distance():
    with pytest.raises(PosbenchError, match="alibi_2d's distance must be one of euclidean, manhattan, got 'chebyshev'"):
        build_model(ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, layout="grid"), "alibi_2d",
                    {"distance": "chebyshev"})
