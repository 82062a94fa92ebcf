"""Checks every score-term method of the grid layout shares: the three attention backends agree on
a grid model, gradients reach the method's parameters, and the dense score term depends on the
cells only through their offset (``relative_scores``)."""

from __future__ import annotations

import dataclasses

import torch
from model_checks import assert_matches_reference

from posbench.methods import ModelDims, build_method, cell_index_grid, grid_positions
from posbench.model.transformer import ModelConfig, build_model

GRID = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, layout="grid")


def grid_model(name: str, attention: str = "eager", options: dict | None = None, side: int = 5, heads: int = 2):
    """A 2-layer grid model of method ``name`` (seed 0), its method parameters drawn N(0, 1) so
    the score term is far from zero, and a batch of two ``side x side`` grids of tokens."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(GRID, attention=attention, n_heads=heads), name, options)
    with torch.no_grad():
        for p in model.position.parameters():
            p.normal_()
    tokens = torch.randint(0, GRID.vocab_size, (2, side * side), generator=torch.Generator().manual_seed(1))
    return model, tokens


def method_label(name: str, options: dict | None) -> str:
    """``name (option=value, ...)``, a row label of the reference table (scripts/reference_table.py)."""
    text = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in (options or {}).items())
    return f"{name} ({text})" if text else name


def assert_backends_agree(name: str, options: dict | None = None, side: int = 5, heads: int = 2) -> None:
    """eager, sdpa and flex compute the same logits (forward only: FlexAttention has no CPU
    backward), with the grid's own cells and with per-row cells (B, T, 2); the differences are
    logged for scripts/reference_table.py (``assert_matches_reference``)."""
    out = {}
    for backend in ("eager", "sdpa", "flex"):
        model, tokens = grid_model(name, backend, options, side, heads)
        cells = grid_positions(side, side)
        per_row = torch.stack((cells, cells.flip(-1) * 2))  # (2, T, 2): the second grid transposed, spread out
        with torch.no_grad():
            out[backend] = (model(tokens), model(tokens, per_row))
    for backend in ("sdpa", "flex"):
        for got, want in zip(out[backend], out["eager"]):
            assert_matches_reference(got, want, method=method_label(name, options),
                                     reference=f"{backend} = eager backend's logits (grid and per-row cells)",
                                     atol=2e-5, rtol=2e-5)
    assert not torch.allclose(out["eager"][0], out["eager"][1], atol=1e-4)  # the cells are read


def assert_gradients_reach_parameters(name: str, options: dict | None = None) -> None:
    """One loss backward (sdpa) gives every method parameter a non-zero gradient."""
    model, tokens = grid_model(name, "sdpa", options)
    params = dict(model.position.named_parameters())
    assert params, f"{name} has no parameters"
    labels = tokens.roll(1, dims=1)  # (B, T): a label per cell
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    for key, p in params.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}.{key} got no gradient"


def dense_term(method, q: torch.Tensor, cells: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """The method's score term on the full (B|1, H, T, T) grid of (query, key) pairs."""
    _, q_idx, kv_idx = cell_index_grid(cells)
    b = torch.arange(q.shape[0]).view(-1, 1, 1, 1)  # the batch of q (the term may read q)
    h = torch.arange(q.shape[1]).view(1, -1, 1, 1)
    fn = method.score_term(q, cells, layer, k=q, x=None)
    return fn(b, h, q_idx, kv_idx).expand(q.shape[0], q.shape[1], q_idx.shape[2], kv_idx.shape[3])


def assert_scores_depend_only_on_offsets(name: str, options: dict | None = None, heads: int = 2) -> None:
    """Shifting every cell by the same (dy, dx) leaves the score term unchanged (far past the
    training grid too); spreading the cells apart, which changes the offsets, changes it."""
    torch.manual_seed(0)
    method = build_method(name, ModelDims(d_model=32, n_heads=heads, n_layers=2), **(options or {}))
    with torch.no_grad():
        for p in method.parameters():
            p.normal_()
    cells = grid_positions(6, 6)  # (36, 2)
    q = torch.randn(2, heads, 36, 32 // heads)
    with torch.no_grad():
        base = dense_term(method, q, cells, layer=1)
        for shift in ((1, 0), (0, 3), (40, 17)):
            torch.testing.assert_close(dense_term(method, q, cells + torch.tensor(shift), layer=1), base)
        assert not torch.allclose(dense_term(method, q, cells * 2, layer=1), base, atol=1e-4)
    assert type(method).relative_scores
