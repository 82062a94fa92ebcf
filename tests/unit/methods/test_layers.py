"""Per-layer schedules (method=layers, method=swan): a whole-model reference forward written out
here (RoPE by the complex-rotation formula, attention as a loop over keys i - W < j <= i), the
equivalences with single methods, per-layer windows in every backend, and what a schedule does
with extensions, randomized positions, saved runs and logged parameters."""

from __future__ import annotations

import math

import pytest
import torch
from model_checks import assert_causal_model, assert_matches_reference
from omegaconf import OmegaConf

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method
from posbench.methods.base import ParameterDrift
from posbench.model.attention import FLEX_AVAILABLE
from posbench.model.extension import EXTENSIONS, Setting, extended, resolve_extensions
from posbench.model.positions import randomize_max_from_config
from posbench.model.transformer import attention_backends, layer_windows
from posbench.runs.spec import MethodSpec

VOCAB = 96
C = 256


def model(method="swan", seed=0, method_options=None, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("vocab_size", VOCAB)
    return posbench.create_model(method, flavour="tiny", method_options=method_options, **overrides)


def tokens(B, T, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def rope_complex(x, base=10000.0):
    """RoFormer's rotation of (T, D) rows at positions 0..T-1, channel i paired with i + D/2 (the
    Hugging Face layout), as complex numbers times exp(i * pos * theta_i)."""
    T, D = x.shape
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    z = torch.complex(x[:, : D // 2], x[:, D // 2 :]) * torch.polar(torch.ones(T, D // 2, dtype=torch.float64),
                                                                      torch.arange(T).double()[:, None] * theta)
    return torch.cat((z.real, z.imag), dim=-1)


def reference_forward(net, idx, kinds, windows):
    """The transformer written out in float64: per layer, RoPE or nothing on q/k, then softmax
    attention as a loop over queries i and keys i - W < j <= i."""
    net = net.double()
    x = net.embed(idx)[0]  # (T, C)
    T = x.shape[0]
    H = net.cfg.n_heads
    D = net.cfg.d_model // H
    for layer, block in enumerate(net.blocks):
        h = block.attn_norm(x)
        q, k, v = block.attn.qkv(h).view(T, 3, H, D).unbind(1)  # (T, H, D) each
        out = torch.zeros(T, H, D, dtype=torch.float64)
        for head in range(H):
            qh, kh = q[:, head], k[:, head]
            if kinds[layer] == "rope":
                qh, kh = rope_complex(qh), rope_complex(kh)
            for i in range(T):
                lo = 0 if windows[layer] is None else max(0, i - windows[layer] + 1)
                logits = torch.stack([qh[i] @ kh[j] for j in range(lo, i + 1)]) / math.sqrt(D)
                out[i, head] = logits.softmax(0) @ v[lo : i + 1, head]
        x = x + block.attn.out(out.reshape(T, H * D))
        x = x + block.mlp(block.mlp_norm(x))
    return net.lm_head(net.norm(x))[None]


def test_swan_matches_the_written_out_schedule():
    """6 layers of swan (window 8): NoPE global at layers 0 and 4, RoPE window 8 elsewhere."""
    net = model("swan", method_options={"window": 8}, n_layers=6).eval()
    with torch.no_grad():  # logits of order 1, attention far from uniform: windows and rotations matter
        for block in net.blocks:
            block.attn.qkv.weight.mul_(8)
        net.lm_head.weight.mul_(20)
    idx = tokens(1, 30)
    kinds = ["nope", "rope", "rope", "rope", "nope", "rope"]
    windows = [None, 8, 8, 8, None, 8]
    assert layer_windows(net.cfg, net.position) == windows
    with torch.no_grad():
        ours = net.double()(idx)
        ref = reference_forward(net, idx, kinds, windows)
    assert_matches_reference(ours, ref, method="swan", reference="whole model: RoFormer rotation + windowed softmax loop",
                             atol=1e-5, rtol=1e-5)  # the eager attention runs in fp32
    assert ref.abs().max() > 0.5
    # ... and the schedule matters: the same weights as plain rope give other logits.
    with torch.no_grad():
        other = reference_forward(net, idx, ["rope"] * 6, [None] * 6)
    assert (ours - other).abs().max() > 0.1


@pytest.mark.parametrize("single", ["rope", "t5", "relative", "fox"])
def test_one_entry_pattern_is_that_method_bitwise(single):
    """pattern=[m] builds m's parameters from the same draws and runs the same ops: logits equal."""
    fresh = model("layers", method_options={"pattern": [single]})
    for (_, pa), (_, pb) in zip(model(single).named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(pa, pb)  # same seed -> same body and same method parameters
    idx = tokens(2, 40)
    with torch.no_grad():
        assert torch.equal(model(single)(idx), fresh(idx))


def test_window_entry_is_the_window_baseline_bitwise():
    idx = tokens(2, 40)
    with torch.no_grad():
        ref = model("rope", attention_window=16)(idx)
        ours = model("layers", method_options={"pattern": ["rope@16"]})(idx)
        narrower = model("layers", method_options={"pattern": ["rope@16"]}, attention_window=32)(idx)
    assert torch.equal(ours, ref) and torch.equal(narrower, ref)  # a layer keeps the narrower window


def test_backends_are_resolved_per_layer():
    """On CUDA a schedule's windowed layers run in flex and its global NoPE layers in fused sdpa
    (resolution only: no CUDA needed); bench reports both."""
    net = model("swan", n_layers=4)
    assert attention_backends(net.cfg, net.position, torch.device("cuda")) == "sdpa+flex"
    assert attention_backends(net.cfg, net.position, torch.device("cpu")) == "sdpa"
    rope = model("rope")
    assert attention_backends(rope.cfg, rope.position, torch.device("cuda")) == "sdpa"


def test_layer_windows_intersect_with_model_window():
    net = model("swan", n_layers=4, method_options={"window": 64}, attention_window=100)
    assert layer_windows(net.cfg, net.position) == [100, 64, 64, 64]
    net = model("swan", n_layers=4, method_options={"window": 64}, attention_window=32)
    assert layer_windows(net.cfg, net.position) == [32, 32, 32, 32]


@pytest.mark.skipif(not FLEX_AVAILABLE, reason="FlexAttention needs torch>=2.5")
@pytest.mark.slow
def test_flex_and_sdpa_forward_match_eager_with_per_layer_windows():
    """One BlockMask per distinct window (flex runs forward on the CPU, uncompiled)."""
    pattern = ["nope", "rope@6", {"method": "alibi", "window": 11}, "rope@6"]  # t5 keeps out of flex
    eager = model("layers", method_options={"pattern": pattern}, attention="eager", n_layers=4).eval()
    idx = tokens(2, 33)
    with torch.no_grad():
        ref = eager(idx)
        for backend in ("sdpa", "flex"):
            other = model("layers", method_options={"pattern": pattern}, attention=backend, n_layers=4).eval()
            other.load_state_dict(eager.state_dict())
            torch.testing.assert_close(other(idx), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flex_gradients_match_eager_on_cuda():
    pattern = [{"method": "fox", "window": 16}, "nope", "alibi@32"]  # t5 and kerple keep out of flex
    idx = tokens(2, 64).cuda()
    grads = {}
    for backend in ("eager", "flex"):
        net = model("layers", method_options={"pattern": pattern}, attention=backend, n_layers=3).cuda()
        net(idx, targets=idx.roll(-1, 1)).backward()
        grads[backend] = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
    for name, g in grads["eager"].items():
        scale = g.abs().max().clamp(min=1e-12)
        torch.testing.assert_close(grads["flex"][name] / scale, g / scale, atol=1e-3, rtol=1e-3, msg=name)


def test_causal_and_finite_at_4c():
    net = model("swan", n_layers=4).eval()
    assert_causal_model(net, length=4 * C, changed_at=700, vocab=VOCAB)


def test_every_parameter_gets_a_gradient_and_is_logged_by_group():
    pattern = ["t5", {"method": "t5", "window": 16, "options": {"num_buckets": 16}}, "fox", "stickbreaking@8"]
    net = model("layers", method_options={"pattern": pattern}, n_layers=4)
    idx = tokens(2, 40)
    net(idx, targets=idx.roll(-1, 1)).backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    names = set(net.position.position_parameters())
    assert names == {"t5.bias.weight", "t5_2.bias.weight", "fox.gates.0.weight", "fox.gates.0.bias"}
    assert "position/t5_2.bias.weight/norm" in ParameterDrift(net.position).metrics()
    # Each group is built for its own layers: fox has one gate (one layer), not four.
    assert len(net.position.groups[2].gates) == 1
    assert net.position.backend_limits()["sdpa"].startswith("its stickbreaking layers:")


def test_rotary_extensions_are_refused_in_one_line_others_apply():
    swan = build_method("swan", ModelDims(64, 4, 4))
    with pytest.raises(PosbenchError, match="extension yarn does not apply to method=swan; it applies to rotary"):
        resolve_extensions(["yarn"], swan)
    assert resolve_extensions("all", swan, log=lambda _: None) == ["none", "log_scaling", "window"]
    for rule in ("log_scaling", "window"):
        wrapped = EXTENSIONS[rule].install(swan, Setting(32, 128, None))
        assert [wrapped.attention_window(layer) for layer in range(4)] == [None, 128, 128, 128]
    net = model("swan", method_options={"window": 8}, n_layers=4).eval()
    with torch.no_grad(), extended(net, "window", 32, 96):
        assert layer_windows(net.cfg, net.position) == [None, 8, 8, 8]
        assert torch.isfinite(net(tokens(1, 96))).all()


def test_randomized_positions_follow_the_pattern():
    cfg = {"positions": {"randomize_max": 2048}}
    assert randomize_max_from_config(cfg, build_method("swan", ModelDims(64, 4, 4)), 256, None) == 2048
    nope_only = build_method("layers", ModelDims(64, 4, 4), pattern=["nope", "stickbreaking"])
    with pytest.raises(PosbenchError, match="method=layers reads no position ids"):
        randomize_max_from_config(cfg, nope_only, 256, None)


def test_saved_and_yaml_sections_rebuild_the_same_schedule():
    section = OmegaConf.create({"name": "layers", "pattern": [
        {"method": "t5", "window": 8, "options": {"num_buckets": 16}}, "nope"]})
    spec = MethodSpec.from_config(section)
    again = MethodSpec.from_saved(spec.section())
    assert again == spec
    m = again.build(ModelDims(64, 4, 4))
    assert [m.attention_window(layer) for layer in range(4)] == [8, None, 8, None]
    assert m.groups[0].num_buckets == 16
    assert MethodSpec.from_saved({"name": "swan", "window": 64}).build(ModelDims(64, 4, 4)).attention_window(1) == 64


@pytest.mark.parametrize("pattern,message", [
    (["rope@x"], "window after @ must be a positive integer"),
    ([{"method": "rope", "window": 0}], "window must be a positive integer"),
    ([{"method": "rope", "size": 3}], "takes only method, window, options"),
    (["learned"], "learned adds to the input embedding"),
    ([], "pattern is empty"),
])
def test_bad_patterns_are_one_line(pattern, message):
    with pytest.raises(PosbenchError, match=f"method=layers cannot run on this model: .*{message}"):
        MethodSpec("layers", {"pattern": pattern}).probe(ModelDims(64, 4, 4))


def test_unknown_sub_method_or_option_is_one_line():
    with pytest.raises(PosbenchError, match="unknown position method 'ropey'"):
        MethodSpec("layers", {"pattern": ["ropey"]}).probe(ModelDims(64, 4, 4))
    with pytest.raises(PosbenchError, match="method 'rope' has no option 'bass'"):
        MethodSpec("layers", {"pattern": [{"method": "rope", "options": {"bass": 2}}]}).probe(ModelDims(64, 4, 4))


def test_swan_trains_a_step_with_the_schedule_in_the_optimizer():
    net = model("swan", n_layers=4)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    idx = tokens(2, 32)
    before = net(idx, targets=idx.roll(-1, 1))
    before.backward()
    opt.step()
    with torch.no_grad():
        after = net(idx, targets=idx.roll(-1, 1))
    assert after.item() < before.item()


def test_viz_draws_a_schedule_layer_by_layer(tmp_path):
    """viz probes every layer: a pattern whose content-free layer comes first is still content
    dependent (fox), layers without a score term draw zero, and swan's q.k decay is one curve per
    distinct layer (NoPE's flat line, RoPE's decay)."""
    from helpers import compose_config

    from posbench.viz.command import run_viz
    from posbench.viz.measures import is_content_dependent, qk_decay

    dims = ModelDims(64, 4, 2)
    assert is_content_dependent(build_method("layers", dims, pattern=["t5", "fox"]), dims)
    assert not is_content_dependent(build_method("layers", dims, pattern=["t5", "nope"]), dims)
    swan = build_method("swan", ModelDims(64, 4, 4))
    assert torch.equal(qk_decay(swan, 64, 16, layer=0), torch.ones(64))
    assert qk_decay(swan, 64, 16, layer=1)[40] < 0.9
    written = run_viz(compose_config("viz", ["method=layers", "method.pattern=[alibi,nope]", "model=tiny",
                                             f"out={tmp_path}"]), log=lambda _: None)
    assert tmp_path / "score_terms.png" in written
