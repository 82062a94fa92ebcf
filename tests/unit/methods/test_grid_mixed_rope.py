"""RoPE-Mixed (posbench/methods/mixed_rope.py) against Heo et al.'s formulas (naver-ai/rope-vit,
``init_random_2d_freqs``, ``compute_mixed_cis``, ``apply_rotary_emb``), written here from their code."""

from __future__ import annotations

import math

import pytest
import torch
from model_checks import assert_matches_reference

from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method, grid_positions
from posbench.model.extension import resolve_extensions
from posbench.model.transformer import ModelConfig, build_model

DIMS = ModelDims(d_model=32, n_heads=2, n_layers=3)  # head dim 16


def heo_init_random_2d_freqs(dim: int, num_heads: int, theta: float, rotate: bool) -> torch.Tensor:
    """Their initial frequencies of one block -> (2, num_heads, dim / 2): fx, fy."""
    freqs_x, freqs_y = [], []
    mag = 1 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim))
    for _ in range(num_heads):
        angles = torch.rand(1) * 2 * torch.pi if rotate else torch.zeros(1)
        freqs_x.append(torch.cat([mag * torch.cos(angles), mag * torch.cos(torch.pi / 2 + angles)], dim=-1))
        freqs_y.append(torch.cat([mag * torch.sin(angles), mag * torch.sin(torch.pi / 2 + angles)], dim=-1))
    return torch.stack([torch.stack(freqs_x, dim=0), torch.stack(freqs_y, dim=0)], dim=0)


def heo_model_freqs(dim: int, num_heads: int, depth: int, theta: float, rotate: bool = True) -> torch.Tensor:
    """Their model's ``self.freqs``: one init per block, stacked -> (2, depth, num_heads * dim / 2)."""
    blocks = [heo_init_random_2d_freqs(dim, num_heads, theta, rotate) for _ in range(depth)]
    return torch.stack(blocks, dim=1).view(2, depth, -1)


def heo_t_xy(end_x: int, end_y: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Their ``init_t_xy``: the row-major patches' column (x) and row (y)."""
    t = torch.arange(end_x * end_y, dtype=torch.float32)
    return (t % end_x).float(), torch.div(t, end_x, rounding_mode="floor").float()


def heo_compute_mixed_cis(freqs: torch.Tensor, t_x: torch.Tensor, t_y: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Their ``compute_mixed_cis`` -> (depth, num_heads, N, dim / 2) complex rotations."""
    N, depth = t_x.shape[0], freqs.shape[1]
    freqs_x = (t_x.unsqueeze(-1) @ freqs[0].unsqueeze(-2)).view(depth, N, num_heads, -1).permute(0, 2, 1, 3)
    freqs_y = (t_y.unsqueeze(-1) @ freqs[1].unsqueeze(-2)).view(depth, N, num_heads, -1).permute(0, 2, 1, 3)
    return torch.polar(torch.ones_like(freqs_x), freqs_x + freqs_y)


def heo_apply(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """Their ``apply_rotary_emb``: channel pairs (2i, 2i + 1) as complex numbers times ``cis``."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis).flatten(3)


@pytest.mark.parametrize("base, rotate", [(10.0, True), (100.0, True), (10.0, False)])
def test_initial_frequencies_are_heo_et_al_s_drawn_from_the_same_generator(base, rotate):
    torch.manual_seed(3)
    method = build_method("mixed_rope", DIMS, base=base, rotate=rotate)
    torch.manual_seed(3)
    expected = heo_model_freqs(16, num_heads=2, depth=3, theta=base, rotate=rotate)
    assert method.freqs.shape == (2, 3, 2, 8)  # (axis, layer, head, D/2)
    assert_matches_reference(method.freqs.detach().view(2, 3, -1), expected, method="mixed_rope",
                             reference="Heo et al. init_random_2d_freqs, same generator", rtol=0, atol=0)
    if not rotate:  # every head starts axial: the first D/4 pairs along x, the last along y
        assert torch.all(method.freqs[1, ..., :4] == 0) and torch.all(method.freqs[0, ..., 4:].abs() < 1e-6)


def test_rotation_is_heo_et_al_s_mixed_cis_per_layer():
    torch.manual_seed(0)
    method = build_method("mixed_rope", DIMS)
    with torch.no_grad():
        method.freqs.add_(0.1 * torch.randn_like(method.freqs))  # as if trained: no structure left to lean on
    q, k = torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)  # (B, H, T, D)
    t_x, t_y = heo_t_xy(end_x=4, end_y=3)
    cis = heo_compute_mixed_cis(method.freqs.detach().view(2, 3, -1), t_x, t_y, num_heads=2)  # (L, H, T, D/2)
    cells = grid_positions(3, 4)  # 3 rows of 4 columns, row-major as their t
    for layer in range(3):
        rq, rk = method.rotate_qk(q, k, cells, layer)
        for got, x in ((rq, q), (rk, k)):
            assert_matches_reference(got, heo_apply(x, cis[layer]), method="mixed_rope",
                                     reference="Heo et al. compute_mixed_cis + apply_rotary_emb", atol=1e-5, rtol=1e-5)
        # per-row cells (B, T, 2) rotate each row by its own cells
        batched = torch.stack((cells, cells.flip(0)))
        bq, _ = method.rotate_qk(q, k, batched, layer)
        torch.testing.assert_close(bq[0], rq[0])
        assert_matches_reference(bq[1], heo_apply(q, cis[layer].flip(1))[1], method="mixed_rope",
                                 reference="Heo et al. compute_mixed_cis + apply_rotary_emb, per-row cells",
                                 atol=1e-5, rtol=1e-5)


def test_scores_depend_only_on_the_offset_and_mix_the_axes():
    torch.manual_seed(0)
    method = build_method("mixed_rope", DIMS)
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)

    def score(qcell, kcell, layer=1):
        rq, _ = method.rotate_qk(q, q, torch.tensor([qcell]), layer)
        _, rk = method.rotate_qk(k, k, torch.tensor([kcell]), layer)
        return (rq * rk).sum(-1).flatten()  # (H,)

    torch.testing.assert_close(score((2, 5), (1, 3)), score((12, 9), (11, 7)), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(score((0, 0), (7, 3)), score((20, 30), (27, 33)), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score((2, 5), (1, 3)), score((2, 5), (3, 1)))
    # A pair of a randomly directed head turns with both axes: a pure row offset moves it.
    angles = method.angles(torch.tensor([[1, 0]]), layer=0)  # the cell one row down
    assert torch.all(angles[:, 0, :4].abs() > 0)  # the first D/4 pairs are not x-only, as axial RoPE's are


def test_shifting_every_cell_leaves_the_model_s_output_unchanged():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, layout="grid", init_std=0.2)  # sharp attention
    model = build_model(cfg, "mixed_rope")
    x, cells = torch.randint(0, 11, (2, 16)), grid_positions(4, 4)
    with torch.no_grad():
        out = model(x, positions=cells)
        torch.testing.assert_close(model(x, positions=cells + torch.tensor([3, 7])), out, atol=1e-4, rtol=1e-4)
        assert (model(x, positions=cells.flip(-1)) - out).abs().max() > 0.1  # a transposed grid differs


