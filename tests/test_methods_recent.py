"""The methods of 2022-2026 papers, the window baseline, randomized positions and same-body init.

References are x-transformers / rotary-embedding-torch with copied parameters where they implement
the method (xpos, cope, partial rotary), else the paper's formula written out here.
"""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

import posbench
from conftest import assert_matches_reference
from posbench.attention import attend, resolve_backend
from posbench.errors import PosbenchError
from posbench.methods import ModelDims, build_method, dense_score
from posbench.positions import draw_positions, method_label, randomize_max_from_config
from tests.test_methods import causal, full_scores, layer_input, qk

ALL_METHODS = posbench.list_methods()
NEW_METHODS = ["kerple", "sandwich", "fire", "xpos", "p_rope", "cope", "fox", "abs_attention"]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def make(name, d_model=32, n_heads=4, n_layers=2, randomise=True, **options):
    torch.manual_seed(0)
    m = build_method(name, ModelDims(d_model, n_heads, n_layers), **options)
    if randomise:
        with torch.no_grad():
            for p in m.parameters():
                p.uniform_(0.2, 1.2)  # positive: valid for kerple's r1, r2 and fire's c
    return m.double()


def dense(m, q, pos, layer=0, k=None):
    B, H, T, _ = q.shape
    fn = m.score_term(q, pos, layer, k=k, x=layer_input(q, m.dims.d_model))
    return dense_score(fn, B, H, T, q.device).double()


def test_every_method_is_registered():
    assert set(NEW_METHODS) <= set(ALL_METHODS)


# ---------------------------------------------------------------------------------------- kerple


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_matches_paper_formula(variant):
    m = make("kerple", variant=variant)
    q, _ = qk(B=1, T=30)
    for layer in range(2):
        r1, r2 = m.r1[layer].detach(), m.r2[layer].detach()
        d = (torch.arange(30).view(-1, 1) - torch.arange(30).view(1, -1)).clamp(min=0).double()
        kernel = -r1.view(-1, 1, 1) * (torch.log(1 + r2.view(-1, 1, 1) * d) if variant == "log" else d ** r2.view(-1, 1, 1))
        mask = causal(30)
        assert_matches_reference(dense(m, q, torch.arange(30), layer)[0][:, mask], kernel[:, mask], method="kerple",
                                 reference=f"paper formula, {variant} variant")


def test_kerple_parameters_projected_into_range():
    m = make("kerple", variant="power", randomise=False)
    with torch.no_grad():
        m.r1.fill_(-1.0)
        m.r2.fill_(5.0)
    q, _ = qk(B=1, T=8)
    dense(m, q, torch.arange(8))
    assert (m.r1 == 0.01).all() and (m.r2 == 2.0).all()
    with pytest.raises(ValueError, match="log or power"):
        make("kerple", variant="cubic")


# -------------------------------------------------------------------------------------- sandwich


