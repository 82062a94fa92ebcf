"""Attention backends: eager, sdpa and flex compute the same causal attention with the same score
term, for every position method; backend resolution; a CUDA bf16 compiled-path check."""

from __future__ import annotations

import math

import pytest
import torch
from model_checks import assert_matches_reference
from model_checks import make_method as make
from torch import nn

import posbench
import posbench.model.attention as attention
from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method, dense_score
from posbench.model.attention import FLEX_AVAILABLE, attend, resolve_backend

ALL_METHODS = posbench.list_methods()
VOCAB = 128
needs_flex = pytest.mark.skipif(not FLEX_AVAILABLE, reason="FlexAttention needs torch>=2.5")


# Relative's default value term is eager-only; its key term alone runs everywhere.
BACKEND_OPTIONS = {"relative": {"value_term": False}}


def tiny(name: str, backend: str, seed: int = 0, method_options=None, **overrides):
    torch.manual_seed(seed)
    overrides.setdefault("vocab_size", VOCAB)
    if backend != "eager" and method_options is None:
        method_options = BACKEND_OPTIONS.get(name)
    return posbench.create_model(name, flavour="tiny", attention=backend, method_options=method_options, **overrides)


def twin(model, backend: str):
    """Same weights, different attention backend."""
    values = {**model.cfg.to_dict(), "attention": backend}
    options = {"value_term": model.position.use_value_term} if model.method_name == "relative" else None
    other = posbench.create_model(model.method_name, method_options=options, **values)
    other.load_state_dict(model.state_dict())
    return other.to(next(model.parameters()).dtype)


def perturb_(model: nn.Module, seed: int = 1) -> None:
    """Non-default values everywhere so position tables and norms matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g).to(device=p.device, dtype=p.dtype)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            elif name.startswith("position."):
                p.copy_(0.5 * noise)
            else:
                p.add_(2 * (p.std() if p.numel() > 1 else p.abs()) * noise)  # scalars have no std


def tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def score_for(name: str, q: torch.Tensor, positions: torch.Tensor, layer: int = 0):
    """A method's score function with randomised parameters, for q of shape (B, H, T, D)."""
    H, D = q.shape[1], q.shape[3]
    torch.manual_seed(3)
    method = build_method(name, ModelDims(d_model=H * D, n_heads=H, n_layers=2))
    with torch.no_grad():
        for p in method.parameters():
            p.normal_()
    method = method.to(q.dtype)
    q, k = method.rotate_qk(q, q, positions)
    x = torch.randn(q.shape[0], q.shape[2], H * D, generator=torch.Generator().manual_seed(4), dtype=q.dtype)
    return method.score_term(q, positions, layer, k=k, x=x) if method.has_score_term else None


def naive_attention(q, k, v, score):
    """Explicit per-query loop in float64: softmax over keys j <= i of q.k/sqrt(D) + score."""
    B, H, T, D = q.shape
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    b = torch.arange(B).view(-1, 1, 1)
    h = torch.arange(H).view(1, -1, 1)
    for i in range(T):
        j = torch.arange(i + 1)
        logits = torch.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, : i + 1]) / math.sqrt(D)
        if score is not None:
            logits = logits + score(b, h, torch.tensor(i), j.view(1, 1, -1)).double()
        out[:, :, i] = torch.einsum("bhj,bhjd->bhd", logits.softmax(-1), v[:, :, : i + 1])
    return out


def qkv(B=2, H=4, T=40, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(3))


SCORE_CASES = ["none", *ALL_METHODS]
FLEX_CASES = ["none", *(n for n in ALL_METHODS if "flex" not in build_method(n, ModelDims(32, 4, 2)).backend_limits())]
# Methods that run in sdpa (with BACKEND_OPTIONS); stick-breaking's normaliser is eager-only.
SDPA_CASES = [n for n in ALL_METHODS
              if "sdpa" not in build_method(n, ModelDims(32, 4, 2), **(BACKEND_OPTIONS.get(n) or {})).backend_limits()]


def case_score(case, q, positions):
    return None if case == "none" else score_for(case, q, positions)


# ----------------------------------------------------------------------------------------------
# attend(): every backend against the explicit loop
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", SCORE_CASES)
def test_attend_matches_naive_loop(case, dtype, backend):
    q, k, v = qkv(dtype=dtype)
    score = case_score(case, q, torch.arange(40))
    out = attend(q, k, v, score, backend)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-6  # eager computes in fp32 by design
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, score), atol=tol, rtol=tol)


