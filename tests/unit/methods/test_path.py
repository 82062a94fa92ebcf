"""PaTH (Yang et al. 2025) against its formula written out here: logits q_i^T H_i ... H_{j+1} k_j
with H_t = I - beta_t w_t w_t^T, w and beta computed from the layer input as the reference layer
(fla-org/flash-linear-attention ``fla/layers/path_attn.py``) does."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from model_checks import (
    assert_matches_reference,
    causal,
    check_causal_and_trained,
    full_scores,
    layer_input,
    make_method,
    qk,
)

from posbench.core.errors import PosbenchError
from posbench.methods import method_class
from posbench.methods.path import CHUNK, householder_logits
from posbench.model.attention import resolve_backend

C = 40  # a nominal training context; 4 C = 160 spans three chunks of 64, the last one padded
H, D = 4, 8


def reference_transforms(m, x, layer):
    """w (B, H, T, D) and beta (B, H, T) from the layer input, written out: low-rank projection,
    causal depthwise convolution over the last 3 tokens (zeros before the start), SiLU, L2 norm per
    head; beta = 2 sigmoid(W x + b)."""
    B, T, _ = x.shape
    down, up = m.w_proj[layer][0].weight, m.w_proj[layer][1].weight
    lin = x @ down.T @ up.T  # (B, T, H * D)
    kernel = m.w_conv[layer].weight[:, 0, :]  # (H * D, 3): kernel[:, 2] weighs the current token
    conv = torch.zeros_like(lin)
    for t in range(T):
        for s in range(3):
            if t - 2 + s >= 0:
                conv[:, t] += kernel[:, s] * lin[:, t - 2 + s]
    w = conv * torch.sigmoid(conv)
    w = w.view(B, T, H, D).transpose(1, 2)
    w = w / w.norm(dim=-1, keepdim=True)
    proj = m.beta_proj[layer]
    beta = 2 * torch.sigmoid(x @ proj.weight.T + proj.bias)  # (B, T, H)
    return w, beta.transpose(1, 2)


def reference_logits(q, k, w, beta):
    """A_ij = q_i^T H_i ... H_{j+1} k_j / sqrt(D): for each key j, carry k_j forward through
    H_{j+1}, H_{j+2}, ... and read A_ij off at t = i (a loop over j and t, i = t)."""
    B, H_, T, D_ = q.shape
    A = torch.full((B, H_, T, T), float("nan"), dtype=q.dtype)
    for j in range(T):
        v = k[:, :, j]  # (B, H, D)
        A[:, :, j, j] = (q[:, :, j] * v).sum(-1)
        for t in range(j + 1, T):
            v = v - beta[:, :, t, None] * (v * w[:, :, t]).sum(-1, keepdim=True) * w[:, :, t]
            A[:, :, t, j] = (q[:, :, t] * v).sum(-1)
    return A / math.sqrt(D_)


@pytest.mark.parametrize("layer", [0, 1])
def test_path_matches_the_paper_formula_at_4C(layer):
    T = 4 * C
    m = make_method("path", d_model=H * D, n_heads=H, randomise=False)
    with torch.no_grad():  # away from the init (beta near 1): betas spread over (0, 2)
        for p in m.parameters():
            p.normal_(std=0.5, generator=torch.Generator().manual_seed(p.numel()))
    q, k = qk(B=2, H=H, T=T, D=D)
    ours = full_scores(m, q, k, torch.arange(T), layer)  # q.k / sqrt(D) + the score term
    with torch.no_grad():
        w, beta = reference_transforms(m, layer_input(q, H * D), layer)
        expected = reference_logits(q, k, w, beta)
    mask = causal(T)
    assert_matches_reference(ours[..., mask], expected[..., mask], method="path",
                             reference="paper formula (loop over j, t), T = 4C = 160", atol=1e-9, rtol=1e-9)
    assert not torch.allclose(ours[..., mask], (q @ k.transpose(-1, -2))[..., mask] / math.sqrt(D))


@pytest.mark.parametrize("T", [1, 5, CHUNK, CHUNK + 1, 2 * CHUNK + 7])
def test_householder_logits_do_not_depend_on_the_chunking(T):
    """Chunk boundaries and padding leave the logits unchanged (up to rounding)."""
    q, k = qk(B=1, H=2, T=T, D=4, seed=T)
    w = F.normalize(torch.randn(1, 2, T, 4, dtype=torch.float64), dim=-1)
    beta = 2 * torch.rand(1, 2, T, dtype=torch.float64)
    mask = causal(T)
    whole = householder_logits(q, k, w, beta, chunk=T)[..., mask]
    for chunk in (1, 3, 16):
        torch.testing.assert_close(householder_logits(q, k, w, beta, chunk=chunk)[..., mask], whole,
                                   atol=1e-12, rtol=1e-12)


def test_beta_zero_is_plain_attention_and_beta_two_a_reflection():
    """beta = 0: every H_t = I (plain q.k); beta = 2 with one w for every token: H_t is the
    reflection R, and R^2 = I, so A_ij = q_i^T R^(i-j) k_j alternates."""
    T = 9
    q, k = qk(B=1, H=1, T=T, D=4)
    w = F.normalize(torch.randn(4, dtype=torch.float64), dim=0).expand(1, 1, T, 4)
    plain = q @ k.transpose(-1, -2)
    mask = causal(T)
    torch.testing.assert_close(householder_logits(q, k, w, torch.zeros(1, 1, T, dtype=torch.float64))[..., mask],
                               plain[..., mask])
    reflect = torch.eye(4, dtype=torch.float64) - 2 * torch.outer(w[0, 0, 0], w[0, 0, 0])
    reflected = q @ (k @ reflect).transpose(-1, -2)  # q_i^T R k_j
    parity = (torch.arange(T)[:, None] - torch.arange(T)[None, :]) % 2 == 1
    expected = torch.where(parity, reflected, plain)
    torch.testing.assert_close(householder_logits(q, k, w, torch.full((1, 1, T), 2.0, dtype=torch.float64))[..., mask],
                               expected[..., mask])


def test_path_init_is_the_reference_models():
    """fla's _init_weights: Linear and Conv1d weights N(0, 0.02), biases 0."""
    m = make_method("path", d_model=64, n_heads=4, randomise=False)
    weights = torch.cat([p.detach().flatten() for n, p in m.named_parameters() if n.endswith("weight")])
    assert abs(float(weights.std()) - 0.02) < 0.002
    assert all(float(m.beta_proj[layer].bias.detach().abs().max()) == 0.0 for layer in range(2))
    with pytest.raises(ValueError, match="init_std > 0"):
        make_method("path", init_std=0.0)


def test_path_model_is_causal_at_4C_and_every_parameter_trains():
    names = check_causal_and_trained("path", None, T=4 * C, t=70)  # t inside the second chunk
    assert {"w_proj.1.0.weight", "w_proj.1.1.weight", "w_conv.1.weight", "beta_proj.1.weight", "beta_proj.1.bias"} <= names


def test_path_traits_and_backends():
    cls = method_class("path")
    assert cls.has_score_term and not cls.uses_positions
    assert not cls.relative_scores  # content-dependent, as fox and cope; never declared
    m = make_method("path")
    with pytest.raises(PosbenchError, match="model.attention=flex cannot run method=path: .*dense"):
        resolve_backend("flex", m, torch.device("cuda"))
    assert resolve_backend("auto", m, torch.device("cuda")) == "sdpa"
    assert resolve_backend("auto", m, torch.device("cpu")) == "sdpa"


def test_path_score_term_needs_k_and_x():
    m = make_method("path")
    q, k = qk(T=6)
    with pytest.raises(ValueError, match="layer input x"):
        m.score_term(q, torch.arange(6), 0, k=k)
