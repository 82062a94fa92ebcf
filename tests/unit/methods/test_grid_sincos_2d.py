"""sincos_2d: MAE's fixed 2D sin-cos embedding, against their ``get_2d_sincos_pos_embed``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_checks import assert_matches_reference

from posbench.methods import ModelDims, build_method, grid_positions
from posbench.model.transformer import ModelConfig, build_model


def mae_1d(embed_dim: int, pos: np.ndarray, dtype=np.float64) -> np.ndarray:
    """MAE's ``get_1d_sincos_pos_embed_from_grid``, written from its formula: (M,) -> (M, D),
    sin of every frequency then cos, omega = 1 / 10000**(i / (D/2))."""
    omega = np.arange(embed_dim // 2, dtype=dtype)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000**omega
    out = np.einsum("m,d->md", pos.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def mae_2d(embed_dim: int, grid_size: int, dtype=np.float64) -> np.ndarray:
    """MAE's ``get_2d_sincos_pos_embed`` (no cls token): their grid is ``meshgrid(grid_w, grid_h)``
    ("w goes first"), and the first half of the channels encodes ``grid[0]``."""
    grid_h = np.arange(grid_size, dtype=dtype)
    grid_w = np.arange(grid_size, dtype=dtype)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])
    emb_h = mae_1d(embed_dim // 2, grid[0], dtype)
    emb_w = mae_1d(embed_dim // 2, grid[1], dtype)
    return np.concatenate([emb_h, emb_w], axis=1)  # (grid_size**2, D)


@pytest.mark.parametrize("d_model, side", [(16, 8), (64, 16), (64, 32), (32, 5)])
def test_matches_maes_table(d_model, side):
    m = build_method("sincos_2d", ModelDims(d_model, 4, 1), scale=1.0)
    got = m.input_embedding(grid_positions(side, side))
    assert got.dtype == torch.float32 and got.shape == (side * side, d_model)
    expected = torch.from_numpy(mae_2d(d_model, side)).float()  # their formula in float64, rounded once
    assert_matches_reference(got, expected, method="sincos_2d", reference="MAE get_2d_sincos_pos_embed (fp64, rounded once)",
                             atol=0, rtol=0)
    float32 = torch.from_numpy(mae_2d(d_model, side, np.float32))  # as their code computes it
    assert_matches_reference(got, float32, method="sincos_2d", reference="MAE get_2d_sincos_pos_embed (fp32, as their code)",
                             atol=2e-5, rtol=0)


def test_the_first_half_encodes_the_column_and_the_second_the_row():
    """MAE's meshgrid puts w first: along a row (same row, next column) only the first half of
    the channels changes, down a column only the second."""
    m = build_method("sincos_2d", ModelDims(16, 2, 1), scale=1.0)
    e = m.input_embedding(torch.tensor([[3, 4], [3, 5], [4, 4]]))  # (row, col)
    assert torch.equal(e[0, 8:], e[1, 8:]) and not torch.allclose(e[0, :8], e[1, :8])
    assert torch.equal(e[0, :8], e[2, :8]) and not torch.allclose(e[0, 8:], e[2, 8:])
    # cell (0, c): the column half is 1D sin-cos of c, the row half that of 0 (sin 0, cos 1)
    assert torch.equal(e.new_tensor([0.0] * 4 + [1.0] * 4), m.input_embedding(torch.tensor([[0, 7]]))[0, 8:])


def test_scale_multiplies_the_table_and_batched_cells_read_the_same():
    dims = ModelDims(32, 2, 1)
    raw, scaled = build_method("sincos_2d", dims, scale=1.0), build_method("sincos_2d", dims)
    cells = grid_positions(6, 6)
    torch.testing.assert_close(scaled.input_embedding(cells), 0.02 * raw.input_embedding(cells), atol=1e-8, rtol=1e-6)
    assert torch.equal(scaled.input_embedding(cells.expand(3, -1, -1))[2], scaled.input_embedding(cells))
    assert scaled.max_positions is None and not list(scaled.parameters())


@pytest.mark.parametrize("options, match", [({"base": 1.0}, "base"), ({"scale": 0.0}, "scale")])
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        build_method("sincos_2d", ModelDims(16, 2, 1), **options)
    with pytest.raises(ValueError, match="divisible by 4"):
        build_method("sincos_2d", ModelDims(18, 2, 1))


def test_grid_model_forward_backward_at_any_side():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, layout="grid"), "sincos_2d")
    for T in (16, 64, 144):
        x = torch.randint(0, 11, (2, T))
        logits = model(x)
        assert logits.shape == (2, T, 11) and torch.isfinite(logits).all()
        logits.pow(2).mean().backward()
        assert model.embed.weight.grad is not None
        model.zero_grad()
