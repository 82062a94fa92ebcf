"""Correctness of the position methods against independent references.

References are either library code from ``transformers`` (Llama RoPE, BLOOM ALiBi, T5 buckets) or
the paper formula written out here; never posbench's own helpers.
"""

from __future__ import annotations

import math

import pytest
import torch
from model_checks import assert_matches_reference, causal, full_scores, layer_input, methods_with, qk
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import rotate_half as hf_rotate_half
from transformers.models.t5.modeling_t5 import T5Attention

import posbench
from posbench.config import load_group_option
from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method, dense_score, method_class, method_options
from posbench.methods.base import Rotary
from posbench.methods.t5 import causal_bucket

ALL_METHODS = posbench.list_methods()


def make(name: str, d_model: int = 32, n_heads: int = 4, n_layers: int = 2, **options):
    torch.manual_seed(0)
    return build_method(name, ModelDims(d_model=d_model, n_heads=n_heads, n_layers=n_layers), **options)


# ----------------------------------------------------------------------------------------------
# Registry / interface, for every method
# ----------------------------------------------------------------------------------------------


def test_builtin_methods_registered():
    assert ALL_METHODS[:7] == ["nope", "learned", "sinusoidal", "rope", "alibi", "t5", "relative"]
    assert len(set(ALL_METHODS)) == len(ALL_METHODS)


def test_every_method_module_registers_its_method():
    """Each module of posbench/methods (but base) defines a registered method: tests iterate over
    the registry, never over a hand-kept list."""
    import pkgutil

    import posbench.methods as package

    modules = {m.name for m in pkgutil.iter_modules(package.__path__) if m.name != "base" and not m.name.startswith("_")}
    assert modules <= {method_class(n).__module__.rsplit(".", 1)[1] for n in posbench.list_methods(None)}


@pytest.mark.parametrize("name", ALL_METHODS)
def test_method_config_file_matches_constructor(name):
    """configs/method/<name>.yaml exists, names the method, and its defaults are the code's."""
    cfg = load_group_option("method", name)
    assert cfg.pop("name") == name
    defaults = method_options(name)
    assert set(cfg) == set(defaults), f"{name}: yaml options {set(cfg)} != constructor {set(defaults)}"
    for key, value in cfg.items():
        assert value == defaults[key], f"{name}.{key}: yaml {value!r} != default {defaults[key]!r}"


@pytest.mark.parametrize("name", ALL_METHODS)
def test_method_unknown_option_rejected(name):
    with pytest.raises(PosbenchError, match="no option 'definitely_not_an_option'"):
        make(name, definitely_not_an_option=1)


@pytest.mark.parametrize("name", ALL_METHODS)
def test_method_interface_consistent(name):
    """has_score_term agrees with score_term; hooks return the documented shapes and dtypes."""
    m = make(name)
    assert m.name == name and method_class(name) is type(m)
    T = 20
    pos = torch.arange(T)
    q, k = qk(T=T)
    qr, kr = m.rotate_qk(q, k, pos)
    # q and k keep their shape, or widen their channels alike (pope's polar form: 2D channels)
    assert qr.shape[:-1] == q.shape[:-1] and kr.shape == qr.shape
    assert qr.shape[-1] == q.shape[-1] or name == "pope"
    assert qr.dtype == q.dtype and kr.dtype == k.dtype
    fn = m.score_term(qr, pos, 0, k=kr, x=layer_input(q))
    assert (fn is not None) == type(m).has_score_term
    if fn is not None:
        s = dense_score(fn, 2, 4, T, q.device)
        assert s.shape[1:] == (4, T, T) and s.shape[0] in (1, 2)
        assert torch.isfinite(s).all()
    emb = m.input_embedding(pos)
    if emb is not None:
        assert emb.shape == (T, 32)
        assert torch.isfinite(emb).all()
    limit = m.max_positions
    assert limit is None or (isinstance(limit, int) and limit > 0)
    if name in ("learned", "abs_attention"):
        assert limit == 4096
    else:
        assert limit is None  # any length works


def _input_methods():
    return [n for n in ALL_METHODS if make(n).input_embedding(torch.arange(2)) is not None]


INPUT_METHODS = _input_methods()


