"""The grid layout: the bidirectional grid encoder and the 2D position methods' references."""

from __future__ import annotations

import pytest
import torch
from model_checks import assert_matches_reference

from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method, grid_positions, grid_side, list_methods
from posbench.model.attention import attend
from posbench.model.transformer import ModelConfig, build_model

GRID = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, layout="grid")


def test_grid_positions_are_row_major_cells():
    cells = grid_positions(2, 3)
    assert cells.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert grid_side(64) == 8
    with pytest.raises(PosbenchError, match="not square"):
        grid_side(63)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
def test_non_causal_attention_sees_every_key_in_every_backend(backend):
    """Bidirectional attention equals the softmax over all keys written out, in each backend,
    with and without a score term."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8) for _ in range(3))

    def score(b, h, i, j):
        return 0.1 * (i - j).float().abs() * (h + 1)

    for fn in (None, score):
        logits = q @ k.transpose(-1, -2) / 8**0.5
        if fn is not None:
            idx = torch.arange(9)
            logits = logits + fn(None, torch.arange(3).view(1, 3, 1, 1), idx.view(1, 1, 9, 1), idx.view(1, 1, 1, 9))
        expected = logits.softmax(-1) @ v
        with torch.no_grad():
            out = attend(q, k, v, fn, backend, causal=False)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_grid_encoder_is_bidirectional_and_nope_sees_a_bag_of_cells():
    """A change at the last cell moves the first cell's output (no causal mask); with nope,
    permuting the cells permutes the outputs (nothing reads the cells' positions)."""
    torch.manual_seed(0)
    model = build_model(GRID, "nope").eval()
    x = torch.randint(0, 11, (1, 16))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 11
    with torch.no_grad():
        assert not torch.allclose(model(x)[0, 0], model(y)[0, 0])
        perm = torch.randperm(16)
        torch.testing.assert_close(model(x[:, perm]), model(x)[:, perm], atol=1e-5, rtol=1e-5)


def test_a_model_refuses_a_method_not_made_for_its_layout():
    with pytest.raises(PosbenchError, match="method=rope is not made for the grid layout"):
        build_model(GRID, "rope")
    with pytest.raises(PosbenchError, match="method=axial_rope is not made for the sequence layout"):
        build_model(ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2), "axial_rope")
    with pytest.raises(PosbenchError, match="not square"):
        build_model(GRID, "nope")(torch.zeros(1, 15, dtype=torch.long))


def test_the_layout_is_recorded_only_for_the_grid():
    """The sequence model's recorded config is what it was before the grid layout existed."""
    assert "layout" not in ModelConfig().to_dict()
    assert GRID.to_dict()["layout"] == "grid"
    assert ModelConfig.from_dict(GRID.to_dict()) == GRID


def test_sequence_methods_are_listed_apart_from_grid_methods():
    assert "axial_rope" in list_methods("grid") and "axial_rope" not in list_methods()
    assert "nope" in list_methods("grid") and "nope" in list_methods()
    assert set(list_methods(None)) == set(list_methods()) | set(list_methods("grid"))


# ----------------------------------------------------------------------------- axial RoPE


def heo_axial_cis(dim: int, end_x: int, end_y: int, theta: float) -> torch.Tensor:
    """Heo et al.'s ``compute_axial_cis`` (naver-ai/rope-vit), written from their formula:
    (end_x * end_y, dim / 2) complex rotations, column (x) frequencies then row (y)."""
    freqs_x = 1.0 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim))
    freqs_y = 1.0 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim))
    t = torch.arange(end_x * end_y, dtype=torch.float32)
    t_x, t_y = (t % end_x).float(), torch.div(t, end_x, rounding_mode="floor").float()
    freqs_x, freqs_y = torch.outer(t_x, freqs_x), torch.outer(t_y, freqs_y)
    return torch.cat([torch.polar(torch.ones_like(freqs_x), freqs_x), torch.polar(torch.ones_like(freqs_y), freqs_y)], dim=-1)


def heo_apply(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Their ``apply_rotary_emb``: channel pairs (2i, 2i + 1) as complex numbers times ``cis``."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis).flatten(-2)


@pytest.mark.parametrize("base", [100.0, 10.0])
def test_axial_rope_matches_heo_et_al(base):
    dims = ModelDims(d_model=32, n_heads=2, n_layers=1)
    method = build_method("axial_rope", dims, base=base)
    q, k = torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    cells = grid_positions(3, 4)  # 3 rows of 4 columns, row-major as Heo et al.'s t
    rq, rk = method.rotate_qk(q, k, cells)
    cis = heo_axial_cis(16, end_x=4, end_y=3, theta=base)
    for got, x in ((rq, q), (rk, k)):
        assert_matches_reference(got, heo_apply(x, cis), method="axial_rope",
                                 reference="Heo et al. compute_axial_cis + apply_rotary_emb", atol=1e-5, rtol=1e-5)


def test_axial_rope_scores_depend_only_on_the_offset():
    dims = ModelDims(d_model=32, n_heads=2, n_layers=1)
    method = build_method("axial_rope", dims)
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)

    def score(qcell, kcell):
        rq, _ = method.rotate_qk(q, q, torch.tensor([qcell]))
        _, rk = method.rotate_qk(k, k, torch.tensor([kcell]))
        return (rq * rk).sum()

    torch.testing.assert_close(score((2, 5), (1, 3)), score((12, 9), (11, 7)), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score((2, 5), (1, 3)), score((2, 5), (3, 1)))
