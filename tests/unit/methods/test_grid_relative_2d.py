"""relative_2d: 2D relative position embeddings on the grid, against the formula written out pair
by pair and against the AI Summer article's rel_to_abs formulation (self-attention-cv)."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange
from grid_score_checks import (
    assert_backends_agree,
    assert_gradients_reach_parameters,
    assert_scores_depend_only_on_offsets,
    dense_term,
)
from model_checks import assert_matches_reference

from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method, grid_positions
from posbench.model.transformer import ModelConfig, build_model


def make(max_offset: int = 7):
    torch.manual_seed(0)
    method = build_method("relative_2d", ModelDims(d_model=32, n_heads=2, n_layers=2), max_offset=max_offset)
    with torch.no_grad():
        for p in method.parameters():
            p.normal_()
    return method


def naive(q: torch.Tensor, cells: torch.Tensor, row: torch.Tensor, col: torch.Tensor, k: int) -> torch.Tensor:
    """score[b, h, i, j] = q_i . (row[k + clip(dy)] + col[k + clip(dx)]) / sqrt(D), pair by pair;
    cells (T, 2) or (B, T, 2)."""
    B, H, T, D = q.shape
    out = torch.zeros(B, H, T, T)
    for b in range(B):
        c = cells if cells.dim() == 2 else cells[b]
        for i in range(T):
            for j in range(T):
                dy = min(max(int(c[i, 0] - c[j, 0]), -k), k)
                dx = min(max(int(c[i, 1] - c[j, 1]), -k), k)
                out[b, :, i, j] = q[b, :, i] @ (row[k + dy] + col[k + dx]) / D**0.5
    return out


@pytest.mark.parametrize("max_offset", [2, 7])
def test_relative_2d_matches_the_formula_pair_by_pair(max_offset):
    """On a 5 x 5 grid: clipped (max_offset 2 < 4, the largest offset) and unclipped; for the
    shared cells and for per-row cells (B, T, 2)."""
    m = make(max_offset)
    q = torch.randn(2, 2, 25, 16)
    cells = grid_positions(5, 5)
    per_row = torch.stack((cells, cells.flip(-1) * 2))  # the second row: transposed, spread out
    for layer in (0, 1):
        row, col = m.row_tables[layer].detach(), m.col_tables[layer].detach()
        for c in (cells, per_row):
            with torch.no_grad():
                got = dense_term(m, q, c, layer)
            assert_matches_reference(got, naive(q, c, row, col, max_offset), method="relative_2d",
                                     reference=f"formula pair by pair, max_offset={max_offset}", atol=1e-5, rtol=1e-5)


def article_rel_to_abs(x: torch.Tensor) -> torch.Tensor:
    """The article's ``relative_to_absolute`` (self-attention-cv, after lucidrains' bottleneck
    transformer), written from its steps: (b, h, L, 2L - 1) logits per relative index ->
    (b, h, L, L), out[i, j] = x[i, j - i + L - 1]: pad a zero column, flatten, pad L - 1 zeros,
    reshape to (L + 1, 2L - 1) and keep the first L rows from column L - 1 on."""
    b, h, L, _ = x.shape
    x = torch.cat((x, torch.zeros(b, h, L, 1)), dim=3)
    flat = torch.cat((x.reshape(b, h, L * 2 * L), torch.zeros(b, h, L - 1)), dim=2)
    return flat.reshape(b, h, L + 1, 2 * L - 1)[:, :, :L, L - 1:]


def article_axis_term(q_lines: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The article's 1D relative logits along one axis: q (..., L, D) times its (2L - 1, D) table
    (index r = key - query + L - 1), then rel_to_abs -> (..., L, L)."""
    *lead, L, D = q_lines.shape
    logits = torch.einsum("ntd,rd->ntr", q_lines.reshape(-1, L, D), table)[:, None]  # (N, 1, L, 2L-1)
    return article_rel_to_abs(logits)[:, 0].reshape(*lead, L, L)