@pytest.mark.parametrize("compress_heads", [True, False])
def test_sandwich_is_the_inner_product_of_sinusoidal_embeddings(compress_heads):
    H, T, d_prime = 4, 40, 16
    m = make("sandwich", d_prime=d_prime, compress_heads=compress_heads)
    q, _ = qk(B=1, H=H, T=T)
    # p_i = [sin(i w_k), cos(i w_k)]_{k=1..d'/2}, w_k = 10000^(-2k/d'): the embeddings themselves.
    w = 10000.0 ** (-2 * torch.arange(1, d_prime // 2 + 1, dtype=torch.float64) / d_prime)
    angle = torch.arange(T, dtype=torch.float64).view(-1, 1) * w
    p = torch.cat((angle.sin(), angle.cos()), dim=-1)  # (T, d')
    inner = p @ p.T - d_prime / 2  # (T, T)
    divisor = 8 * torch.arange(1, H + 1, dtype=torch.float64) / H if compress_heads else torch.ones(H, dtype=torch.float64)
    expected = inner / divisor.view(-1, 1, 1)
    mask = causal(T)
    assert_matches_reference(dense(m, q, torch.arange(T))[0][:, mask], expected[:, mask], method="sandwich",
                             reference="paper: inner product of sinusoidal embeddings", atol=1e-5, rtol=1e-5)
    assert sum(p.numel() for p in m.parameters()) == 0


# ------------------------------------------------------------------------------------------ fire


def test_fire_matches_paper_formula():
    m = make("fire", mlp_width=8, init_L=20.0)
    q, _ = qk(B=1, T=50)
    c, L = m.c.detach(), (m.L_multiplier.detach() * 20.0).abs()
    i = torch.arange(50, dtype=torch.float64).view(-1, 1)
    j = torch.arange(50, dtype=torch.float64).view(1, -1)
    psi = lambda x: torch.log(torch.abs(c * x) + 1)  # noqa: E731
    u = psi((i - j).clamp(min=0)) / (psi(torch.maximum(i, L)) + 1e-6)  # (T, T)
    expected = m.mlp(u.unsqueeze(-1)).permute(2, 0, 1).detach()  # (H, T, T): the paper's MLP
    mask = causal(50)
    assert_matches_reference(dense(m, q, torch.arange(50))[0][:, mask], expected[:, mask], method="fire",
                             reference="paper formula f(psi(i-j) / psi(max(L, i)))")


# ----------------------------------------------------------------------------------- rope family


def test_rope_partial_rotary_factor_matches_gpt_neox():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    D, R = 16, 8
    m = make("rope", d_model=2 * D, n_heads=2, partial_rotary_factor=0.5)
    assert m.inv_freq.shape == (R // 2,)
    q, k = qk(H=2, T=30, D=D)
    pos = torch.arange(30)
    theta = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)  # GPT-NeoX: base^(-2i/R)
    ang = pos.double()[:, None] * theta
    emb = torch.cat((ang, ang), -1)
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :R], k[..., :R], emb.cos()[None], emb.sin()[None])
    q_out, k_out = m.rotate_qk(q, k, pos)
    for out, rot, x in ((q_out, q_rot, q), (k_out, k_rot, k)):
        assert_matches_reference(out, torch.cat((rot, x[..., R:]), -1), method="rope",
                                 reference="partial_rotary_factor: GPT-NeoX via transformers apply_rotary_pos_emb",
                                 atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        make("rope", d_model=2 * D, n_heads=2, partial_rotary_factor=0.1)


@pytest.mark.parametrize("library", ["rotary_embedding_torch", "x_transformers"])
def test_xpos_matches_reference_library(library):
    D, T = 16, 40
    m = make("xpos", d_model=2 * D, n_heads=2, interleaved=True)  # both libraries pair (2i, 2i+1)
    q, k = qk(H=2, T=T, D=D, dtype=torch.float32)
    if library == "rotary_embedding_torch":
        from rotary_embedding_torch import RotaryEmbedding

        ref = RotaryEmbedding(dim=D, use_xpos=True, xpos_scale_base=512)
        q_ref, k_ref = ref.rotate_queries_and_keys(q, k)
    else:
        from x_transformers.x_transformers import RotaryEmbedding, apply_rotary_pos_emb

        ref = RotaryEmbedding(D, use_xpos=True, scale_base=512)
        freqs, scale = ref(torch.arange(T))
        q_ref, k_ref = apply_rotary_pos_emb(q, freqs, scale), apply_rotary_pos_emb(k, freqs, scale**-1)
    q_out, k_out = build_method("xpos", ModelDims(2 * D, 2, 2), interleaved=True).rotate_qk(q, k, torch.arange(T))
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        assert_matches_reference(out, ref, method="xpos", reference=library.replace("_", "-"), atol=1e-5, rtol=1e-5)
    assert m.inv_freq.shape == (D // 2,)


def test_xpos_scores_decay_and_stay_relative():
    m = make("xpos", d_model=64, n_heads=4)
    q, k = qk(H=4, T=64, D=16, dtype=torch.float32)
    s0, s1 = full_scores(m, q, k, torch.arange(64)), full_scores(m, q, k, torch.arange(64) + 700)
    mask = causal(64)
    torch.testing.assert_close(s1[..., mask], s0[..., mask], atol=2e-3, rtol=0)
    ones = torch.ones(1, 1, 1, 16)
    far = lambda d: float((m.rotate_qk(ones, ones, torch.tensor([d]))[0] * m.rotate_qk(ones, ones, torch.tensor([0]))[1]).sum())  # noqa: E731
    assert far(0) == pytest.approx(16.0, rel=1e-5)  # no scale at distance 0


@pytest.mark.parametrize("p", [0.0, 0.5, 0.75, 1.0])
def test_p_rope_rotates_only_the_highest_frequencies(p):
    D = 16
    m = make("p_rope", d_model=4 * D, n_heads=4, p=p)
    kept = round(p * D / 2)
    theta = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    theta[kept:] = 0.0  # the paper: drop the lowest frequencies
    torch.testing.assert_close(m.inv_freq.double(), theta, atol=1e-7, rtol=1e-6)
    q, k = qk(H=4, T=30, D=D, dtype=torch.float32)
    pos = torch.arange(30) * 13
    q_out, _ = m.rotate_qk(q, k, pos)
    ang = pos.double()[:, None] * theta
    emb = torch.cat((ang, ang), -1)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q_ref, _ = apply_rotary_pos_emb(q.double(), k.double(), emb.cos()[None], emb.sin()[None])
    assert_matches_reference(q_out.double(), q_ref, method="p_rope",
                             reference="transformers apply_rotary_pos_emb, lowest frequencies zeroed (fp64)", atol=1e-4, rtol=0)
    if p == 1.0:
        torch.testing.assert_close(q_out, make("rope", d_model=4 * D, n_heads=4).float().rotate_qk(q, k, pos)[0])


# ------------------------------------------------------------------------------------------ cope


def test_cope_matches_x_transformers():
    from x_transformers.x_transformers import CoPE as XCoPE

    B, H, T, D, npos = 2, 4, 30, 8, 10
    m = make("cope", d_model=H * D, n_heads=H, npos_max=npos)
    ref = XCoPE(dim=D, heads=H, max_pos=npos).double()
    with torch.no_grad():
        ref.pos_emb.copy_(m.tables[1])
    q, k = qk(B=B, H=H, T=T, D=D)
    logits = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D)
    logits = logits.masked_fill(~causal(T), float("-inf"))  # the paper adds mask.log() first
    expected = ref(q, logits)
    ours = dense(m, q, torch.arange(T), layer=1, k=k)
    mask = causal(T)
    assert_matches_reference(ours[..., mask], expected[..., mask], method="cope", reference="x-transformers CoPE",
                             atol=1e-5, rtol=1e-5)  # ours in fp32
    with pytest.raises(ValueError, match="keys k"):
        m.score_term(q, torch.arange(T), 0)


# ------------------------------------------------------------------------------------------- fox


def test_fox_matches_paper_formula():
    B, H, T, dm = 2, 4, 20, 32
    m = make("fox", d_model=dm, n_heads=H)
    q, _ = qk(B=B, H=H, T=T)
    x = layer_input(q, dm)
    gate = m.gates[1]
    log_f = torch.nn.functional.logsigmoid(x @ gate.weight.T + gate.bias).detach()  # (B, T, H)
    expected = torch.zeros(B, H, T, T, dtype=torch.float64)
    for i in range(T):
        for j in range(i + 1):
            expected[:, :, i, j] = log_f[:, j + 1 : i + 1].sum(1)  # sum_{l=j+1..i} log f_l
    ours = dense_score(m.score_term(q, torch.arange(T), 1, x=x), B, H, T, q.device)
    mask = causal(T)
    assert_matches_reference(ours[..., mask].double(), expected[..., mask], method="fox",
                             reference="paper: sum_{l=j+1..i} log f_l, explicit loop", atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------- abs_attention


def test_abs_attention_adds_q_dot_r_of_the_key_position():
    m = make("abs_attention", d_model=32, n_heads=4)
    q, k = qk(B=2, H=4, T=20, D=8)
    pos = torch.arange(20) + 5
    R = m.tables[1].detach()
    expected = (torch.einsum("bhid,bhjd->bhij", q, k) + torch.einsum("bhid,jd->bhij", q, R[pos])) / math.sqrt(8)
    assert_matches_reference(full_scores(m, q, k, pos, layer=1), expected, method="abs_attention",
                             reference="formula (q.k + q.R_j) / sqrt(d)")
    with pytest.raises(PosbenchError, match="max_positions"):
        m.rotate_qk(q, k, torch.arange(20) + 4090)


# ------------------------------------------------------------------------- relative's value term


def test_relative_value_term_matches_shaw_equation_3():
    B, H, T, D, kmax = 1, 2, 12, 4, 3
    m = make("relative", d_model=H * D, n_heads=H, max_distance=kmax)
    q, k = qk(B=B, H=H, T=T, D=D)
    v = torch.randn(B, H, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    pos = torch.arange(T)
    out = attend(q, k, v, m.score_term(q, pos, 0), "eager", value=m.value_term(pos, 0)).double()
    aK, aV = m.tables[0].detach(), m.value_tables[0].detach()
    expected = torch.zeros(B, H, T, D, dtype=torch.float64)
    for i in range(T):
        e = torch.stack([(q[:, :, i] * (k[:, :, j] + aK[min(i - j, kmax)])).sum(-1) / math.sqrt(D) for j in range(i + 1)], -1)
        p = e.softmax(-1)  # (B, H, i+1)
        expected[:, :, i] = sum(p[..., j, None] * (v[:, :, j] + aV[min(i - j, kmax)]) for j in range(i + 1))
    assert_matches_reference(out, expected, method="relative", reference="Shaw et al. eqs. 3-4 (value and key terms), explicit loop",
                             atol=1e-5, rtol=1e-5)


def test_relative_value_term_is_eager_only_and_optional():
    m = make("relative")
    assert resolve_backend("auto", m, CPU) == "eager" and resolve_backend("auto", m, CUDA) == "eager"
    with pytest.raises(PosbenchError, match="model.attention=sdpa cannot run method=relative.*value_term=false"):
        resolve_backend("sdpa", m, CPU)
    key_only = make("relative", value_term=False)
    assert key_only.value_term(torch.arange(4), 0) is None and not hasattr(key_only.value_tables, "__len__")
    assert resolve_backend("auto", key_only, CPU) == "sdpa"


# ---------------------------------------------------------------------------- backends and window


def test_cope_refuses_flex_in_one_line_and_auto_avoids_it():
    m = make("cope")
    with pytest.raises(PosbenchError, match="model.attention=flex cannot run method=cope: .*dense"):
        resolve_backend("flex", m, CUDA)
    assert resolve_backend("auto", m, CUDA) == "sdpa"


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("case", ["none", "alibi"])
def test_window_matches_naive_masked_loop(backend, case):
    from tests.test_attention import case_score, qkv

    T, W = 30, 7
    q, k, v = qkv(T=T, dtype=torch.float64)
    score = case_score(case, q, torch.arange(T))
    out = attend(q, k, v, score, backend, window=W).double()
    full = score is None or dense_score(score, 2, 4, T, q.device)
    for i in range(T):
        j = torch.arange(max(0, i - W + 1), i + 1)
        logits = torch.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, j]) / 4.0
        if score is not None:
            logits = logits + full[:, :, i, j].double()
        ref = torch.einsum("bhj,bhjd->bhd", logits.softmax(-1), v[:, :, j])
        assert_matches_reference(out[:, :, i], ref, method="window (model.attention_window)",
                                 reference=f"naive masked loop, {backend}, {case}", atol=1e-5, rtol=1e-5)


def test_window_combines_with_any_method_in_the_model():
    W = 5
    for name in ("rope", "kerple", "fox"):
        torch.manual_seed(0)
        model = posbench.create_model(name, flavour="tiny", vocab_size=64, attention_window=W).eval()
        a = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
        b = a.clone()
        b[0, 10] = (a[0, 10] + 1) % 64
        with torch.no_grad():
            la, lb = model(a), model(b)
        # 2 layers: token 10 reaches at most 2 * (W - 1) positions further (fox: up to the
        # rounding of its cumulative-sum difference, which includes token 10's gate).
        torch.testing.assert_close(la[0, 10 + 2 * (W - 1) + 1 :], lb[0, 10 + 2 * (W - 1) + 1 :], atol=1e-5, rtol=0)
        assert not torch.allclose(la[0, 10:12], lb[0, 10:12])
    assert resolve_backend("auto", make("rope"), CUDA, window=W) in ("flex", "sdpa")
    with pytest.raises(PosbenchError, match="attention_window"):
        posbench.create_model("rope", flavour="tiny", attention_window=0)


# ----------------------------------------------------------------- all methods: grads, init, positions


@pytest.mark.parametrize("name", ALL_METHODS)
def test_every_learnable_parameter_gets_a_gradient_on_the_default_cpu_backend(name):
    torch.manual_seed(0)
    model = posbench.create_model(name, flavour="tiny", vocab_size=64)
    idx = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name}: {pname} gets no gradient"


