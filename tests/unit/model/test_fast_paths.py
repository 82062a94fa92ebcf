"""The speed options against the paths they replace, on the CPU in fp32: each must compute the same
loss and the same gradients (to rounding), and leave the default path untouched.

- ``method.fast`` of fire, sandwich, t5, relative, fox (score terms without Python loops,
  scatters or captured-buffer gathers), also through a base-wrapping method (dape over fox);
- the BlockMask built outside the compiled graph, once per (length, window, device);
- the chunked LM head + cross-entropy (``trainer.loss_chunk``);
- ``trainer.compile_mode`` wiring (the cudagraph step mark, kerple's projection outside the graph).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_checks import make_method as make
from model_checks import qk

from posbench.methods import DenseScore, dense_score
from posbench.model.attention import (
    attend,
    causal_block_mask,
    fold_key_bias,
    prebuilt_block_mask,
)
from posbench.model.transformer import ModelConfig, build_model, chunked_lm_loss, lm_loss

FAST_METHODS = ["fire", "sandwich", "t5", "relative", "fox"]
REPO = Path(__file__).resolve().parents[3]


def tiny_model(method: str, attention: str = "eager", **options):
    torch.manual_seed(0)
    cfg = ModelConfig(flavour="tiny", vocab_size=64, d_model=32, n_layers=2, n_heads=4, attention=attention)
    return build_model(cfg, method, options)


def loss_and_grads(model, idx, positions=None):
    model.zero_grad(set_to_none=True)
    loss = model(idx, positions, targets=idx.roll(-1, dims=1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_training(method, attention, positions=None, base_options=None, **fast_options):
    """Loss and every gradient of the fast path equal the reference's to fp32 rounding."""
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = tiny_model(method, attention, **(base_options or {}))
    fast = tiny_model(method, attention, **(base_options or {}), **fast_options)
    fast.load_state_dict(ref.state_dict())  # the same weights (build_model also draws them alike)
    ref_loss, ref_grads = loss_and_grads(ref, idx, positions)
    fast_loss, fast_grads = loss_and_grads(fast, idx, positions)
    torch.testing.assert_close(fast_loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert fast_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-6, msg=f"{method}: {name}")
    return ref, fast


@pytest.mark.parametrize("method", FAST_METHODS)
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_fast_score_terms_train_as_the_reference(method, attention):
    if method == "relative" and attention == "sdpa":  # its value term is eager only
        assert_same_training(method, attention, base_options={"value_term": False}, fast=True)
        return
    ref, fast = assert_same_training(method, attention, fast=True)
    assert not ref.position.fast and fast.position.fast


@pytest.mark.parametrize("method", ["fire", "sandwich", "t5", "relative"])
def test_fast_score_terms_follow_per_sequence_positions(method):
    """Randomized positions (B, T): the fast grids read positions, not sequence indices."""
    gen = torch.Generator().manual_seed(3)
    positions = torch.sort(torch.randperm(90, generator=gen)[:48].view(2, 24), dim=1).values
    assert_same_training(method, "eager", positions=positions, fast=True)


def test_a_base_wrapper_builds_fox_on_its_reference_path():
    """dape feeds fox's score term through its MLP, where the query side does not cancel: its
    base is always built with the default options, so never without the score term."""
    inner = tiny_model("dape", "eager", base="fox").position.inner
    assert not inner.fast and inner.has_score_term and inner.key_bias(torch.zeros(1, 3, 32), 0) is None


def test_fast_t5_bias_is_the_gather_bitwise():
    m, fast = make("t5"), make("t5", fast=True)
    fast.load_state_dict(m.state_dict())
    q, _ = qk(B=1, H=4, T=40, dtype=torch.float32)
    ref = dense_score(m.score_term(q, torch.arange(40), 0), 1, 4, 40, q.device)
    grid = fast.score_term(q, torch.arange(40), 0)
    assert isinstance(grid, DenseScore)
    assert torch.equal(dense_score(grid, 1, 4, 40, q.device), ref)


def test_dense_score_grid_reads_element_by_element_as_flex_does():
    m = make("sandwich", fast=True)
    q, _ = qk(B=1, H=4, T=12, dtype=torch.float32)
    grid = m.score_term(q, torch.arange(12), 0)
    dense = dense_score(grid, 1, 4, 12, q.device)
    assert grid(torch.tensor(0), torch.tensor(2), torch.tensor(7), torch.tensor(3)) == dense[0, 2, 7, 3]