def test_relative_2d_matches_the_articles_rel_to_abs_on_an_unclipped_grid():
    """A 3 x 4 grid with max_offset 3 (no offset clipped). The article's tables are indexed by
    key - query; ours by query - key (``grid_offset``), so its table is ours reversed. The article's
    own 2D wrapper (RelPosEmb2D) is not the reference: it lays out the row term in column-major
    order (its second ``expand_emb`` regroups (width, row) as (row, width)), so its "row" term
    reads the transposed cell's query; here each axis term is placed by its cells explicitly."""
    K, Hg, Wg = 3, 3, 4
    m = make(K)
    q = torch.randn(2, 2, Hg * Wg, 16)
    row = m.row_tables[0].detach()[K - (Hg - 1): K + Hg].flip(0)  # (2 Hg - 1, D), key - query order
    col = m.col_tables[0].detach().flip(0)  # (2 Wg - 1, D) = (2K + 1, D)
    grid = rearrange(q, "b h (y x) d -> b h y x d", y=Hg, x=Wg)
    # column term: along each row, broadcast over the key's row; row term: along each column.
    col_term = article_axis_term(grid, col)  # (b, h, y, x_q, x_k)
    row_term = article_axis_term(grid.transpose(2, 3), row)  # (b, h, x, y_q, y_k)
    col_full = col_term[:, :, :, :, None, :].expand(-1, -1, -1, -1, Hg, -1)  # (b, h, yq, xq, yk, xk)
    row_full = row_term.permute(0, 1, 3, 2, 4)[..., None].expand(-1, -1, -1, -1, -1, Wg)  # (b, h, yq, xq, yk, xk)
    reference = rearrange(col_full + row_full, "b h yq xq yk xk -> b h (yq xq) (yk xk)") * 16**-0.5
    with torch.no_grad():
        got = dense_term(m, q, grid_positions(Hg, Wg), layer=0)
    assert_matches_reference(got, reference, method="relative_2d", reference="AI Summer rel_to_abs (self-attention-cv), unclipped",
                             atol=1e-5, rtol=1e-5)


def test_relative_2d_runs_alike_in_eager_sdpa_and_flex():
    assert_backends_agree("relative_2d", {"max_offset": 2})  # 5 x 5 grid: offsets past 2 are clipped


def test_relative_2d_gradients_reach_both_tables_of_every_layer():
    assert_gradients_reach_parameters("relative_2d")


def test_relative_2d_scores_depend_only_on_offsets():
    assert_scores_depend_only_on_offsets("relative_2d", {"max_offset": 3})


def test_relative_2d_refuses_a_negative_max_offset():
    with pytest.raises(PosbenchError, match="relative_2d needs max_offset >= 0"):
        build_model(ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, layout="grid"), "relative_2d",
                    {"max_offset": -1})


def test_relative_2d_fast_path_equals_the_gather():
    """fast: the one-hot matmul gives the default's term (shared and per-row cells, clipped) and
    the same gradients for q and both tables, to fp32 rounding."""
    cells = grid_positions(5, 5)
    for c in (cells, torch.stack((cells, cells.flip(-1) * 2))):
        terms, grads = [], []
        for fast in (False, True):
            torch.manual_seed(0)
            m = build_method("relative_2d", ModelDims(d_model=32, n_heads=2, n_layers=2), max_offset=2, fast=fast)
            q = torch.randn(2, 2, 25, 16, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
            term = dense_term(m, q, c, layer=1)
            term.pow(2).sum().backward()
            terms.append(term.detach())
            grads.append((q.grad, m.row_tables[1].grad, m.col_tables[1].grad))
        torch.testing.assert_close(terms[1], terms[0], atol=1e-6, rtol=1e-6)
        for fast_grad, grad in zip(grads[1], grads[0]):
            torch.testing.assert_close(fast_grad, grad, atol=1e-5, rtol=1e-5)


def test_relative_2d_fast_path_runs_alike_in_eager_sdpa_and_flex():
    assert_backends_agree("relative_2d", {"max_offset": 2, "fast": True})