@pytest.mark.parametrize("name", ALL_METHODS)
def test_same_seed_same_body_for_every_method(name):
    """Issue 8: token embedding, blocks and LM head are bitwise identical across methods."""

    def body(method):
        torch.manual_seed(123)
        model = posbench.create_model(method, flavour="tiny", vocab_size=64)
        return {k: v for k, v in model.state_dict().items() if not k.startswith("position.")}

    reference, ours = body("nope"), body(name)
    assert reference.keys() == ours.keys()
    for key, value in reference.items():
        assert torch.equal(ours[key], value), f"{name}: {key} differs from nope's at the same seed"


def test_method_parameters_still_depend_on_the_seed():
    def table(seed):
        torch.manual_seed(seed)
        return posbench.create_model("t5", flavour="tiny", vocab_size=64).position.bias.weight

    assert torch.equal(table(1), table(1)) and not torch.equal(table(1), table(2))


def test_draw_positions_is_a_seeded_sorted_subset():
    a = draw_positions(seed=0, step=7, batch=3, length=16, randomize_max=100)
    assert a.shape == (3, 16) and a.dtype == torch.int64
    assert (a[:, 1:] > a[:, :-1]).all() and int(a.min()) >= 0 and int(a.max()) < 100
    assert torch.equal(a, draw_positions(0, 7, 3, 16, 100))  # resume repeats the draw
    assert not torch.equal(a, draw_positions(0, 8, 3, 16, 100))
    assert not torch.equal(a, draw_positions(1, 7, 3, 16, 100))
    assert not torch.equal(a, draw_positions(0, 7, 3, 16, 100, rank=1))
    assert not torch.equal(a[0], a[1])  # per sequence
    assert torch.equal(draw_positions(0, 1, 2, 16, 16), torch.arange(16).expand(2, 16))


