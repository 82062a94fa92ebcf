"""Recurrent mixers (Mamba-2, Gated DeltaNet): each against its transformers reference with the
same weights, its chunked form against its recurrent form, state continuation, causality, a
mutated implementation that the reference test catches; and the mixer slot of the model."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch
from transformers import Mamba2Config, Qwen3NextConfig
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextGatedDeltaNet,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

import posbench
from posbench.core.errors import PosbenchError
from posbench.model.mixers import MIXERS, list_mixers
from posbench.model.mixers import gated_deltanet as gdn_module
from posbench.model.mixers import mamba2 as mamba2_module
from posbench.model.mixers.gated_deltanet import chunk_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from posbench.model.transformer import ModelConfig

RECURRENT = sorted(MIXERS)
D_MODEL, HEADS = 64, 4
HYBRID = ["gated_deltanet", "gated_deltanet", "gated_deltanet", "attention"]


def assert_fp32_close(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """Equal to fp32 rounding: the largest difference within ``rel`` of the largest value."""
    err = (ours - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    assert err <= rel * scale, f"max |ours - ref| = {err:.3g}, scale {scale:.3g}"


def randomize_(module: torch.nn.Module, seed: int = 1) -> None:
    """Move every parameter off its init, so no weight is a silent constant (gains of 1, D of 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))


def make_mixer(name: str, chunk_size: int = 16, **options) -> torch.nn.Module:
    torch.manual_seed(0)
    mixer = MIXERS[name](D_MODEL, HEADS, 1e-5, chunk_size=chunk_size, **options)
    randomize_(mixer)
    return mixer