def test_input_methods_are_the_absolute_ones():
    assert {"learned", "sinusoidal"} == set(INPUT_METHODS)
    assert not {"nope", "rope", "alibi", "t5", "relative"} & set(INPUT_METHODS)


@pytest.mark.parametrize("name", INPUT_METHODS)
def test_input_embedding_methods_touch_only_the_input(name):
    """A method that adds to the input neither rotates q/k nor adds a score term."""
    m = make(name)
    pos = torch.arange(16)
    q, k = qk(T=16)
    qr, kr = m.rotate_qk(q, k, pos)
    assert torch.equal(qr, q) and torch.equal(kr, k)
    assert not type(m).has_score_term and m.score_term(q, pos, 0) is None
    # ... and the embedding really depends on the position.
    e = m.input_embedding(torch.arange(16)).double()
    assert not torch.allclose(e[0], e[1])


def test_nope_is_identity_everywhere():
    m = make("nope")
    q, k = qk()
    pos = torch.arange(q.shape[2])
    qr, kr = m.rotate_qk(q, k, pos)
    for out, ref in ((qr, q), (kr, k)):
        assert_matches_reference(out, ref, method="nope", reference="identity: q, k unchanged", atol=0, rtol=0)
    assert m.input_embedding(pos) is None and m.score_term(q, pos, 0) is None
    assert not type(m).has_score_term and sum(p.numel() for p in m.parameters()) == 0


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------


def rope_reference_half(q, k, positions, base):
    """HF Llama apply_rotary_pos_emb with cos/sin from theta_i = base^(-2i/d), in float64."""
    D = q.shape[-1]
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    angles = positions.double()[:, None] * theta[None, :]
    emb = torch.cat((angles, angles), dim=-1)  # (T, D)
    cos, sin = emb.cos()[None], emb.sin()[None]  # (1, T, D): HF unsqueezes dim 1 -> (1, 1, T, D)
    return apply_rotary_pos_emb(q.double(), k.double(), cos, sin)


def rope_reference_complex(x, positions, base):
    """RoFormer: channel pairs (2i, 2i+1) as complex numbers times exp(i * pos * theta_i)."""
    D = x.shape[-1]
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = positions.double()[:, None] * theta[None, :]  # (T, D/2)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], D // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def test_hf_rope_signature_is_what_we_call():
    import inspect

    params = list(inspect.signature(apply_rotary_pos_emb).parameters)
    assert params[:4] == ["q", "k", "cos", "sin"]
    x = torch.arange(8.0)
    assert torch.equal(hf_rotate_half(x), torch.tensor([-4.0, -5, -6, -7, 0, 1, 2, 3]))


@pytest.mark.parametrize("base", [10000.0, 500000.0, 100.0])
@pytest.mark.parametrize("head_dim", [8, 16, 64])
def test_rope_matches_hf_llama(base, head_dim):
    H = 2
    m = make("rope", d_model=H * head_dim, n_heads=H, base=base)
    q, k = qk(H=H, T=64, D=head_dim, dtype=torch.float32)
    pos = torch.arange(64)
    q_ref, k_ref = rope_reference_half(q, k, pos, base)
    q_out, k_out = m.rotate_qk(q, k, pos)
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        assert_matches_reference(out.double(), ref, method="rope", reference="transformers Llama apply_rotary_pos_emb (fp64), positions 0-63",
                                 atol=2e-5, rtol=1e-5)


def test_rope_matches_hf_llama_at_large_arbitrary_positions():
    m = make("rope", d_model=64, n_heads=2)
    q, k = qk(H=2, T=40, D=32, dtype=torch.float32)
    pos = torch.randint(0, 5000, (40,), generator=torch.Generator().manual_seed(3))
    q_ref, k_ref = rope_reference_half(q, k, pos, 10000.0)
    q_out, k_out = m.rotate_qk(q, k, pos)
    # fp32 angles at position ~5000 carry ~5e-4 rad of rounding; a wrong formula is off by O(1).
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        assert_matches_reference(out.double(), ref, method="rope", reference="transformers Llama apply_rotary_pos_emb (fp64), positions up to 5000",
                                 atol=5e-3, rtol=0)