def test_fox_fast_drops_exactly_the_query_side_term():
    """softmax_j(s_ij + c_i - c_j) = softmax_j(s_ij - c_j): attention outputs agree in eager and
    in sdpa (the bias folded into key channels), also with a window."""
    B, H, T, D = 2, 4, 20, 8
    m = make("fox", d_model=32, n_heads=H)
    q, k = qk(B=B, H=H, T=T, D=D, dtype=torch.float32)
    v = torch.randn(B, H, T, D)
    x = torch.randn(B, T, 32)
    reference = attend(q, k, v, m.score_term(q, torch.arange(T), 0, x=x), "eager")
    m.fast = True
    bias = m.key_bias(x, 0)
    for backend in ("eager", "sdpa"):
        torch.testing.assert_close(attend(q, k, v, None, backend, key_bias=bias), reference, rtol=1e-5, atol=1e-5)
    m.fast = False
    windowed = attend(q, k, v, m.score_term(q, torch.arange(T), 0, x=x), "eager", window=5)
    torch.testing.assert_close(attend(q, k, v, None, "sdpa", window=5, key_bias=bias), windowed, rtol=1e-5, atol=1e-5)


def test_fold_key_bias_keeps_a_large_bias_under_bf16():
    """The high/low split keeps a bias of ~100 to ~2^-16 relative; one bf16 channel would not."""
    q = torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16)
    k = torch.zeros_like(q)
    bias = torch.tensor([[[-100.3, -57.77, -3.1, 0.0]]])
    q2, k2, v2, scale = fold_key_bias(q, k, q, bias)
    assert q2.shape[-1] % 8 == 0 and k2.shape == q2.shape == v2.shape
    logits = (q2.float() @ k2.float().transpose(-1, -2)) * scale  # every query row: the bias
    torch.testing.assert_close(logits[0, 0, 0], bias[0, 0], rtol=2e-5, atol=1e-4)
    single = (bias * 8**0.5).to(torch.bfloat16).float() / 8**0.5
    assert (single - bias).abs().max() > 0.05  # what one channel would have lost


# ---------------------------------------------------------------------------------- BlockMask


@pytest.mark.skipif(not hasattr(torch.nn.attention, "flex_attention"), reason="needs FlexAttention")
def test_prebuilt_block_mask_is_the_cached_mask_and_equal_to_a_fresh_one():
    causal_block_mask.cache_clear()
    first = prebuilt_block_mask(256, "cpu", 64)
    assert prebuilt_block_mask(256, "cpu", 64) is first  # reused, not rebuilt
    assert causal_block_mask.cache_info().misses == 1
    fresh = causal_block_mask.__wrapped__(256, "cpu", 64)
    assert torch.equal(first.to_dense(), fresh.to_dense())
    assert prebuilt_block_mask(256, "cpu", None) is not first  # one per window


@pytest.mark.skipif(not hasattr(torch.nn.attention, "flex_attention"), reason="needs FlexAttention")
def test_prebuilt_block_mask_runs_outside_a_compiled_forward_on_every_call():
    """Compiled, the call is not traced into the graph: every forward reads the cache at run time."""
    causal_block_mask.cache_clear()
    masks = []

    @torch.compile(backend="eager", fullgraph=False)
    def forward(x):
        masks.append(prebuilt_block_mask(128, "cpu", None))
        return x * 2

    for _ in range(3):
        forward(torch.ones(3))
    info = causal_block_mask.cache_info()
    assert (info.misses, info.hits) == (1, 2)
    assert masks[0] is masks[1] is masks[2]


# ---------------------------------------------------------------------------- chunked LM head


@pytest.mark.parametrize("chunk", [1, 7, 48, 1000])
def test_chunked_lm_loss_equals_cross_entropy_values_and_gradients(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 24, 16, generator=gen, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (2, 24), generator=gen)
    targets[0, :5] = -100  # unscored (a task's non-answer positions)
    expected = F.cross_entropy(head(hidden).flatten(0, 1), targets.flatten())
    grads = torch.autograd.grad(expected, (hidden, head.weight))
    ours = chunked_lm_loss(hidden, head.weight, targets, chunk)
    ours_grads = torch.autograd.grad(ours, (hidden, head.weight))
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip(ours_grads, grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)


def test_chunked_lm_loss_with_nothing_scored_is_zero_like_lm_loss():
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    head = torch.nn.Linear(8, 10, bias=False)
    targets = torch.full((1, 4), -100)
    ours = chunked_lm_loss(hidden, head.weight, targets, 3)
    assert ours.item() == 0.0 == lm_loss(hidden, head, targets).item()
    ours.backward()
    assert (hidden.grad == 0).all()


def test_model_loss_chunk_switch_trains_as_the_default():
    ref, fast = tiny_model("rope"), tiny_model("rope")
    fast.load_state_dict(ref.state_dict())
    fast.loss_chunk = 10
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    (ref_loss, ref_grads), (loss, grads) = loss_and_grads(ref, idx), loss_and_grads(fast, idx)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------------------ compile modes


