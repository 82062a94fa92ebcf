"""The rotary methods (rope with partial rotation, xpos, p_rope) against reference libraries
(rotary-embedding-torch, x-transformers) or the paper's formula written out here."""

from __future__ import annotations

import pytest
import torch
from model_checks import assert_matches_reference, causal, full_scores, qk
from model_checks import make_method as make

import posbench
from posbench.methods import ModelDims, build_method

ALL_METHODS = posbench.list_methods()
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


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