def test_randomize_max_config_checks():
    cfg = lambda m: OmegaConf.create({"positions": {"randomize_max": m}})  # noqa: E731
    assert randomize_max_from_config(cfg(None), "rope", 32, None) is None
    assert randomize_max_from_config(cfg(256), "learned", 32, 4096) == 256
    for bad, match in ((16, ">= trainer.context"), (True, ">= trainer.context")):
        with pytest.raises(PosbenchError, match=match):
            randomize_max_from_config(cfg(bad), "rope", 32, None)
    with pytest.raises(PosbenchError, match="reads no position ids"):
        randomize_max_from_config(cfg(256), "fox", 32, None)
    with pytest.raises(PosbenchError, match="max_positions"):
        randomize_max_from_config(cfg(8192), "learned", 32, 4096)
    assert method_label("rope", None) == "rope" and method_label("rope", 2048) == "rope+rand2048"


@pytest.mark.parametrize("name", [n for n in ALL_METHODS if build_method(n, ModelDims(32, 4, 2)).uses_positions])
def test_per_sequence_positions_equal_per_row_forward(name):
    """(B, T) positions: each row is computed as if its positions were given alone."""
    torch.manual_seed(0)
    model = posbench.create_model(name, flavour="tiny", vocab_size=64, attention="eager").eval()
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = draw_positions(0, 0, 2, 12, 200)
    with torch.no_grad():
        both = model(idx, pos)
        rows = [model(idx[r : r + 1], pos[r]) for r in range(2)]
        plain = model(idx)
    torch.testing.assert_close(both, torch.cat(rows), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(both, plain, atol=1e-4)  # the positions do matter


# ----------------------------------------------------------------------- flex gradients (CUDA only)

LEARNABLE_SCORE_METHODS = [("kerple", {}), ("fire", {}), ("fox", {}), ("t5", {}), ("relative", {"value_term": False})]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
@pytest.mark.parametrize("name,options", LEARNABLE_SCORE_METHODS)
def test_flex_gradients_reach_method_parameters(name, options):
    grads = {}
    for backend in ("eager", "flex"):
        torch.manual_seed(0)
        model = posbench.create_model(name, flavour="tiny", vocab_size=64, attention=backend,
                                      method_options=options).cuda()
        idx = torch.randint(0, 64, (2, 130), generator=torch.Generator().manual_seed(0)).cuda()
        nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters() if n.startswith("position.")}
    for pname, g in grads["eager"].items():
        flex = grads["flex"][pname]
        assert flex is not None and flex.abs().sum() > 0, pname
        torch.testing.assert_close(flex, g, atol=1e-4, rtol=1e-3, msg=pname)
