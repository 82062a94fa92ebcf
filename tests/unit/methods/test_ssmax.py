"""SSMax (Nakanishi 2025) against its formula written out here: the whole logit of query i (q.k /
sqrt(D) plus the base method's bias) multiplied by s_lh log(n_i), n_i = i + 1 visible keys."""

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
    ids,
    make_method,
    qk,
    small_model,
)
from torch import nn

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods import method_class, method_options
from posbench.model.attention import FLEX_AVAILABLE, attend, resolve_backend
from posbench.model.extension import extended, resolve_extensions

C = 16  # a nominal training context; the checks run at 4 C
H, D = 4, 8


def reference_logits(s, q, k, bias):
    """s_h log(i + 1) (q_i . k_j / sqrt(D) + B_ij), a loop over (i, j)."""
    B_, H_, T, D_ = q.shape
    out = torch.empty(B_, H_, T, T, dtype=torch.float64)
    for i in range(T):
        for j in range(T):
            logit = (q[:, :, i] * k[:, :, j]).sum(-1) / math.sqrt(D_) + bias[:, i, j]
            out[:, :, i, j] = s * math.log(i + 1) * logit
    return out


@pytest.mark.parametrize("base", ["nope", "alibi"])
@pytest.mark.parametrize("layer", [0, 1])
def test_ssmax_matches_the_paper_formula_at_4C(base, layer):
    T = 4 * C
    m = make_method("ssmax", d_model=H * D, n_heads=H, base=base)  # s drawn in [0.2, 1.2] per layer, head
    q, k = qk(B=2, H=H, T=T, D=D)
    ours = full_scores(m, q, k, torch.arange(T), layer)
    bias = alibi_bias(T, H) if base == "alibi" else torch.zeros(H, T, T, dtype=torch.float64)
    expected = reference_logits(m.s[layer].detach(), q, k, bias)
    mask = causal(T)
    assert_matches_reference(ours[..., mask], expected[..., mask], method=f"ssmax (base={base})",
                             reference="paper formula (loop over i, j), T = 4C = 64", atol=1e-10, rtol=1e-10)


def test_ssmax_over_rope_scales_the_rotated_logits():
    T = 4 * C
    m = make_method("ssmax", d_model=H * D, n_heads=H)  # base rope: no score term, q scaled only
    assert not m.has_score_term
    q, k = qk(B=1, H=H, T=T, D=D)
    qr, kr = m.inner.rotate_qk(q, k, torch.arange(T))
    expected = reference_logits(m.s[0].detach(), qr, kr, torch.zeros(H, T, T, dtype=torch.float64))
    mask = causal(T)
    torch.testing.assert_close(full_scores(m, q, k, torch.arange(T))[..., mask], expected[..., mask])


def test_a_base_term_that_reads_q_is_scaled_once():
    """relative's q . a^K reads q: it must see the base's q, then be scaled once with the rest."""
    T = 2 * C
    m = make_method("ssmax", d_model=H * D, n_heads=H, base="relative")
    q, k = qk(B=1, H=H, T=T, D=D)
    pos = torch.arange(T)
    inner = full_scores(m.inner, q, k, pos)  # the base's own logits, term included
    factor = m.s[0].detach().view(-1, 1, 1) * torch.arange(1, T + 1, dtype=torch.float64).log().view(-1, 1)
    mask = causal(T)
    torch.testing.assert_close(full_scores(m, q, k, pos)[..., mask], (factor * inner)[..., mask])


def test_ssmax_defaults_and_traits():
    assert method_options("ssmax") == {"base": "rope", "s_init": 0.168}
    m = make_method("ssmax", d_model=H * D, n_heads=H, randomise=False)
    assert m.s.shape == (2, H) and torch.all(m.s.float() == torch.tensor(0.168))
    cls = method_class("ssmax")
    assert not cls.relative_scores  # the factor follows the sequence index, whatever the base
    assert not cls.has_score_term and make_method("ssmax", base="alibi").has_score_term  # the base's
    with pytest.raises(ValueError, match="not ssmax itself"):
        make_method("ssmax", base="ssmax")
    with pytest.raises(PosbenchError, match="method.base='nosuch' is not a position method"):
        make_method("ssmax", base="nosuch")