def test_gradients_reach_every_layer_s_frequencies():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=11, d_model=32, n_layers=3, n_heads=2, layout="grid"), "mixed_rope")
    x = torch.randint(0, 11, (2, 16))
    model(x, targets=torch.randint(0, 11, (2, 16))).backward()
    grad = model.position.freqs.grad  # (2, L, H, D/2)
    assert grad is not None and all(grad[:, layer].abs().sum() > 0 for layer in range(3))
    assert set(model.position.position_parameters()) == {"freqs"}  # logged as it trains


def test_eager_and_sdpa_agree_forward_and_backward():
    cfg = dict(vocab_size=11, d_model=32, n_layers=2, n_heads=2, layout="grid")
    x, y = torch.randint(0, 11, (2, 64)), torch.randint(0, 11, (2, 64))
    results = []
    for backend in ("eager", "sdpa"):
        torch.manual_seed(0)
        model = build_model(ModelConfig(**cfg, attention=backend), "mixed_rope")
        logits = model(x)
        model(x, targets=y).backward()
        results.append((logits.detach(), model.position.freqs.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-4, rtol=1e-4)
    assert results[0][1].abs().sum() > 0


def test_the_method_consumes_one_draw_so_the_body_is_axial_rope_s():
    """Same seed, same body: the token embedding, blocks and head equal axial RoPE's bit for bit."""
    cfg = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, layout="grid")
    torch.manual_seed(5)
    mixed = build_model(cfg, "mixed_rope")
    torch.manual_seed(5)
    axial = build_model(cfg, "axial_rope")
    body = {n: p for n, p in axial.named_parameters() if not n.startswith("position.")}
    assert body and all(torch.equal(p, body[n]) for n, p in mixed.named_parameters() if n in body)


def test_bad_options_and_extensions_are_one_line():
    with pytest.raises(ValueError, match="divisible by 4"):
        build_method("mixed_rope", ModelDims(d_model=12, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match="must be a number > 1"):
        build_method("mixed_rope", DIMS, base=1.0)
    with pytest.raises(PosbenchError, match="extension yarn does not apply to method=mixed_rope"):
        resolve_extensions(["yarn"], "mixed_rope", layout="grid")
    assert math.isclose(build_method("mixed_rope", DIMS).base, 10.0)