@pytest.mark.parametrize("base", [10000.0, 500000.0])
@pytest.mark.parametrize("head_dim", [8, 32])
def test_rope_interleaved_matches_complex_rotation(base, head_dim):
    H = 3
    m = make("rope", d_model=H * head_dim, n_heads=H, base=base, interleaved=True)
    q, k = qk(H=H, T=50, D=head_dim, dtype=torch.float32)
    pos = torch.arange(50)
    q_out, k_out = m.rotate_qk(q, k, pos)
    for out, x in ((q_out, q), (k_out, k)):
        assert_matches_reference(out.double(), rope_reference_complex(x, pos, base), method="rope",
                                 reference="RoFormer complex rotation (interleaved=true)", atol=2e-5, rtol=1e-5)


def test_rope_modes_differ_only_by_channel_permutation():
    D = 16
    half = make("rope", d_model=2 * D, n_heads=2)
    inter = make("rope", d_model=2 * D, n_heads=2, interleaved=True)
    q, k = qk(H=2, T=30, D=D, dtype=torch.float32)
    pos = torch.arange(30)
    # interleaved channel (2i, 2i+1) <-> rotate_half channel (i, i + D/2)
    perm = torch.stack((torch.arange(D // 2), torch.arange(D // 2) + D // 2), dim=-1).flatten()
    qh, kh = half.rotate_qk(q, k, pos)
    qi, ki = inter.rotate_qk(q[..., perm], k[..., perm], pos)
    torch.testing.assert_close(qi, qh[..., perm], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ki, kh[..., perm], atol=1e-6, rtol=1e-6)
    # ... and they are genuinely different maps on the same input.
    assert not torch.allclose(inter.rotate_qk(q, k, pos)[0], qh, atol=1e-3)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_is_a_rotation(interleaved):
    m = make("rope", d_model=64, n_heads=4, interleaved=interleaved)
    q, k = qk(H=4, T=64, D=16, dtype=torch.float32)
    pos = torch.arange(64) * 37  # large, irregular angles
    q_out, k_out = m.rotate_qk(q, k, pos)
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.norm(dim=-1), k.norm(dim=-1), atol=1e-5, rtol=1e-5)
    # Norm is preserved *per channel pair* too (each pair is an independent 2D rotation).
    if interleaved:
        pairs = lambda x: x.reshape(*x.shape[:-1], 8, 2).norm(dim=-1)  # noqa: E731
    else:
        pairs = lambda x: torch.stack((x[..., :8], x[..., 8:]), -1).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pairs(q_out), pairs(q), atol=1e-5, rtol=1e-5)
    # Position 0 is the identity; other positions are not.
    q0, _ = m.rotate_qk(q, k, torch.zeros(64, dtype=torch.long))
    torch.testing.assert_close(q0, q, atol=1e-7, rtol=0)
    assert not torch.allclose(q_out[:, :, 1:], q[:, :, 1:], atol=1e-3)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_seed003_bug_absent(interleaved):
    """Seed 003 took cos and sin from the same (sine) table: not a rotation, absolute-dependent."""
    m = make("rope", d_model=64, n_heads=4, interleaved=interleaved)
    pos = torch.arange(1, 200)
    cos, sin = m.cos_sin(pos)
    assert not torch.allclose(cos, sin, atol=1e-2)
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos), atol=1e-6, rtol=0)
    # cos table really is the cosine of the formula's angles
    theta = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    ang = pos.double()[:, None] * theta
    ang = ang.repeat_interleave(2, -1) if interleaved else torch.cat((ang, ang), -1)
    torch.testing.assert_close(cos.double(), ang.cos(), atol=1e-4, rtol=0)
    torch.testing.assert_close(sin.double(), ang.sin(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_scores_depend_only_on_relative_position(interleaved):
    m = make("rope", d_model=64, n_heads=4, interleaved=interleaved)
    q, k = qk(H=4, T=48, D=16, dtype=torch.float32)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    pos = torch.arange(48)
    s0 = full_scores(m, q, k, pos)
    for shift in (1, 1000, 3001):
        s1 = full_scores(m, q, k, pos + shift)
        # fp32 angles near position 3000 are exact to ~3e-4 rad; the seed-003 bug is off by O(0.1).
        torch.testing.assert_close(s1, s0, atol=2e-3, rtol=0)
    # q_m . k_n = q_0 . k_(n-m): one query against one key, moved together.
    q1, k1 = q[:1, :1, :1], k[:1, :1, :1]
    vals = []
    for m_pos in (0, 5, 123, 2000):
        a, _ = m.rotate_qk(q1, q1, torch.tensor([m_pos]))
        _, b = m.rotate_qk(k1, k1, torch.tensor([m_pos + 7]))
        vals.append(float((a * b).sum()))
    assert max(vals) - min(vals) < 2e-3
    # ...while relative distance does matter.
    a, _ = m.rotate_qk(q1, q1, torch.tensor([0]))
    _, b7 = m.rotate_qk(k1, k1, torch.tensor([7]))
    _, b0 = m.rotate_qk(k1, k1, torch.tensor([0]))
    assert abs(float((a * b7).sum()) - float((a * b0).sum())) > 1e-3


def test_rope_rotates_in_fp32_for_low_precision_inputs():
    m = make("rope", d_model=64, n_heads=4)
    q, k = qk(H=4, T=16, D=16, dtype=torch.float32)
    pos = torch.arange(16) + 2000
    qb, kb = m.rotate_qk(q.bfloat16(), k.bfloat16(), pos)
    assert qb.dtype == torch.bfloat16 and kb.dtype == torch.bfloat16
    q_ref, _ = rope_reference_half(q.bfloat16().float(), k, pos, 10000.0)
    torch.testing.assert_close(qb.double(), q_ref, atol=3e-2, rtol=1e-2)


def test_rope_odd_head_dim_rejected():
    with pytest.raises(ValueError, match="even head dimension"):
        make("rope", d_model=12, n_heads=4)


# ----------------------------------------------------------------------------------------------
# ALiBi
# ----------------------------------------------------------------------------------------------


def paper_alibi_slopes(n: int) -> list[float]:
    """Press et al. 2022: geometric sequence starting at 2^(-8/n) with ratio 2^(-8/n) for n = 2^k;
    otherwise the 2^floor(log2 n) slopes, then every other slope of 2 * 2^floor(log2 n) heads."""

    def geometric(n_pow2: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n_pow2) - 3)))
        return [start * start**i for i in range(n_pow2)]

    if math.log2(n).is_integer():
        return geometric(n)
    closest = 2 ** math.floor(math.log2(n))
    return geometric(closest) + paper_alibi_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("n_heads", range(1, 17))
