"""DAPE (Zheng et al. 2024) against its formula written out here, as in the reference code
(chuanyang-Zheng/DAPE ``DAPE.py``): logit_ij = A_ij + B_ij + MLP([A_ij (H heads), B_ij (H heads)])
with MLP = Linear(2H, 32) -> LeakyReLU -> Linear(32, H), one per layer, before the causal mask."""

from __future__ import annotations

import math

import pytest
import torch
from model_checks import (
    alibi_bias,
    assert_matches_reference,
    causal,
    check_causal_and_trained,
    full_scores,
    make_method,
    qk,
)

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods import method_class, method_options
from posbench.model.attention import resolve_backend
from posbench.model.transformer import attention_backends

C = 16  # a nominal training context; the checks run at 4 C
H, D = 4, 8


def kerple_bias(m, T, layer):
    """Chi et al., log variant: -r1 log(1 + r2 (i - j)) with the method's own r1, r2."""
    r1, r2 = m.inner.r1[layer].detach().view(-1, 1, 1), m.inner.r2[layer].detach().view(-1, 1, 1)
    d = (torch.arange(T).view(-1, 1) - torch.arange(T).view(1, -1)).clamp(min=0).double()
    return -r1 * torch.log1p(r2 * d)


def reference_logits(m, q, k, bias, layer):
    """A + B + MLP([A, B]) by an explicit loop over (i, j), the MLP written with its weights."""
    B_, H_, T, D_ = q.shape
    lin1, lin2 = m.mlps[layer][0], m.mlps[layer][2]
    A = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(D_)
    out = torch.empty_like(A)
    for i in range(T):
        for j in range(T):
            feat = torch.cat([A[:, :, i, j], bias[:, i, j].expand(B_, H_)], dim=-1)  # (B, 2H)
            hidden = feat @ lin1.weight.T.detach() + lin1.bias.detach()
            hidden = torch.where(hidden > 0, hidden, 0.01 * hidden)  # LeakyReLU
            out[:, :, i, j] = A[:, :, i, j] + bias[:, i, j] + hidden @ lin2.weight.T.detach()
    return out


@pytest.mark.parametrize("base", ["alibi", "kerple"])
@pytest.mark.parametrize("layer", [0, 1])
def test_dape_matches_the_paper_formula_at_4C(base, layer):
    T = 4 * C
    m = make_method("dape", d_model=H * D, n_heads=H, randomise=False, base=base)
    q, k = qk(B=2, H=H, T=T, D=D)
    ours = full_scores(m, q, k, torch.arange(T), layer)
    bias = alibi_bias(T, H) if base == "alibi" else kerple_bias(m, T, layer)
    expected = reference_logits(m, q, k, bias, layer)
    mask = causal(T)
    assert_matches_reference(ours[..., mask], expected[..., mask], method=f"dape (base={base})",
                             reference="reference formula (loop over i, j), T = 4C = 64", atol=1e-10, rtol=1e-10)
    static = (q @ k.transpose(-1, -2)) / math.sqrt(D) + bias
    assert not torch.allclose(ours[..., mask], static[..., mask], atol=1e-3)  # the MLP adds something


def test_dape_defaults_are_the_references():
    assert method_options("dape") == {"base": "alibi", "mlp_width": 32}
    m = make_method("dape", d_model=H * D, n_heads=H, randomise=False)
    assert type(m.inner).name == "alibi" and len(m.mlps) == 2
    first, act, last = m.mlps[0]
    assert (first.in_features, first.out_features, last.out_features) == (2 * H, 32, H)
    assert isinstance(act, torch.nn.LeakyReLU) and act.negative_slope == 0.01
    assert last.bias is None  # a per-head constant on a whole row: the softmax cannot see it


@pytest.mark.parametrize("base", ["alibi", "kerple", "fire"])
def test_dape_model_is_causal_at_4C_and_every_parameter_trains(base):
    names = check_causal_and_trained("dape", {"base": base}, T=4 * C, t=2 * C + 3)
    assert {"mlps.0.0.weight", "mlps.1.2.weight"} <= names
    assert base == "alibi" or any(n.startswith("inner.") for n in names)  # the base's own parameters