def trainer_config(**values):
    from posbench.train.settings import TrainerConfig

    cfg = TrainerConfig(**values)
    cfg.validate()
    return cfg


def test_a_cuda_graph_compile_mode_off_cuda_is_one_line():
    from posbench.core.errors import PosbenchError
    from posbench.train.optim import TrainStep

    model = tiny_model("rope")
    t = trainer_config(compile="true", compile_mode="reduce-overhead")
    with pytest.raises(PosbenchError, match="compile_mode=reduce-overhead captures CUDA graphs"):
        TrainStep(model, t, torch.device("cpu"), 10)
    # Left at auto, nothing is compiled on a CPU: the mode was accepted silently and recorded as if used.
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(PosbenchError, match=f"compile_mode={mode} captures CUDA graphs and needs a CUDA device, "
                                                r"not cpu \(trainer.compile=auto compiles only on CUDA\)"):
            TrainStep(model, trainer_config(compile="auto", compile_mode=mode), torch.device("cpu"), 10)
    TrainStep(model, trainer_config(compile="false", compile_mode="reduce-overhead"), torch.device("cpu"), 10)  # said off
    TrainStep(model, trainer_config(compile="auto", compile_mode="max-autotune-no-cudagraphs"), torch.device("cpu"), 10)
    with pytest.raises(PosbenchError, match="trainer.compile_mode must be one of"):
        trainer_config(compile_mode="fast")


def test_default_compile_mode_is_plain_torch_compile(monkeypatch):
    from posbench.train.optim import compile_model

    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append(kwargs) or model)
    model = tiny_model("rope")
    compile_model(model, "default")
    compile_model(model, "max-autotune-no-cudagraphs")
    assert calls == [{}, {"mode": "max-autotune-no-cudagraphs"}]


def test_cuda_graph_step_marks_every_micro_batch_and_keeps_no_graph_output(monkeypatch):
    from posbench.train.optim import TrainStep

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(len(marks)))
    model = tiny_model("rope")
    step = TrainStep(model, trainer_config(compile="false"), torch.device("cpu"), 10)
    idx = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(1))
    outputs = []

    def micro_loss(i):
        outputs.append(model(idx[2 * i:2 * i + 2], targets=idx[2 * i:2 * i + 2].roll(-1, 1)))
        return outputs[-1]

    step(micro_loss, accum=2)
    assert marks == []  # not a CUDA-graph mode: no marks
    step.cuda_graphs = True
    loss = step(micro_loss, accum=2)
    assert marks == [0, 1]
    assert all(loss.data_ptr() != out.data_ptr() for out in outputs)  # the sum is a tensor of its own


@pytest.mark.slow
def test_kerple_projects_before_the_step_and_not_inside_a_compiled_forward():
    from posbench.train.optim import TrainStep

    model = tiny_model("kerple", "sdpa")
    with torch.no_grad():
        model.position.r1.fill_(-1.0)
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # fullgraph: no graph break either
    compiled(idx, targets=idx)
    assert (model.position.r1 == -1.0).all()  # the compiled forward mutated nothing
    step = TrainStep(model, trainer_config(compile="false", lr=1e-9), torch.device("cpu"), 10)
    step(lambda i: compiled(idx, targets=idx))
    torch.testing.assert_close(model.position.r1.detach(), torch.full_like(model.position.r1, 0.01))  # projected first


@pytest.mark.slow
def test_kerple_default_compile_keeps_the_eager_numbers():
    """The projection moved out of the graph: a compiled step computes what eager computes."""
    eager, compiled = tiny_model("kerple", "sdpa"), tiny_model("kerple", "sdpa")
    compiled.load_state_dict(eager.state_dict())
    with torch.no_grad():
        for m in (eager, compiled):
            m.position.r2.fill_(-3.0)  # out of range: projected to 0.01 before use
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    runner = torch.compile(compiled, backend="eager")
    compiled.position.before_step()
    torch.testing.assert_close(runner(idx, targets=idx), eager(idx, targets=idx), rtol=0, atol=0)


# ------------------------------------------------------------------------------- speed script