def test_alibi_slopes_match_paper(n_heads):
    m = make("alibi", d_model=8 * n_heads, n_heads=n_heads)
    expected = torch.tensor(paper_alibi_slopes(n_heads), dtype=torch.float64)
    assert m.slopes.shape == (n_heads,)
    torch.testing.assert_close(m.slopes.double(), expected, rtol=1e-6, atol=0)
    assert (m.slopes > 0).all() and (m.slopes < 1).all()


def test_alibi_slopes_explicit_values():
    m8 = make("alibi", d_model=64, n_heads=8)
    torch.testing.assert_close(m8.slopes.double(), torch.tensor([2.0**-i for i in range(1, 9)], dtype=torch.float64))
    m6 = make("alibi", d_model=48, n_heads=6)
    torch.testing.assert_close(
        m6.slopes.double(), torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8], dtype=torch.float64)
    )


@pytest.mark.parametrize("n_heads", [2, 4, 8, 16])
def test_alibi_seed003_off_by_one_absent(n_heads):
    """Seed 003 used start^(i+2); the paper's first slope is start = 2^(-8/H) itself."""
    m = make("alibi", d_model=8 * n_heads, n_heads=n_heads)
    start = 2.0 ** (-8.0 / n_heads)
    assert m.slopes[0].item() == pytest.approx(start, rel=1e-6)
    assert m.slopes[-1].item() == pytest.approx(2.0**-8, rel=1e-6)
    buggy = [start ** (i + 2) for i in range(n_heads)]
    assert not torch.allclose(m.slopes.double(), torch.tensor(buggy, dtype=torch.float64))


