"""PoPE (polar coordinate position embedding, arXiv 2509.10534) against its reference, x-transformers'
``PolarEmbedding`` / ``apply_polar_pos_emb``, and against the paper's score written as a loop."""

import math

import pytest
import torch
import torch.nn.functional as F
from model_checks import assert_causal_model, assert_matches_reference

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method
from posbench.methods.base import Rotary
from posbench.model.extension import extended

DIMS = ModelDims(d_model=32, n_heads=4, n_layers=2)  # head_dim 8


def pope(**options):
    return build_method("pope", DIMS, **options)


def polar_logits(method, q, k, positions):
    """Our logits as the backends compute them: q'.k' / sqrt(q'.shape[-1])."""
    qp, kp = method.rotate_qk(q, k, positions)
    return torch.einsum("bhid,bhjd->bhij", qp.double(), kp.double()) * qp.shape[-1] ** -0.5


def test_logits_match_x_transformers_polar_embedding():
    from x_transformers import x_transformers  # a dev dependency (pyproject's [dev] extra)

    torch.manual_seed(0)
    m = pope()
    with torch.no_grad():
        m.key_phase_bias.uniform_(-2 * math.pi, 0.0)
    T, D = 40, DIMS.head_dim
    q, k = torch.randn(2, 2, 4, T, D).unbind(0)
    positions = torch.arange(T)
    ref = x_transformers.PolarEmbedding(D, DIMS.n_heads)
    with torch.no_grad():
        ref.learned_bias.copy_(m.key_phase_bias[:, None, :])  # (H, 1, D)
    freqs, bias = ref(positions)
    q_ref = x_transformers.apply_polar_pos_emb(q, freqs)
    k_ref = x_transformers.apply_polar_pos_emb(k, freqs + bias)
    # x-transformers' Attention scales by dim_head ** -0.5 (D, not the 2D polar channels).
    expected = torch.einsum("bhid,bhjd->bhij", q_ref.double(), k_ref.double()) * D**-0.5
    got = polar_logits(m, q, k, positions)
    assert_matches_reference(got, expected, method="pope", reference="x-transformers PolarEmbedding logits",
                             atol=1e-5, rtol=1e-5)
    assert ref.inv_freq.shape == m.inv_freq.shape
    torch.testing.assert_close(m.inv_freq, ref.inv_freq)


def test_logits_match_the_papers_formula_loop():
    """sum_c softplus(q_c) softplus(k_c) cos((n - m) theta_c - delta_hc) / sqrt(D), theta_c = base^(-c/D)."""
    torch.manual_seed(1)
    m = pope(base=500.0)
    with torch.no_grad():
        m.key_phase_bias.uniform_(-2 * math.pi, 0.0)
    T, D, H = 12, DIMS.head_dim, DIMS.n_heads
    q, k = torch.randn(2, 1, H, T, D, dtype=torch.float64).unbind(0)
    positions = torch.arange(T) * 7 + 3  # arbitrary position ids
    got = polar_logits(m, q, k, positions)
    delta = m.key_phase_bias.detach().double()
    expected = torch.zeros(1, H, T, T, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            for j in range(T):
                total = 0.0
                for c in range(D):
                    theta = 500.0 ** (-c / D)
                    mu_q, mu_k = F.softplus(q[0, h, i, c]), F.softplus(k[0, h, j, c])
                    total += mu_q * mu_k * math.cos((int(positions[i]) - int(positions[j])) * theta - float(delta[h, c]))
                expected[0, h, i, j] = total / math.sqrt(D)
    assert_matches_reference(got, expected, method="pope", reference="paper: sum softplus softplus cos((n-m) theta - delta), loop",
                             atol=1e-5, rtol=1e-5)


def test_key_phase_bias_init_and_clamp():
    assert torch.equal(pope().key_phase_bias, torch.zeros(DIMS.n_heads, DIMS.head_dim))  # reference default
    torch.manual_seed(0)
    b = pope(bias_uniform_init=True).key_phase_bias
    assert b.min() >= -2 * math.pi and b.max() <= 0 and b.std() > 1
    # used clamped to [-2 pi, 0]: +1 acts as 0, -10 as -2 pi
    T = 9
    q, k = torch.randn(2, 1, 4, T, DIMS.head_dim).unbind(0)
    pos = torch.arange(T)
    a, b = pope(), pope()
    with torch.no_grad():
        a.key_phase_bias.fill_(1.0)
        a.key_phase_bias[0].fill_(-10.0)
        b.key_phase_bias[0].fill_(-2 * math.pi)
    torch.testing.assert_close(polar_logits(a, q, k, pos), polar_logits(b, q, k, pos))


def test_pope_is_rotary_with_2d_channels_and_extensions_change_its_phases():
    m = pope()
    assert isinstance(m, Rotary) and m.rotary_dim == 2 * DIMS.head_dim
    assert type(m).relative_scores
    model = posbench.create_model("pope", flavour="tiny", vocab_size=64).eval()
    idx = torch.randint(0, 64, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(idx)
        with extended(model, "linear", 32, 96):
            interpolated = model(idx)
    assert not torch.allclose(plain, interpolated)


def test_causal_at_four_times_the_context_and_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = posbench.create_model("pope", flavour="tiny", vocab_size=64)
    assert_causal_model(model, 4 * 256, 700)
    idx = torch.randint(0, 64, (1, 129), generator=torch.Generator().manual_seed(0))
    model.zero_grad()
    F.cross_entropy(model(idx[:, :128]).flatten(0, 1), idx[:, 1:129].flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.position.key_phase_bias.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_cuda_backends_give_the_eager_gradients(backend):
    """PoPE has no score term: on CUDA auto runs it in SDPA (q'.k' with 2D channels, v with D); flex too."""
    grads = {}
    for name in ("eager", backend):
        torch.manual_seed(0)
        model = posbench.create_model("pope", flavour="tiny", vocab_size=64, attention=name).cuda()
        with torch.no_grad():
            model.position.key_phase_bias.uniform_(-2 * math.pi, 0.0)
        idx = torch.randint(0, 64, (2, 130), generator=torch.Generator().manual_seed(0)).cuda()
        F.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten()).backward()
        grads[name] = model.position.key_phase_bias.grad
    assert grads[backend].abs().sum() > 0
    torch.testing.assert_close(grads[backend], grads["eager"], atol=1e-4, rtol=1e-3)


def test_bad_base_rejected():
    with pytest.raises(PosbenchError, match="base"):
        posbench.create_model("pope", flavour="tiny", vocab_size=64, method_options={"base": 1.0})