@needs_flex
@pytest.mark.parametrize("case", FLEX_CASES)
def test_flex_attend_matches_naive_loop(case):
    T = 130  # not a multiple of the 128 block size: the partial last block must be masked right
    q, k, v = qkv(T=T)
    score = case_score(case, q, torch.arange(T))
    with torch.no_grad():
        out = attend(q, k, v, score, "flex")
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, score), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa", pytest.param("flex", marks=needs_flex)])
@pytest.mark.parametrize("case", ["none", "alibi", "relative"])
def test_attend_is_causal(case, backend):
    q, k, v = qkv(T=32)
    score = case_score(case, q, torch.arange(32))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 20:] += 5 * torch.randn_like(k2[:, :, 20:])
    v2[:, :, 20:] += 5 * torch.randn_like(v2[:, :, 20:])
    with torch.no_grad():
        a = attend(q, k, v, score, backend)
        b = attend(q, k2, v2, score, backend)
    torch.testing.assert_close(a[:, :, :20], b[:, :, :20], atol=0, rtol=0)
    assert not torch.allclose(a[:, :, 20:], b[:, :, 20:])
    # the first query can only see itself
    torch.testing.assert_close(a[:, :, 0], v[:, :, 0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", ["alibi", "t5", "relative"])
def test_attend_gradients_eager_vs_sdpa(case):
    q0, k0, v0 = qkv(T=24, dtype=torch.float64)
    grads = {}
    for backend in ("eager", "sdpa"):
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
        score = case_score(case, q, torch.arange(24))  # depends on q for relative
        out = attend(q, k, v, score, backend)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads[backend] = (q.grad, k.grad, v.grad)
    for ge, gs in zip(grads["eager"], grads["sdpa"], strict=True):
        assert ge.abs().sum() > 0
        torch.testing.assert_close(gs, ge, atol=1e-6, rtol=1e-5)


def test_dense_score_shapes():
    q, _, _ = qkv(B=3, H=4, T=10)
    alibi = score_for("alibi", q, torch.arange(10))
    assert dense_score(alibi, 3, 4, 10, q.device).shape == (1, 4, 10, 10)  # batch-free term
    rel = score_for("relative", q, torch.arange(10))
    assert dense_score(rel, 3, 4, 10, q.device).shape == (3, 4, 10, 10)  # content-dependent


# ----------------------------------------------------------------------------------------------
# Whole model, every method: eager == sdpa (forward and backward), flex == eager (forward)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", SDPA_CASES)
def test_model_eager_vs_sdpa(name, dtype):
    eager = tiny(name, "eager", method_options=BACKEND_OPTIONS.get(name)).to(dtype)
    perturb_(eager)
    sdpa = twin(eager, "sdpa")
    assert all(b.attn.backend == "sdpa" for b in sdpa.blocks)
    idx = tokens(2, 48)
    outs, grads = {}, {}
    for tag, model in (("eager", eager), ("sdpa", sdpa)):
        logits = model(idx)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), idx.roll(-1, 1).reshape(-1))
        loss.backward()
        outs[tag] = logits.detach()
        grads[tag] = {n: p.grad for n, p in model.named_parameters()}
    assert outs["eager"].dtype == dtype
    tol = dict(atol=2e-5, rtol=1e-4)  # eager's fp32 softmax bounds agreement even in float64
    torch.testing.assert_close(outs["sdpa"], outs["eager"], **tol)
    for pname, g in grads["eager"].items():
        assert g is not None and torch.isfinite(g).all(), pname
        scale = g.abs().max().clamp(min=1e-12)
        torch.testing.assert_close(grads["sdpa"][pname] / scale, g / scale, atol=5e-5, rtol=1e-4, msg=pname)


@needs_flex
@pytest.mark.parametrize("name", FLEX_CASES[1:])
def test_model_flex_vs_eager_forward(name):
    """FlexAttention has no CPU backward, so forward only (under no_grad)."""
    T = 64
    eager = tiny(name, "eager", method_options=BACKEND_OPTIONS.get(name)).eval()
    perturb_(eager)
    flex = twin(eager, "flex").eval()
    idx = tokens(2, T)
    with torch.no_grad():
        a, b = eager(idx), flex(idx)
    assert a.abs().max() > 0.1
    torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ALL_METHODS)