@pytest.mark.parametrize("n_heads", [4, 6, 8, 12])
def test_alibi_matches_bloom(n_heads):
    T = 40
    m = make("alibi", d_model=8 * n_heads, n_heads=n_heads)
    bloom = build_alibi_tensor(torch.ones(1, T, dtype=torch.long), n_heads, torch.float32)  # (H, 1, T)
    assert bloom.shape == (n_heads, 1, T)
    bloom_slopes = bloom[:, 0, 1]  # slope * key position 1
    assert_matches_reference(m.slopes, bloom_slopes, method="alibi", reference="transformers BLOOM build_alibi_tensor slopes", rtol=1e-6, atol=0)
    # Softmax of (content + bias) over causal keys: BLOOM's +m*j and ALiBi's -m*(i-j) differ by a
    # per-row constant, so the attention weights must agree exactly (up to rounding).
    pos = torch.arange(T)
    q, k = qk(B=1, H=n_heads, T=T, D=8, dtype=torch.float32)
    ours = full_scores(m, q, k, pos).float().masked_fill(~causal(T), float("-inf")).softmax(-1)
    content = torch.einsum("bhid,bhjd->bhij", q, k) * 8**-0.5
    theirs = (content + bloom[None]).masked_fill(~causal(T), float("-inf")).softmax(-1)
    assert_matches_reference(ours, theirs, method="alibi", reference="transformers BLOOM alibi: attention weights", atol=1e-5, rtol=1e-4)
    # The raw biases differ (not trivially equal): ours is <= 0 and zero on the diagonal.
    dense = dense_score(m.score_term(q, pos, 0), 1, n_heads, T, q.device)
    assert torch.all(dense.diagonal(dim1=-2, dim2=-1) == 0)


def test_alibi_score_term_is_minus_slope_times_distance():
    n_heads, T = 6, 30
    m = make("alibi", d_model=48, n_heads=n_heads)
    q, _ = qk(B=1, H=n_heads, T=T, D=8)
    dense = dense_score(m.score_term(q, torch.arange(T), 0), 1, n_heads, T, q.device)
    slopes = torch.tensor(paper_alibi_slopes(n_heads), dtype=torch.float64)
    i = torch.arange(T).view(-1, 1)
    j = torch.arange(T).view(1, -1)
    expected = -slopes.view(-1, 1, 1) * (i - j).double()
    mask = causal(T)
    assert_matches_reference(dense[0].double()[:, mask], expected[:, mask], method="alibi", reference="paper: -m_h (i - j)",
                             rtol=1e-6, atol=1e-6)
    # same in every layer, no parameters
    dense1 = dense_score(m.score_term(q, torch.arange(T), 1), 1, n_heads, T, q.device)
    assert torch.equal(dense, dense1)
    assert sum(p.numel() for p in m.parameters()) == 0


# ----------------------------------------------------------------------------------------------
# T5
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_buckets,max_distance", [(32, 128), (16, 64), (8, 20), (64, 256), (2, 4), (33, 100), (10, 11)]
)
def test_t5_bucket_matches_hf(num_buckets, max_distance):
    distance = torch.arange(0, 4097)  # i - j
    ours = causal_bucket(distance, num_buckets, max_distance)
    hf = T5Attention._relative_position_bucket(
        -distance, bidirectional=False, num_buckets=num_buckets, max_distance=max_distance
    )  # HF takes memory - query = -(i - j)
    assert_matches_reference(ours.long(), hf.long(), method="t5", reference="transformers T5Attention._relative_position_bucket",
                             atol=0, rtol=0)
    assert int(ours.min()) == 0 and int(ours.max()) == num_buckets - 1
    assert (ours[1:] >= ours[:-1]).all()  # monotone in distance
    # Future keys (negative distance) fall in bucket 0 in both.
    neg = torch.arange(-50, 0)
    assert torch.equal(causal_bucket(neg, num_buckets, max_distance), torch.zeros_like(neg))


def test_t5_default_buckets_explicit():
    # exact buckets below 16; then bucket 16 + floor(16 * log(n / 16) / log(8)), capped at 31
    b = causal_bucket(torch.tensor([0, 1, 15, 16, 18, 19, 100, 112, 113, 128, 10_000]))
    assert b.tolist() == [0, 1, 15, 16, 16, 17, 30, 30, 31, 31, 31]