@pytest.mark.parametrize("base,relative", [("alibi", True), ("kerple", True), ("fire", False)])
def test_dape_is_shift_invariant_exactly_where_its_base_is(base, relative):
    """relative_scores is not declared by the class (it depends on the base); the bases decide."""
    assert not method_class("dape").relative_scores
    assert method_class(base).relative_scores == relative
    T = 4 * C
    m = make_method("dape", d_model=H * D, n_heads=H, base=base)
    q, k = qk(B=1, H=H, T=T, D=D)
    mask = causal(T)
    s0 = full_scores(m, q, k, torch.arange(T))[..., mask]
    s1 = full_scores(m, q, k, torch.arange(T) + 100)[..., mask]
    assert torch.allclose(s0, s1, atol=1e-9) == relative


def test_dape_backends_and_base_errors():
    m = make_method("dape")
    with pytest.raises(PosbenchError, match="model.attention=flex cannot run method=dape: .*dense"):
        resolve_backend("flex", m, torch.device("cuda"))
    with pytest.raises(PosbenchError, match="model.attention=sdpa cannot run method=dape: SDPA rounds"):
        resolve_backend("sdpa", m, torch.device("cuda"))
    assert resolve_backend("auto", m, torch.device("cuda")) == "eager"
    assert resolve_backend("auto", m, torch.device("cpu")) == "eager"
    with pytest.raises(PosbenchError, match="method.base='nosuch' is not a position method"):
        make_method("dape", base="nosuch")
    with pytest.raises(ValueError, match="not dape itself"):
        make_method("dape", base="dape")
    with pytest.raises(ValueError, match="mlp_width >= 1"):
        make_method("dape", mlp_width=0)


def test_dape_over_a_base_without_a_bias_sees_the_logits_alone():
    """base=rope (the reference's rope_dapev1): B = 0, q and k rotated by the base."""
    T = 2 * C
    m = make_method("dape", d_model=H * D, n_heads=H, randomise=False, base="rope")
    q, k = qk(B=1, H=H, T=T, D=D)
    qr, kr = m.inner.rotate_qk(q, k, torch.arange(T))
    expected = reference_logits(m, qr, kr, torch.zeros(H, T, T, dtype=torch.float64), 0)
    mask = causal(T)
    torch.testing.assert_close(full_scores(m, q, k, torch.arange(T))[..., mask], expected[..., mask])


def test_dape_under_bf16_autocast_stays_within_bf16_error_past_the_context(monkeypatch):
    """auto runs dape in eager, whose logits and term stay fp32: under bf16 autocast the model's
    logits at T=520 are < 1 % off fp32. Let through to SDPA (which takes the term in q's dtype),
    the same model is > 2 % off: the reason dape refuses sdpa (2.56 % on an H100 too)."""
    torch.manual_seed(0)
    net = posbench.create_model("dape", flavour="tiny", vocab_size=512).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-default values everywhere, as the CUDA twin test perturbs them
        for name, p in net.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            elif name.startswith("position."):
                p.copy_(0.5 * noise)
            else:
                p.add_(2 * (p.std() if p.numel() > 1 else p.abs()) * noise)
    idx = torch.randint(0, 512, (1, 520), generator=torch.Generator().manual_seed(1))

    def error() -> float:
        with torch.no_grad():
            ref = net(idx)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = net(idx)
        return float((out.float() - ref).norm() / ref.norm())

    assert attention_backends(net.cfg, net.position, torch.device("cpu")) == "eager"
    assert error() < 1e-2
    limits = type(net.position).backend_limits
    monkeypatch.setattr(type(net.position), "backend_limits",
                        lambda self: {k: v for k, v in limits(self).items() if k != "sdpa"})
    assert attention_backends(net.cfg, net.position, torch.device("cpu")) == "sdpa"
    assert error() > 2e-2
