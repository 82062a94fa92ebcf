"""The score-term methods of 2022-2026 papers (kerple, sandwich, fire, cope, fox, abs_attention) and
relative's value term, against x-transformers or the paper's formula written out here."""

from __future__ import annotations

import math

import pytest
import torch
from model_checks import assert_matches_reference, causal, full_scores, layer_input, qk
from model_checks import dense_term as dense
from model_checks import make_method as make

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods import dense_score
from posbench.model.attention import attend, resolve_backend

ALL_METHODS = posbench.list_methods()
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


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


def test_fire_keeps_out_of_flex_whose_backward_cannot_train_it():
    """On an H100 the compiled flex backward failed to lower fire's MLP weights and scalars (each
    captured tensor must be indexed once): auto runs fire in sdpa on CUDA, flex is refused in one line."""
    m = make("fire")
    assert resolve_backend("auto", m, CUDA) == "sdpa" and resolve_backend("auto", m, CPU) == "sdpa"
    with pytest.raises(PosbenchError, match="model.attention=flex cannot run method=fire: FlexAttention's backward"):
        resolve_backend("flex", m, CUDA)


@pytest.mark.parametrize("name,why", [("t5", "does not compile t5's table gather"),
                                      ("kerple", "'s backward sums kerple's per-head scalars")])
def test_t5_and_kerple_keep_out_of_flex(name, why):
    """Measured on an H100 (docs/benchmarks.md): t5 in compiled flex ran out of shared memory at head
    dim 64, kerple's flex training ran at 5 % of rope; SDPA kept pace with rope for both (under
    load). auto picks SDPA on CUDA, asking for flex is one line, wrappers inherit it."""
    m = make(name)
    assert resolve_backend("auto", m, CUDA) == "sdpa" and resolve_backend("auto", m, CPU) == "sdpa"
    with pytest.raises(PosbenchError, match=f"model.attention=flex cannot run method={name}: FlexAttention ?{why}"):
        resolve_backend("flex", m, CUDA)
    assert resolve_backend("auto", make("ssmax", base=name), CUDA) == "sdpa"
    assert resolve_backend("auto", make("alibi"), CUDA) == "flex"  # score terms without such parameters stay in flex


def test_fox_and_kerple_score_functions_hold_no_tensor_that_flex_saves_and_a_later_layer_mutates():
    """On an H100 flex's backward failed for kerple (a view of r1 saved by layer 0, then clamped in
    place by layer 1's projection) and fox (one grad-requiring tensor indexed twice). The score
    functions now close over copies: the in-place projection leaves what an earlier layer captured
    at its version, and the gradients are unchanged."""
    m = make("kerple", d_model=32, n_heads=4, n_layers=2)
    q, _ = qk(B=1, H=4, T=20, D=8)
    score0 = m.score_term(q, torch.arange(20), 0)
    captured = [cell.cell_contents for cell in score0.__closure__ if isinstance(cell.cell_contents, torch.Tensor)]
    versions = [t._version for t in captured]
    m.score_term(q, torch.arange(20), 1)  # projects r1, r2 in place again
    assert [t._version for t in captured] == versions and all(t._base is None for t in captured)
    fox = make("fox", d_model=32, n_heads=4, n_layers=1)
    x = layer_input(q, d_model=32)
    fn = fox.score_term(q, torch.arange(20), 0, x=x)
    tensors = [cell.cell_contents for cell in fn.__closure__ if isinstance(cell.cell_contents, torch.Tensor)]
    assert len(tensors) == 2 and tensors[0] is not tensors[1] and torch.equal(tensors[0], tensors[1])
    assert all(t.requires_grad for t in tensors)  # a copy, not a detached one: both halves get a gradient


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