def test_t5_score_term_shared_across_layers_and_uses_buckets():
    H, T = 4, 300
    m = make("t5", d_model=32, n_heads=H, n_layers=3, bias_scale=1.0)  # the table itself (scaling: test_fidelity)
    with torch.no_grad():
        m.bias.weight.normal_()
    q, _ = qk(B=1, H=H, T=T, D=8, dtype=torch.float32)
    pos = torch.arange(T)
    d = [dense_score(m.score_term(q, pos, layer), 1, H, T, q.device) for layer in range(3)]
    assert torch.equal(d[0], d[1]) and torch.equal(d[0], d[2])
    # Exactly one table of (num_buckets, heads) parameters.
    assert [tuple(p.shape) for p in m.parameters()] == [(32, H)]
    # Explicit: score[h, i, j] = table[bucket(i - j), h] with the HF bucket function.
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    bucket = T5Attention._relative_position_bucket(j - i, bidirectional=False, num_buckets=32, max_distance=128)
    expected = m.bias.weight.detach()[bucket].permute(2, 0, 1)  # (H, T, T)
    mask = causal(T)
    assert_matches_reference(d[0][0][:, mask], expected[:, mask], method="t5", reference="table[HF bucket(i - j), h]", atol=0, rtol=0)


def test_t5_bad_options_rejected():
    with pytest.raises(ValueError):
        make("t5", num_buckets=1)
    with pytest.raises(ValueError):
        make("t5", num_buckets=32, max_distance=16)


# ----------------------------------------------------------------------------------------------
# Sinusoidal
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_model", [16, 64, 128])
def test_sinusoidal_matches_vaswani_formula(d_model):
    m = make("sinusoidal", d_model=d_model, n_heads=4, scale=1.0)  # the raw table
    T = 2048
    pe = m.input_embedding(torch.arange(T))
    assert pe.shape == (T, d_model)
    pos = torch.arange(T, dtype=torch.float64).view(-1, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64).view(1, -1)
    angle = pos / 10000.0 ** (two_i / d_model)
    ref = torch.empty(T, d_model, dtype=torch.float64)
    ref[:, 0::2] = torch.sin(angle)
    ref[:, 1::2] = torch.cos(angle)
    # fp32 angles at position 2047 are exact to ~1e-4; a swapped sin/cos or wrong frequency is O(1).
    assert_matches_reference(pe.double(), ref, method="sinusoidal", reference="Vaswani et al. formula (fp64), positions 0-2047",
                             atol=2e-4, rtol=0)
    torch.testing.assert_close(pe[:64].double(), ref[:64], atol=1e-5, rtol=0)
    assert sum(p.numel() for p in m.parameters()) == 0


def test_sinusoidal_base_option_and_arbitrary_positions():
    m = make("sinusoidal", d_model=32, n_heads=4, base=500.0, scale=1.0)
    pos = torch.tensor([0, 3, 999, 17])
    pe = m.input_embedding(pos).double()
    angle = pos.double().view(-1, 1) / 500.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    torch.testing.assert_close(pe[:, 0::2], angle.sin(), atol=1e-4, rtol=0)
    torch.testing.assert_close(pe[:, 1::2], angle.cos(), atol=1e-4, rtol=0)
    torch.testing.assert_close(pe[0], torch.tensor([0.0, 1.0] * 16, dtype=torch.float64))


def test_sinusoidal_default_scale_restores_the_papers_token_to_position_ratio():
    raw = make("sinusoidal", d_model=64, n_heads=4, scale=1.0).input_embedding(torch.arange(512))
    scaled = make("sinusoidal", d_model=64, n_heads=4).input_embedding(torch.arange(512))
    torch.testing.assert_close(scaled, 0.02 * raw)
    # Paper: tokens at RMS 1 (std d^-1/2 init times sqrt(d)) against the table's RMS 1/sqrt(2).
    # Here tokens start at std 0.02 (init_std), so the scaled table must sit at 0.02/sqrt(2).
    assert scaled.pow(2).mean().sqrt().item() == pytest.approx(0.02 / 2**0.5, rel=1e-3)
    with pytest.raises(ValueError):
        make("sinusoidal", d_model=64, n_heads=4, scale=0.0)