def test_model_auto_on_cpu_is_sdpa(name):
    """auto on the CPU is sdpa, or eager for a method that cannot run in sdpa."""
    auto = tiny(name, "auto").eval()
    perturb_(auto)
    sdpa = twin(auto, "sdpa" if "sdpa" not in auto.position.backend_limits() else "eager").eval()
    idx = tokens(1, 33)
    with torch.no_grad():
        torch.testing.assert_close(auto(idx), sdpa(idx), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# Backend resolution
# ----------------------------------------------------------------------------------------------

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("has_score_term", [False, True])
def test_resolve_auto_cpu_is_sdpa(has_score_term):
    assert resolve_backend("auto", has_score_term, CPU) == "sdpa"


def test_resolve_auto_cuda():
    expected = "flex" if FLEX_AVAILABLE else "sdpa"
    assert resolve_backend("auto", True, CUDA) == expected
    assert resolve_backend("auto", False, CUDA) == "sdpa"  # fused is_causal kernels


@pytest.mark.parametrize("name", ["eager", "sdpa", pytest.param("flex", marks=needs_flex)])
@pytest.mark.parametrize("device", [CPU, CUDA])
def test_resolve_explicit_passes_through(name, device):
    assert resolve_backend(name, True, device) == name
    assert resolve_backend(name, False, device) == name


@pytest.mark.parametrize("bad", ["flash", "", "SDPA", "math"])
def test_resolve_unknown_backend(bad):
    with pytest.raises(PosbenchError, match="eager, sdpa, flex"):
        resolve_backend(bad, True, CPU)


def test_resolve_without_flex(monkeypatch):
    monkeypatch.setattr(attention, "FLEX_AVAILABLE", False)
    with pytest.raises(PosbenchError, match="sdpa"):
        resolve_backend("flex", True, CPU)
    assert resolve_backend("auto", True, CUDA) == "sdpa"


# ----------------------------------------------------------------------------------------------
# CUDA: compiled bf16 flex / sdpa vs fp32 eager (run on the GPU machine)
# ----------------------------------------------------------------------------------------------


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["sdpa", pytest.param("flex", marks=needs_flex), "eager"])
@pytest.mark.parametrize("name", ALL_METHODS)
def test_cuda_compiled_bf16_matches_fp32_eager(name, backend):
    torch._dynamo.reset()
    ref = tiny(name, "eager", method_options=BACKEND_OPTIONS.get(name), vocab_size=512).cuda()
    limits = ref.position.backend_limits()
    if backend in limits:
        pytest.skip(f"{name} cannot run under {backend}")
    if backend == "eager" and not {"sdpa", "flex"} <= set(limits):
        pytest.skip(f"compiled eager is checked only where auto picks it ({name} has a fused backend)")
    perturb_(ref)
    fast = twin(ref, backend).cuda()
    compiled = torch.compile(fast)
    preferred = "flex" if ref.position.has_score_term and FLEX_AVAILABLE else "sdpa"
    assert resolve_backend("auto", ref.position, torch.device("cuda")) == next(
        b for b in (preferred, "sdpa", "eager") if b not in limits
    )
    T = 256
    idx = torch.randint(0, 512, (2, T), generator=torch.Generator().manual_seed(0)).cuda()
    target = idx.roll(-1, 1)

    logits_ref = ref(idx)
    nn.functional.cross_entropy(logits_ref.reshape(-1, 512), target.reshape(-1)).backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = compiled(idx)
    nn.functional.cross_entropy(logits.float().reshape(-1, 512), target.reshape(-1)).backward()

    assert torch.isfinite(logits).all()
    assert _rel_err(logits, logits_ref) < 2e-2, f"logits rel err {_rel_err(logits, logits_ref):.3g}"
    ref_grads = dict(ref.named_parameters())
    for pname, p in fast.named_parameters():
        g, g_ref = p.grad, ref_grads[pname].grad
        assert g is not None and torch.isfinite(g).all(), pname
        if g_ref.norm() > 0:
            assert _rel_err(g, g_ref) < 0.1, f"{pname}: grad rel err {_rel_err(g, g_ref):.3g}"
    # Beyond the training length, forward only (also a non-multiple of the 128 flex block).
    long_idx = torch.randint(0, 512, (1, 520), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(long_idx)
        ref_out = ref(long_idx)
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref_out) < 2e-2, f"T=520 logits rel err {_rel_err(out, ref_out):.3g}"


# ---------------------------------------------------------------------------- backends and window


def test_cope_refuses_flex_in_one_line_and_auto_avoids_it():
    m = make("cope")
    with pytest.raises(PosbenchError, match="model.attention=flex cannot run method=cope: .*dense"):
        resolve_backend("flex", m, CUDA)
    assert resolve_backend("auto", m, CUDA) == "sdpa"


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("case", ["none", "alibi"])
def test_window_matches_naive_masked_loop(backend, case):
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




# ----------------------------------------------------------------------- flex gradients (CUDA only)

# Options that let a method's score term run in flex (relative's value term needs eager).
FLEX_OPTIONS = {"relative": {"value_term": False}}


def _learnable_in_flex(name: str) -> bool:
    method = build_method(name, ModelDims(32, 4, 2), **FLEX_OPTIONS.get(name, {}))
    return method.has_score_term and any(True for _ in method.parameters()) and "flex" not in method.backend_limits()


LEARNABLE_SCORE_METHODS = [(n, FLEX_OPTIONS.get(n, {})) for n in ALL_METHODS if _learnable_in_flex(n)]


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