@pytest.mark.parametrize("base", ["rope", "alibi", "kerple"])
def test_ssmax_model_is_causal_at_4C_and_every_parameter_trains(base):
    names = check_causal_and_trained("ssmax", {"base": base}, T=4 * C, t=2 * C + 3)
    assert "s" in names and (base != "kerple" or {"inner.r1", "inner.r2"} <= names)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_ssmax_attention_matches_a_softmax_loop(backend):
    """The scaled logits through attend(): every row i is softmax(s log(i + 1) (q.k / sqrt(D) + B))."""
    T = 4 * C
    m = make_method("ssmax", d_model=H * D, n_heads=H, base="alibi")
    q, k = qk(B=1, H=H, T=T, D=D)
    v, _ = qk(B=1, H=H, T=T, D=D, seed=1)
    qs, ks = m.rotate_qk(q, k, torch.arange(T))
    out = attend(qs, ks, v, m.score_term(qs, torch.arange(T), 0, k=ks), backend)
    logits = reference_logits(m.s[0].detach(), q, k, alibi_bias(T, H)).masked_fill(~causal(T), float("-inf"))
    torch.testing.assert_close(out, logits.softmax(-1) @ v, atol=1e-6, rtol=1e-6)


def test_extensions_over_ssmax():
    """Decided: the rotary extensions do not apply (the wrapper is not Rotary, even over rope);
    log_scaling and window apply to it as to every method, and wrap it."""
    model = small_model("ssmax").eval()
    with pytest.raises(PosbenchError, match="extension ntk does not apply to method=ssmax"):
        resolve_extensions(["ntk"], model.position, log=lambda _: None)
    chosen = set(resolve_extensions(["all"], model.position))
    assert {"none", "log_scaling", "window"} <= chosen and not {"linear", "ntk", "yarn", "llama3"} & chosen
    idx = ids(1, 4 * C)
    with torch.no_grad():
        plain = model(idx)
        with extended(model, "log_scaling", C, 4 * C):
            scaled = model(idx)
    assert torch.isfinite(scaled).all() and not torch.allclose(plain, scaled)
    torch.testing.assert_close(scaled[:, :C], plain[:, :C])  # log_scaling is the identity up to C


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and FLEX_AVAILABLE), reason="FlexAttention's backward needs CUDA")
@pytest.mark.parametrize("base", ["rope", "alibi", "fox"])  # kerple keeps out of flex (test_methods_score)
def test_ssmax_flex_matches_eager_with_gradients(base):
    """flex gets q scaled (q.k) and the base's term scaled in its score_mod."""
    out, grads = {}, {}
    for backend in ("eager", "flex"):
        model = small_model("ssmax", {"base": base}, attention=backend).cuda()
        idx = ids(2, 130).cuda()
        logits = model(idx)
        nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
        out[backend] = logits.detach()
        grads[backend] = {n: p.grad for n, p in model.position.named_parameters()}
    torch.testing.assert_close(out["flex"], out["eager"], atol=1e-4, rtol=1e-3)
    for name, g in grads["eager"].items():
        assert grads["flex"][name] is not None and grads["flex"][name].abs().sum() > 0, name
        torch.testing.assert_close(grads["flex"][name], g, atol=1e-4, rtol=1e-3, msg=name)


def test_ssmax_runs_on_flex_where_its_base_does():
    cuda = torch.device("cuda")
    assert resolve_backend("auto", make_method("ssmax", base="alibi"), cuda) == ("flex" if FLEX_AVAILABLE else "sdpa")
    with pytest.raises(PosbenchError, match="model.attention=flex cannot run method=ssmax"):
        resolve_backend("flex", make_method("ssmax", base="cope"), cuda)
    assert posbench.create_model("ssmax", flavour="tiny", method_options={"base": "cope"}).position.backend_limits()


@pytest.mark.parametrize("wrapper", ["ssmax", "dape"])
def test_wrappers_keep_their_base_windows_and_normaliser(wrapper):
    """ssmax and dape over swan kept none of swan's windows, and over stickbreaking ran the
    softmax instead of the stick-breaking normaliser (the hooks were not delegated)."""
    from posbench.methods import ModelDims, build_method
    from posbench.model.transformer import ModelConfig, build_model, layer_windows

    dims = ModelDims(32, H, 4)
    wrapped = build_method(wrapper, dims, base="swan")  # the base with its defaults: W = 128
    assert [wrapped.attention_window(l) for l in range(4)] == [None, 128, 128, 128]
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=4, n_heads=H, attention="eager")
    assert layer_windows(cfg, build_model(cfg, wrapper, {"base": "swan"}).position) == [None, 128, 128, 128]
    sb = build_method(wrapper, dims, base="stickbreaking")
    logits = torch.randn(1, H, 5, 5).masked_fill(~causal(5), float("-inf"))
    torch.testing.assert_close(sb.normalizer(0)(logits), build_method("stickbreaking", dims).normalizer(0)(logits))