def inputs(B: int = 2, T: int = 45, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# Against transformers
# ----------------------------------------------------------------------------------------------


def mamba2_reference(ours) -> Mamba2Mixer:
    """transformers' Mamba2Mixer of the same shape, holding our weights (same layout)."""
    cfg = Mamba2Config(hidden_size=D_MODEL, num_heads=ours.n_heads, head_dim=ours.head_dim,
                       expand=ours.inner // D_MODEL, state_size=ours.d_state, n_groups=ours.n_groups,
                       conv_kernel=ours.conv.kernel_size[0], chunk_size=ours.chunk_size, use_conv_bias=True,
                       use_bias=False, layer_norm_epsilon=ours.norm_eps, num_hidden_layers=1)
    ref = Mamba2Mixer(cfg, 0).eval()
    with torch.no_grad():
        for theirs, mine in ((ref.in_proj.weight, ours.in_proj.weight), (ref.conv1d.weight, ours.conv.weight),
                             (ref.conv1d.bias, ours.conv.bias), (ref.dt_bias, ours.dt_bias),
                             (ref.A_log, ours.A_log), (ref.D, ours.D), (ref.norm.weight, ours.norm_weight),
                             (ref.out_proj.weight, ours.out.weight)):
            theirs.copy_(mine)
    return ref


def gated_deltanet_reference(ours) -> Qwen3NextGatedDeltaNet:
    """transformers' Qwen3NextGatedDeltaNet of the same shape, holding our weights: its input
    projections interleave q, k, v, z (and b, a) per head, ours keep each whole."""
    H, dk, dv = ours.n_heads, ours.dk, ours.dv
    cfg = Qwen3NextConfig(hidden_size=D_MODEL, linear_num_value_heads=H, linear_num_key_heads=H,
                          linear_key_head_dim=dk, linear_value_head_dim=dv,
                          linear_conv_kernel_dim=ours.conv.kernel_size[0], rms_norm_eps=ours.norm_eps,
                          num_hidden_layers=1, layer_types=["linear_attention"])
    ref = Qwen3NextGatedDeltaNet(cfg, 0).eval()
    q, k, v = ours.qkv.weight.split([H * dk, H * dk, H * dv])
    z = ours.gate.weight
    b, a = ours.beta_alpha.weight.split([H, H])
    heads = [torch.cat([q[h * dk:(h + 1) * dk], k[h * dk:(h + 1) * dk], v[h * dv:(h + 1) * dv],
                        z[h * dv:(h + 1) * dv]]) for h in range(H)]
    with torch.no_grad():
        ref.in_proj_qkvz.weight.copy_(torch.cat(heads))
        ref.in_proj_ba.weight.copy_(torch.stack([b, a], dim=1).reshape(2 * H, D_MODEL))
        for theirs, mine in ((ref.conv1d.weight, ours.conv.weight), (ref.dt_bias, ours.dt_bias),
                             (ref.A_log, ours.A_log), (ref.norm.weight, ours.norm_weight),
                             (ref.out_proj.weight, ours.out.weight)):
            theirs.copy_(mine)
    return ref


REFERENCES = {"mamba2": mamba2_reference, "gated_deltanet": gated_deltanet_reference}


def reference_output(name: str, mixer, x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # "falling back to the reference PyTorch implementation"
        return REFERENCES[name](mixer)(x)


@pytest.mark.parametrize("T", [45, 64])
@pytest.mark.parametrize("name", RECURRENT)
def test_mixer_matches_transformers(name, T):
    """The whole layer, projections to output, equals transformers' (chunk 16; T not a multiple too)."""
    mixer = make_mixer(name)
    x = inputs(T=T)
    with torch.no_grad():
        y, _ = mixer(x)
    assert_fp32_close(y, reference_output(name, mixer, x))


def test_mamba2_with_groups_matches_transformers():
    """B and C shared by groups of heads (n_groups=2), and a larger state."""
    mixer = make_mixer("mamba2", n_groups=2, d_state=32)
    x = inputs()
    with torch.no_grad():
        y, _ = mixer(x)
    assert_fp32_close(y, reference_output("mamba2", mixer, x))


@pytest.mark.parametrize("rule", ["chunk", "recurrent"])
def test_gated_delta_rule_matches_transformers_with_initial_and_final_state(rule):
    """The rule alone, both forms, from a nonzero state, against transformers' torch rules."""
    g = torch.Generator().manual_seed(3)
    B, T, H, dk, dv = 2, 37, 3, 8, 16
    q, k = torch.randn(B, T, H, dk, generator=g), torch.randn(B, T, H, dk, generator=g)
    v = torch.randn(B, T, H, dv, generator=g)
    log_alpha = -torch.rand(B, T, H, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, dk, dv, generator=g)
    if rule == "chunk":
        ref_o, ref_s = torch_chunk_gated_delta_rule(q, k, v, log_alpha, beta, chunk_size=8, initial_state=state,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    else:
        ref_o, ref_s = torch_recurrent_gated_delta_rule(q, k, v, log_alpha, beta, initial_state=state,
                                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours = chunk_gated_delta_rule if rule == "chunk" else recurrent_gated_delta_rule
    heads_first = [t.transpose(1, 2) for t in (q, k, v, log_alpha, beta)]
    qh, kh, vh, ah, bh = heads_first
    o, s = ours(l2_normalize(qh) * dk ** -0.5, l2_normalize(kh), vh, ah, bh, state, 8)
    assert_fp32_close(o.transpose(1, 2), ref_o)
    assert_fp32_close(s, ref_s)


# A mutated implementation fails the reference test: each mutation is a plausible slip.
def drop_decay(rule):
    return lambda q, k, v, log_alpha, beta, memory, chunk: rule(q, k, v, 0 * log_alpha, beta, memory, chunk)


def drop_beta(rule):
    return lambda q, k, v, log_alpha, beta, memory, chunk: rule(q, k, v, log_alpha, 1 + 0 * beta, memory, chunk)


def flip_ssd_decay(scan):
    return lambda x, dt, A, b, c, state, chunk: scan(x, dt, -A, b, c, state, chunk)


def drop_ssd_dt(scan):  # forgets to discretise the input: x instead of x * dt
    return lambda x, dt, A, b, c, state, chunk: scan(x / dt[..., None], dt, A, b, c, state, chunk)


def drop_output_gate(norm):
    return lambda y, z, weight, groups, eps: norm(y, torch.full_like(z, 30.0), weight, groups, eps)


MUTATIONS = [
    ("gated_deltanet", gdn_module, "chunk_gated_delta_rule", drop_decay),
    ("gated_deltanet", gdn_module, "chunk_gated_delta_rule", drop_beta),
    ("mamba2", mamba2_module, "ssd_chunked", flip_ssd_decay),
    ("mamba2", mamba2_module, "ssd_chunked", drop_ssd_dt),
    ("mamba2", mamba2_module, "gated_group_rms_norm", drop_output_gate),
]


@pytest.mark.parametrize("name, module, attr, mutate", MUTATIONS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_mutated_mixer_fails_the_reference_test(monkeypatch, name, module, attr, mutate):
    mixer = make_mixer(name)
    x = inputs()
    expected = reference_output(name, mixer, x)
    monkeypatch.setattr(module, attr, mutate(getattr(module, attr)))
    with torch.no_grad():
        y, _ = mixer(x)
    with pytest.raises(AssertionError):
        assert_fp32_close(y, expected)


# ----------------------------------------------------------------------------------------------
# Forms, state, causality
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECURRENT)
def test_chunked_and_recurrent_forms_agree_from_any_state(name):
    mixer = make_mixer(name)
    x = inputs()
    with torch.no_grad():
        _, start = mixer(inputs(T=20, seed=5))  # a nonzero state, conv and recurrent parts
        y_chunked, end_chunked = mixer(x, start)
        mixer.form = "recurrent"
        y_recurrent, end_recurrent = mixer(x, start)
    assert_fp32_close(y_recurrent, y_chunked)
    for a, b in zip(end_recurrent, end_chunked):
        assert_fp32_close(a, b)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
@pytest.mark.parametrize("name", RECURRENT)
def test_a_window_continued_from_its_state_equals_one_long_window(name, form):
    """Pieces of 13, 1 (a generation step) and 31 tokens, each from the last one's state, give
    the outputs of the 45 tokens at once: the state holds all a mixer knows of the past."""
    mixer = make_mixer(name)
    mixer.form = form
    x = inputs()
    with torch.no_grad():
        whole, _ = mixer(x)
        state, pieces = None, []
        for piece in x.split([13, 1, 31], dim=1):
            y, state = mixer(piece, state)
            pieces.append(y)
    assert_fp32_close(torch.cat(pieces, dim=1), whole)


@pytest.mark.parametrize("name", RECURRENT)
def test_mixer_is_causal(name):
    mixer = make_mixer(name)
    a = inputs(T=50)
    b = a.clone()
    b[:, 30:] = inputs(T=20, seed=9)
    with torch.no_grad():
        ya, yb = mixer(a)[0], mixer(b)[0]
    assert torch.equal(ya[:, :30], yb[:, :30])
    assert not torch.allclose(ya[:, 30:], yb[:, 30:], atol=1e-4)


# ----------------------------------------------------------------------------------------------
# The mixer slot of the model
# ----------------------------------------------------------------------------------------------


def model(mixer="attention", method: str = "nope", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("vocab_size", 64)
    if isinstance(mixer, list) and mixer:
        overrides.setdefault("n_layers", len(mixer))  # every mixer of the pattern present
    return posbench.create_model(method, flavour="tiny", mixer=mixer, **overrides)


MODELS = [("mamba2", "nope"), ("gated_deltanet", "nope"), (HYBRID, "rope"), (["mamba2", "attention"], "alibi")]
MODEL_IDS = ["mamba2", "gated_deltanet", "hybrid-gdn-rope", "hybrid-mamba2-alibi"]


def test_attention_model_is_unchanged_by_the_mixer_slot():
    """The default is attention, with the parameters, records and initial weights it had: the
    hash of a tiny rope model's state at seed 0, fixed here, is the one from before mixers (its
    logits and gradients were compared bitwise too, once, on one machine: arithmetic may round
    differently on another CPU, initialisation does not)."""
    m = model("attention", method="rope", vocab_size=8192)
    assert m.cfg.mixer == "attention" and not m.cfg.recurrent
    assert "mixer" not in m.cfg.to_dict() and "mixer_options" not in m.cfg.to_dict()
    assert all(hasattr(b, "attn") and not hasattr(b, "mixer") for b in m.blocks)
    torch.manual_seed(0)
    state = posbench.create_model("rope", flavour="tiny").state_dict()
    assert len(state) == 17 and sorted(state)[:2] == ["blocks.0.attn.out.weight", "blocks.0.attn.qkv.weight"]
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in state.values())).hexdigest()
    assert digest[:16] == "4f78ca1126cc9efb"


def test_layer_pattern_repeats_and_only_attention_layers_take_the_method():
    m = model(HYBRID, method="rope", n_layers=8)
    assert m.cfg.layer_mixers == HYBRID * 2
    kinds = ["attention" if hasattr(b, "attn") else b.mixer.name for b in m.blocks]
    assert kinds == HYBRID * 2
    assert m.cfg.to_dict()["mixer"] == HYBRID
    assert set(m.initial_state(3)) == {0, 1, 2, 4, 5, 6}


@pytest.mark.parametrize("mixer, method", MODELS, ids=MODEL_IDS)
def test_recurrent_and_hybrid_models_are_causal_and_run_past_the_context(mixer, method):
    m = model(mixer, method).eval()
    T, t = 300, 200  # past several chunks of 64
    a = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(1))
    b = a.clone()
    b[:, t] = (a[:, t] + 1) % 64
    with torch.no_grad():
        la, lb = m(a), m(b)
    assert torch.isfinite(la).all()
    torch.testing.assert_close(la[:, :t], lb[:, :t], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(la[:, t:], lb[:, t:], atol=1e-4)


@pytest.mark.parametrize("mixer, method", MODELS, ids=MODEL_IDS)
def test_every_parameter_gets_a_gradient(mixer, method):
    m = model(mixer, method)
    x = torch.randint(0, 64, (2, 70), generator=torch.Generator().manual_seed(1))
    m(x, targets=x).backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()
               or (p.grad == 0).all()]
    assert not missing


def test_model_state_continues_a_stream():
    """A model given ``state`` continues the previous window: two windows of a stream give the
    logits of the whole stream (a pure recurrent model; attention would need the keys)."""
    m = model("gated_deltanet").eval()
    x = torch.randint(0, 64, (2, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = m(x)
        state = m.initial_state(2)
        parts = [m(x[:, :40], state=state), m(x[:, 40:], state=state)]
    assert_fp32_close(torch.cat(parts, dim=1), whole)


def test_mixer_options_are_filled_and_recorded():
    cfg = ModelConfig(flavour="tiny", d_model=64, n_heads=4, n_layers=2, mixer="mamba2",
                      mixer_options={"mamba2": {"d_state": 16}})
    assert cfg.mixer_options["mamba2"]["d_state"] == 16
    assert cfg.mixer_options["mamba2"]["chunk_size"] == 64
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg


@pytest.mark.parametrize("overrides, method, match", [
    ({"mixer": "lstm"}, "nope", "is not a mixer"),
    ({"mixer": []}, "nope", "is not a mixer"),
    ({"mixer": "mamba2"}, "rope", "use method=nope"),
    ({"mixer": "mamba2", "attention_window": 8}, "nope", "no attention layer"),
    ({"mixer": "mamba2", "mixer_options": {"mamba2": {"d_stat": 4}}}, "nope", "unknown option"),
    ({"mixer": "mamba2", "mixer_options": {"gated_deltanet": {}}}, "nope", "not a recurrent mixer of this model"),
    ({"mixer_options": {"mamba2": {}}}, "nope", "no recurrent layer"),
])
def test_bad_mixer_configs_are_one_line_errors(overrides, method, match):
    with pytest.raises(PosbenchError, match=match):
        model(method=method, **overrides)


def test_list_mixers():
    assert list_mixers() == ["attention", "gated_deltanet", "mamba2"]