# ----------------------------------------------------------------------------------------------
# Shaw relative
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_distance", [0, 1, 5, 16])
def test_relative_score_matches_explicit_loop(max_distance):
    B, H, T, D = 2, 3, 24, 8
    m = make("relative", d_model=H * D, n_heads=H, n_layers=2, max_distance=max_distance)
    with torch.no_grad():
        for t in m.tables:
            t.normal_()
    q, _ = qk(B=B, H=H, T=T, D=D)
    pos = torch.arange(T)
    for layer in range(2):
        dense = dense_score(m.score_term(q, pos, layer), B, H, T, q.device)
        assert dense.shape == (B, H, T, T)
        r = m.tables[layer].detach().double()
        expected = torch.zeros(B, H, T, T, dtype=torch.float64)
        for i in range(T):
            for j in range(i + 1):
                expected[:, :, i, j] = (q[:, :, i, :] * r[min(i - j, max_distance)]).sum(-1) / math.sqrt(D)
        mask = causal(T)
        assert_matches_reference(dense[..., mask], expected[..., mask], method="relative",
                                 reference="Shaw et al. eq. 5 (key term), explicit loop", atol=1e-10, rtol=1e-10)


def test_relative_clips_distances_beyond_k():
    k, T = 4, 60
    m = make("relative", d_model=32, n_heads=4, max_distance=k)
    with torch.no_grad():
        m.tables[0].normal_()
    q, _ = qk(B=1, H=4, T=T)
    dense = dense_score(m.score_term(q, torch.arange(T), 0), 1, 4, T, q.device)
    i = T - 1
    beyond = dense[0, :, i, : i - k + 1]  # distances >= k all use r_k
    torch.testing.assert_close(beyond, beyond[:, :1].expand_as(beyond))
    near = dense[0, :, i, i - k + 1 :]  # distances 0..k-1 use distinct vectors
    assert not torch.allclose(near[:, :1].expand_as(near), near)


def test_relative_tables_are_per_layer_and_default_k():
    m = make("relative", d_model=32, n_heads=4, n_layers=3)
    assert m.max_distance == 16
    assert len(m.tables) == 3 and all(t.shape == (17, 8) for t in m.tables)
    assert not torch.allclose(m.tables[0], m.tables[1])
    q, _ = qk(B=1, H=4, T=30)
    pos = torch.arange(30)
    d0 = dense_score(m.score_term(q, pos, 0), 1, 4, 30, q.device)
    d1 = dense_score(m.score_term(q, pos, 1), 1, 4, 30, q.device)
    assert not torch.allclose(d0, d1)
    with pytest.raises(ValueError):
        make("relative", max_distance=-1)


def test_relative_gradient_reaches_only_its_layer_table():
    m = make("relative", d_model=32, n_heads=4, n_layers=2, max_distance=3)
    q, _ = qk(B=1, H=4, T=12, dtype=torch.float32)
    q.requires_grad_(True)
    dense = dense_score(m.score_term(q, torch.arange(12), 1), 1, 4, 12, q.device)
    dense.masked_fill(~causal(12), 0).sum().backward()
    assert m.tables[0].grad is None or m.tables[0].grad.abs().sum() == 0
    assert m.tables[1].grad.abs().sum() > 0 and q.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# Relative methods: scores depend only on i - j
# ----------------------------------------------------------------------------------------------

RELATIVE_METHODS = methods_with(lambda cls: cls.relative_scores)


@pytest.mark.parametrize("name", RELATIVE_METHODS)
@pytest.mark.parametrize("shift", [1, 1000])
def test_scores_invariant_to_absolute_shift(name, shift):
    """Same content at positions p and p + shift -> the same full attention logits."""
    H, D, T = 4, 8, 200  # T > 128 exercises T5's far buckets, > 16 relative's clipping
    m = make(name, d_model=H * D, n_heads=H)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    q, k = qk(B=2, H=H, T=T, D=D, dtype=torch.float32)
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    pos = torch.arange(T)
    s0 = full_scores(m, q, k, pos)
    s1 = full_scores(m, q, k, pos + shift)
    mask = causal(T)
    atol = 2e-3 if issubclass(method_class(name), Rotary) else 1e-4  # rotary: fp32 angles at ~1200
    torch.testing.assert_close(s1[..., mask], s0[..., mask], atol=atol, rtol=1e-5)
    # and the position information is really there: not shift-invariant per key.
    assert not torch.allclose(s0[..., -1, 0], s0[..., -1, -2], atol=1e-3)


@pytest.mark.parametrize("name", ["learned", "sinusoidal"])
def test_absolute_methods_change_with_shift(name):
    m = make(name)
    pos = torch.arange(32)
    assert not torch.allclose(m.input_embedding(pos), m.input_embedding(pos + 100))