def run_speed(tmp_path, *extra):
    out = tmp_path / "speed.json"
    cmd = [sys.executable, str(REPO / "scripts" / "speed.py"), "--model", "tiny", "--batch-size", "2", "--context",
           "16", "--vocab-size", "64", "--warmup", "1", "--steps", "2", "--rounds", "2", "--no-compile",
           "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    return done, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.slow
def test_speed_script_times_interleaved_variants_and_profiles_one(tmp_path):
    done, report = run_speed(tmp_path, "--methods", "rope,fox", "--options", "base,fast+chunk=8",
                             "--profile", "fox:default:fast+chunk=8")
    assert done.returncode == 0, done.stderr
    assert set(report["variants"]) == {"rope:default:base", "fox:default:base", "fox:default:fast+chunk=8"}
    for result in report["variants"].values():
        assert result["steps_timed"] == 4 and result["step_ms_median"] > 0 and math.isfinite(result["final_loss"])
    assert report["skipped"] == [{"variant": "rope:default:fast+chunk=8", "reason": "rope has no fast option"}]
    assert report["profile"]["variant"] == "fox:default:fast+chunk=8" and report["profile"]["host_ops_per_step"] > 0
    assert "| fox:default:fast+chunk=8 |" in done.stdout


@pytest.mark.slow
def test_speed_script_skips_and_lists_what_does_not_fit_its_budget(tmp_path):
    done, report = run_speed(tmp_path, "--methods", "rope,alibi,nope", "--budget-s", "0")
    assert done.returncode == 0, done.stderr
    assert list(report["variants"]) == ["rope:default:base"]  # the first always runs
    assert [s["variant"] for s in report["skipped"]] == ["alibi:default:base", "nope:default:base"]
    assert all(s["reason"].startswith("budget") for s in report["skipped"])


@pytest.mark.slow
def test_speed_script_refuses_an_unknown_option_in_one_line(tmp_path):
    done, report = run_speed(tmp_path, "--options", "turbo")
    assert done.returncode == 2 and report is None
    assert done.stderr.strip() == "speed: error: unknown speed option 'turbo'; use base, fast, chunk=N, inline_masks joined by +"


def test_compile_cache_points_inductor_and_triton_at_the_folder(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from posbench.train.optim import compile_model

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    compile_model(torch.nn.Linear(2, 2), "default", str(tmp_path / "cc"))
    assert cache_dir() == str(tmp_path / "cc")  # where Inductor reads and writes its caches
    assert Path(os.environ["TRITON_CACHE_DIR"]) == tmp_path / "cc" / "triton"


def test_a_layer_schedule_hands_over_its_fast_fox_layers_key_bias():
    """Without the delegation the schedule's fox layers would lose their whole term."""
    fox = {"method": "fox", "options": {"fast": True}}
    ref = tiny_model("layers", "sdpa", pattern=[{"method": "fox"}, "rope"])
    fast = tiny_model("layers", "sdpa", pattern=[fox, "rope"])
    fast.load_state_dict(ref.state_dict())
    assert not fast.position.has_score_term  # its only score term is now a key bias
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    (ref_loss, ref_grads), (loss, grads) = loss_and_grads(ref, idx), loss_and_grads(fast, idx)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", ["fire", "sandwich", "t5"])
def test_a_shared_fast_term_is_built_once_per_forward_for_all_layers(method, monkeypatch):
    model = tiny_model(method, "sdpa", fast=True)
    built = []
    original = type(model.position).dense_bias
    monkeypatch.setattr(type(model.position), "dense_bias", lambda self, p: built.append(p) or original(self, p))
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    model(idx, targets=idx)
    assert len(built) == 1  # not once per layer (the model has 2)
    q, _ = qk(B=1, H=4, T=24, dtype=torch.float32)
    model.position.score_term(q, torch.arange(24), 1)  # called alone (viz, probes): builds its own
    assert len(built) == 2


def test_an_evaluation_extension_keeps_fast_fox_exact_or_refuses_in_one_line():
    from posbench.core.errors import PosbenchError
    from posbench.model.extended_position import ExtendedPosition

    ref, fast = tiny_model("fox", "sdpa"), tiny_model("fox", "sdpa", fast=True)
    fast.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    for model in (ref, fast):
        model.position = ExtendedPosition(model.position, window=8)  # a mask on top: the key bias is kept
    with torch.no_grad():
        torch.testing.assert_close(fast(idx, targets=idx), ref(idx, targets=idx), rtol=1e-6, atol=1e-6)
    fast.position = ExtendedPosition(fast.position.inner, log_context=8)
    with pytest.raises(PosbenchError, match="cannot scale fox's key bias"):
        fast(idx, targets=idx)


@pytest.mark.slow
@pytest.mark.parametrize("method", FAST_METHODS)
def test_fast_paths_trace_into_one_compiled_graph(method):
    """Compiled (aot_eager: dynamo + autograd tracing, no codegen), with the chunked loss too:
    no graph break, and the same loss and gradients as eager."""
    options = {"value_term": False} if method == "relative" else {}
    model = tiny_model(method, "sdpa", fast=True, **options)
    model.loss_chunk = 10
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    eager_loss, eager_grads = loss_and_grads(model, idx)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(idx, targets=idx.roll(-1, dims=1))
    model.zero_grad(set_to_none=True)
    loss.backward()
    torch.testing.assert_close(loss.detach(), eager_loss, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        if name in eager_grads:
            torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-5, atol=1e-6)
