"""Context extension at evaluation (posbench/model/extension.py) against independent references:
transformers' Llama rotary embedding for the RoPE rules, explicit formulas for the others."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from posbench.core.errors import PosbenchError
from posbench.evaluation.loss import per_position_loss
from posbench.evaluation.settings import EvalConfig, ReRoPEConfig
from posbench.methods import ModelDims, build_method, list_methods, method_class
from posbench.methods.base import Rotary
from posbench.model.extended_position import ExtendedPosition
from posbench.model.extension import (
    EXTENSIONS,
    NONE,
    Setting,
    evaluation_order,
    extended,
    extension_factor,
    record_extension,
    resolve_extensions,
)
from posbench.model.transformer import ModelConfig, build_model

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

C = 64  # training context of these tests
DIMS = ModelDims(d_model=64, n_heads=2, n_layers=1)  # head dim 32
BASE = 10000.0


class Holder(nn.Module):
    """The part of a Transformer that `extended` touches: its ``position`` method."""

    def __init__(self, method: nn.Module) -> None:
        super().__init__()
        self.position = method


def hf_rotary(rope_parameters: dict, length: int, q: torch.Tensor, k: torch.Tensor):
    """q, k rotated by transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb."""
    head_dim = DIMS.head_dim
    shape = dict(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim, max_position_embeddings=C)
    if int(transformers.__version__.split(".")[0]) >= 5:
        config = LlamaConfig(**shape, rope_parameters={"rope_theta": BASE, **rope_parameters})
    else:
        config = LlamaConfig(**shape, rope_theta=BASE, rope_scaling=rope_parameters)
    rotary = LlamaRotaryEmbedding(config)
    position_ids = torch.arange(length)[None]  # (1, T)
    cos, sin = rotary(q, position_ids)  # (1, T, D), attention factor included
    return apply_rotary_pos_emb(q, k, cos, sin)


def ours(rule: str, length: int, q: torch.Tensor, k: torch.Tensor, factor: float | None):
    holder = Holder(build_method("rope", DIMS))
    before = holder.position.inv_freq.clone()
    with extended(holder, rule, C, length, factor):
        out = holder.position.rotate_qk(q, k, torch.arange(length))
    assert holder.position.name == "rope" and not isinstance(holder.position, ExtendedPosition)
    assert torch.equal(holder.position.inv_freq, before)  # restored
    return out


HF_RULES = {
    "linear": lambda s: {"rope_type": "linear", "factor": s},
    "yarn": lambda s: {"rope_type": "yarn", "factor": s, "original_max_position_embeddings": C},
    "llama3": lambda s: {"rope_type": "llama3", "factor": s, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": C},
}


@pytest.mark.parametrize("rule", sorted(HF_RULES))
@pytest.mark.parametrize("factor", [2.0, 3.5, 8.0])
def test_rope_rules_rotate_q_and_k_as_transformers(rule, factor):
    length = int(C * factor)
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 2, length, DIMS.head_dim).unbind(0)  # (B, H, T, D) each
    q_hf, k_hf = hf_rotary(HF_RULES[rule](factor), length, q, k)
    q_ours, k_ours = ours(rule, length, q, k, factor)
    torch.testing.assert_close(q_ours, q_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_hf, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_yarn_attention_temperature_scales_q_and_k(factor):
    """YaRN's sqrt(1/t) = 0.1 ln(s) + 1 multiplies cos and sin (so q and k) as in transformers."""
    length = int(C * factor)
    q = torch.randn(1, 1, length, DIMS.head_dim)
    holder = Holder(build_method("rope", DIMS))
    with extended(holder, "yarn", C, length, factor):
        assert holder.position.qk_scale == pytest.approx(0.1 * math.log(factor) + 1)
        scaled, _ = holder.position.rotate_qk(q, q, torch.arange(length))
        unscaled, _ = holder.position.inner.rotate_qk(q, q, torch.arange(length))
    torch.testing.assert_close(scaled, unscaled * (0.1 * math.log(factor) + 1))


@pytest.mark.parametrize("length", [2 * C, 4 * C])
def test_dynamic_ntk_matches_transformers_at_the_evaluated_length(length):
    """transformers recomputes the dynamic base from max(position_ids) + 1 = L in a full forward."""
    q, k = torch.randn(2, 1, 2, length, DIMS.head_dim).unbind(0)
    q_hf, k_hf = hf_rotary({"rope_type": "dynamic", "factor": 1.0}, length, q, k)
    q_ours, k_ours = ours("dynamic_ntk", length, q, k, None)
    torch.testing.assert_close(q_ours, q_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_hf, rtol=1e-5, atol=1e-5)
    # With its default factor 1, dynamic NTK over the whole sequence is static NTK at s = L / C.
    torch.testing.assert_close(q_ours, ours("ntk", length, q, k, None)[0])


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_ntk_is_the_ntk_aware_base_change(factor):
    """NTK-aware scaling (bloc97): plain RoPE with base * s^(D / (D - 2))."""
    length = int(C * factor)
    q, k = torch.randn(2, 1, 2, length, DIMS.head_dim).unbind(0)
    d = DIMS.head_dim
    reference = build_method("rope", DIMS, base=BASE * factor ** (d / (d - 2)))
    q_ref, k_ref = reference.rotate_qk(q, k, torch.arange(length))
    q_ours, k_ours = ours("ntk", length, q, k, factor)
    torch.testing.assert_close(q_ours, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_ref, rtol=1e-5, atol=1e-5)


def test_learned_table_is_read_by_linear_interpolation():
    method = build_method("learned", DIMS, max_positions=16)
    table = method.table.weight.detach()
    wrapped = ExtendedPosition(method, position_scale=2.5)
    got = wrapped.input_embedding(torch.arange(12))
    for n in range(12):
        p = n / 2.5
        lo = math.floor(p)
        expected = table[lo] + (p - lo) * (table[lo + 1] - table[lo])
        torch.testing.assert_close(got[n], expected)
    # Past the last trained row (here C = 4) the row never reached by training is not blended in.
    held = ExtendedPosition(method, position_scale=2.5, trained_positions=4).input_embedding(torch.arange(12))
    torch.testing.assert_close(held[:8], got[:8])  # 7 / 2.5 = 2.8 < 3
    torch.testing.assert_close(held[8:], table[3].expand(4, -1))


def test_sinusoidal_interpolation_is_the_table_at_fractional_positions():
    method = build_method("sinusoidal", DIMS)
    holder = Holder(method)
    length = 3 * C
    with extended(holder, "linear", C, length, None):  # factor L / C = 3
        got = holder.position.input_embedding(torch.arange(length))
    d = DIMS.d_model
    pos = torch.arange(length, dtype=torch.float64)[:, None] / 3
    i = torch.arange(0, d, 2, dtype=torch.float64)[None, :]
    expected = torch.zeros(length, d, dtype=torch.float64)
    expected[:, 0::2] = torch.sin(pos / BASE ** (i / d))
    expected[:, 1::2] = torch.cos(pos / BASE ** (i / d))
    torch.testing.assert_close(got, 0.02 * expected.float(), rtol=1e-5, atol=1e-6)


def _tiny(method: str, n_layers: int = 2, attention: str = "eager"):
    torch.manual_seed(0)
    cfg = ModelConfig(flavour="tiny", vocab_size=64, d_model=32, n_layers=n_layers, n_heads=2, attention=attention)
    return build_model(cfg, method).eval()


def _loss(model, tokens):
    return per_position_loss(model, tokens, batch_size=2, device="cpu")


@pytest.mark.parametrize("method", ["rope", "learned", "sinusoidal", "alibi", "nope"])
def test_factor_one_leaves_the_loss_bitwise_unchanged(method):
    model = _tiny(method)
    tokens = torch.randint(0, 64, (2, 3 * C + 1))
    plain = _loss(model, tokens)
    for name, ext in EXTENSIONS.items():
        if not ext.applies(method) or not ext.in_all:  # longrope needs a file (test_extension_streams.py)
            continue
        # Rules driven by the length (dynamic_ntk, log_scaling, window) are the identity when the
        # length does not pass the context; those with a window of exact positions of their own
        # (rerope, self_extend) when it does not pass that window.
        by_length = ext.default_factor != "L/C"
        # (dual_chunk: while the length fits its first chunk, chunk_size - local_window.)
        opts = (ext.resolved_options and ext.resolved_options(Setting(C, C, None))) or {}
        limit = opts.get("window", opts.get("chunk_size", C) - opts.get("local_window", 0))
        short = tokens[:, : limit + 1]
        with extended(model, name, C, limit if by_length else 3 * C, 1.0):
            loss = _loss(model, short if by_length else tokens)
        assert torch.equal(loss, _loss(model, short) if by_length else plain), name
        # ... and the default factor past the context does change it.
        with extended(model, name, C, 3 * C) as used:
            assert not torch.equal(_loss(model, tokens), plain), name
        assert used == {"L/C": 3.0, "1": 1.0, None: None}[ext.default_factor]


def test_window_equals_reading_only_the_last_c_tokens():
    """One layer, no position signal: with a window of C the loss at position n is the plain loss
    of the last position of tokens n - C + 1 .. n."""
    window = 8
    model = _tiny("nope", n_layers=1)
    tokens = torch.randint(0, 64, (2, 3 * window + 1))
    with extended(model, "window", window, 3 * window):
        windowed = _loss(model, tokens)
    for n in (window, 2 * window + 3, 3 * window - 1):
        alone = _loss(model, tokens[:, n - window + 1 : n + 2])
        torch.testing.assert_close(windowed[n], alone[-1], rtol=1e-9, atol=1e-6)
    assert model.position.name == "nope" and not isinstance(model.position, ExtendedPosition)


@pytest.mark.parametrize("method", ["rope", "alibi"])
def test_backends_agree_under_window_and_log_scaling(method):
    tokens = torch.randint(0, 64, (2, 2 * C + 1))
    for name in ("window", "log_scaling"):
        losses = []
        for backend in ("eager", "sdpa", "flex"):
            model = _tiny(method, attention=backend)
            with extended(model, name, C, 2 * C):
                losses.append(_loss(model, tokens))
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(losses[2], losses[0], rtol=1e-4, atol=1e-4)


def test_log_scaling_multiplies_the_whole_logit_of_late_queries():
    alibi = build_method("alibi", ModelDims(32, 2, 1))
    wrapped = ExtendedPosition(alibi, log_context=C)
    positions = torch.arange(3 * C)
    expected = torch.clamp(torch.log(positions.double() + 1) / math.log(C), min=1)
    torch.testing.assert_close(wrapped.query_scale(positions), expected.float())
    q = torch.randn(1, 2, 3 * C, 16)
    scaled_q, _ = wrapped.rotate_qk(q, q, positions)
    torch.testing.assert_close(scaled_q, q * expected.float()[:, None])
    i, j = torch.arange(3 * C).view(1, 1, -1, 1), torch.arange(3 * C).view(1, 1, 1, -1)
    h = torch.arange(2).view(1, -1, 1, 1)
    bias = alibi.score_term(q, positions, 0)(0, h, i, j)
    torch.testing.assert_close(wrapped.score_term(q, positions, 0)(0, h, i, j), bias * expected.float().view(1, 1, -1, 1))


def test_resolve_extensions_refuses_skips_and_expands_all():
    lines: list[str] = []
    assert resolve_extensions(["ntk"], "rope") == ["none", "ntk"]
    rotary = ", ".join(m for m in list_methods() if issubclass(method_class(m), Rotary))
    with pytest.raises(PosbenchError, match=rf"ntk does not apply to method=alibi; it applies to rotary methods \({rotary}\)"):
        resolve_extensions(["ntk"], "alibi")
    assert resolve_extensions(["linear", "ntk", "window"], "learned", log=lines.append) == ["none", "linear", "window"]
    assert lines == ["skipping extension ntk does not apply to method=learned; it applies to rotary methods "
                     f"({', '.join(m for m in list_methods() if issubclass(method_class(m), Rotary))})"]
    assert resolve_extensions("all", "alibi") == ["none", "log_scaling", "window"]
    assert resolve_extensions("all", "rope") == ["none", *(e for e, x in EXTENSIONS.items() if x.in_all)]
    with pytest.raises(PosbenchError, match="unknown eval.extension 'pi'"):
        resolve_extensions(["pi"], "rope")


def test_extension_factor_defaults_to_length_over_context():
    assert extension_factor("linear", 1024, 256, None) == 4.0
    assert extension_factor("yarn", 1024, 256, 2.0) == 2.0
    assert extension_factor("dynamic_ntk", 1024, 256, None) == 1.0
    assert extension_factor("window", 1024, 256, 2.0) is None
    assert extension_factor("none", 1024, 256, 2.0) is None
    with pytest.raises(PosbenchError, match="extension_factor must be >= 1"):
        extension_factor("linear", 1024, 256, 0.5)


def test_position_is_restored_when_evaluation_fails():
    model = _tiny("rope")
    original = model.position
    freq = original.inv_freq.clone()
    with pytest.raises(RuntimeError):
        with extended(model, "yarn", C, 4 * C):
            raise RuntimeError("boom")
    assert model.position is original and torch.equal(original.inv_freq, freq)


@pytest.mark.slow
def test_cli_eval_under_extensions_then_plot_the_matrix(tmp_path, trained_run):
    import json

    from helpers import QUICK_TRAIN, posbench_cli

    run = trained_run("method=rope")  # the quick rope run (test_cli.py trains one through the command line)
    # On the run's own windows (its eval.num_sequences): the extensions join its entries.
    posbench_cli("eval", f"run={run}", "eval.extension=[none,linear,ntk,yarn]", "eval.lengths=[64,128]")
    entries = json.loads((run / "results.json").read_text())["eval"]
    assert [(e["length"], e["extension"]) for e in entries] == [
        (length, ext) for length in (64, 128) for ext in ("none", "linear", "ntk", "yarn")]
    assert [e["extension_factor"] for e in entries[:4]] == [None, 2.0, 2.0, 2.0]
    assert entries[5]["extension_factor"] == 4.0
    assert len({e["bands"]["32-64"] for e in entries[:4]}) == 4  # every extension changes the loss
    # The extensions with settings of their own record them (defaults from C = 32 filled in).
    posbench_cli("eval", f"run={run}", "eval.extension=[rerope,self_extend]", "eval.lengths=[64]",
                 "eval.rerope.window=8", "eval.self_extend.group=4")
    added = [e for e in json.loads((run / "results.json").read_text())["eval"]
             if e["extension"] in ("rerope", "self_extend")]
    assert [(e["length"], e["extension"], e["extension_options"]) for e in added] == [
        (64, "rerope", {"window": 8, "leaky": None, "log_scaling": True}),
        (64, "self_extend", {"window": 8, "group": 4})]
    assert all(e["extension_factor"] is None and e["bands"]["32-64"] != entries[0]["bands"]["32-64"] for e in added)

    # An extension that does not apply is refused in one line, before any training.
    proc = posbench_cli("train", *QUICK_TRAIN, "method=alibi", "eval.extension=[ntk]",
                        f"hydra.run.dir={tmp_path / 'alibi'}", check=False)
    assert proc.returncode == 2
    rotary = ", ".join(m for m in list_methods() if issubclass(method_class(m), Rotary))
    assert proc.stderr.strip().splitlines()[-1].endswith(
        f"extension ntk does not apply to method=alibi; it applies to rotary methods ({rotary})")

    out = tmp_path / "figs"
    posbench_cli("plot", f"runs=[{run}]", f"out={out}")
    table = (out / "extensions.md").read_text()
    assert "| rope | yarn | 1 |" in table and "| rope | none | 1 |" in table and "| rope | rerope | 1 |" in table
    for name in ("extension_matrix.png", "extension_curves.png", "extensions.csv"):
        assert (out / name).stat().st_size > 0, name
    # The method comparison reads the plain entries only.
    row = next(line for line in (out / "bands.md").read_text().splitlines() if line.startswith("| rope | 1 |"))
    assert f"| {entries[0]['bands']['0-32']:.4f} ± " in row and f"| {entries[0]['bands']['32-64']:.4f} ± " in row


def test_eval_config_takes_a_name_a_list_or_all_and_refuses_unknown_names():
    from posbench.config.settings import from_section
    from posbench.evaluation.settings import EvalConfig

    assert from_section(EvalConfig, "eval", {"extension": "all"}).extension == ["all"]
    assert from_section(EvalConfig, "eval", {"extension": ["none", "yarn"]}).extension == ["none", "yarn"]
    from posbench.model.extension import check_names

    check_names(["none", "all", "yarn"])
    with pytest.raises(PosbenchError, match="unknown eval.extension 'pi'; choose from none, all, linear"):
        check_names(from_section(EvalConfig, "eval", {"extension": ["pi"]}).extension)
    with pytest.raises(PosbenchError, match="eval.extension_factor must be >= 1"):
        from_section(EvalConfig, "eval", {"extension_factor": 0.5})


@pytest.mark.parametrize("method", ["relative", "alibi"])
def test_log_scaling_scales_a_query_dependent_term_once(method):
    """The model hands score_term the q that rotate_qk already scaled; the wrapped term must be
    s(n) x the trained term of the unscaled q, not s(n)^2 x (Shaw's q_i . a_(i-j) reads q)."""
    inner = build_method(method, ModelDims(32, 2, 1), **({"value_term": False} if method == "relative" else {}))
    wrapped = ExtendedPosition(inner, log_context=C)
    positions = torch.arange(3 * C)
    q = torch.randn(1, 2, 3 * C, 16)
    scaled_q, _ = wrapped.rotate_qk(q, q, positions)
    i, j = torch.arange(3 * C).view(1, 1, -1, 1), torch.arange(3 * C).view(1, 1, 1, -1)
    h = torch.arange(2).view(1, -1, 1, 1)
    expected = inner.score_term(q, positions, 0)(0, h, i, j) * wrapped.query_scale(positions).view(1, 1, -1, 1)
    torch.testing.assert_close(wrapped.score_term(scaled_q, positions, 0)(0, h, i, j), expected)


def test_extended_score_methods_keep_the_flex_backend_on_cuda():
    """resolve_backend reads the wrapper's own has_score_term (an instance attribute), so a
    window or log_scaling on alibi stays on flex rather than materialising a dense bias."""
    from posbench.model.attention import FLEX_AVAILABLE, resolve_backend

    alibi = build_method("alibi", ModelDims(32, 2, 1))
    cuda = torch.device("cuda")
    if not FLEX_AVAILABLE:
        pytest.skip("torch without FlexAttention")
    assert resolve_backend("auto", ExtendedPosition(alibi, window=8), cuda) == resolve_backend("auto", alibi, cuda) == "flex"
    assert resolve_backend("auto", ExtendedPosition(build_method("rope", ModelDims(32, 2, 1)), window=8), cuda) == "flex"


def test_extension_cost_is_measured_against_the_plain_model_inside_the_context_too():
    """linear changes every angle, so it changes the loss inside C as well; its cost there is
    its loss minus the plain model's, not zero by construction."""
    from posbench.evaluation.loss import evaluate_model

    model = _tiny("rope")
    tokens = torch.randint(0, 64, (4 * (2 * C + 1),))
    evaluation = EvalConfig(lengths=[2 * C], num_sequences=4, batch_size=2, extension=["none", "linear"])
    plain, linear = evaluate_model(model, tokens, evaluation, C, "cpu", log=lambda _: None)
    inner = f"0-{C}"
    assert plain["cost"]["bands"][inner] == 0
    assert linear["cost"]["bands"][inner] == pytest.approx(linear["bands"][inner] - plain["bands"][inner])
    assert linear["cost"]["bands"][inner] != 0
    assert linear["windowed"]["bands"] == plain["windowed"]["bands"]  # one plain reference for both


ROTARY_METHODS = [m for m in list_methods() if issubclass(method_class(m), Rotary)]


@pytest.mark.parametrize("method", ROTARY_METHODS)
@pytest.mark.parametrize("name", ["linear", "ntk", "yarn", "llama3"])
def test_rotary_extensions_apply_to_every_rotary_method_without_touching_it(method, name):
    """Every Rotary method gets PI/NTK/YaRN/Llama 3 through a copy with new frequencies: the
    trained module's inv_freq is never changed, and pairs it leaves unrotated (p_rope's zero
    frequencies) stay unrotated."""
    holder = Holder(build_method(method, DIMS))
    trained = holder.position
    before = trained.inv_freq.clone()
    with extended(holder, name, C, 4 * C) as factor:
        assert factor == 4.0
        inner = holder.position.inner
        assert inner is not trained and type(inner) is type(trained)
        assert not torch.equal(inner.inv_freq, before)  # the extension is in force
        assert torch.equal(inner.inv_freq == 0, before == 0)  # unrotated pairs stay unrotated
        assert torch.equal(trained.inv_freq, before)  # the live module is never mutated
        q = torch.randn(1, 2, 8, 32)
        positions = torch.arange(8)
        pure_rotation = type(trained).rotate_qk is method_class("rope").rotate_qk  # xpos also scales by position
        if name == "linear" and pure_rotation:  # angles (n / s) theta: its own rotation at positions n / s
            torch.testing.assert_close(holder.position.rotate_qk(q, q, positions)[0],
                                       trained.rotate_qk(q, q, positions.float() / 4)[0], rtol=1e-5, atol=1e-5)
    assert holder.position is trained and torch.equal(trained.inv_freq, before)


def test_evaluation_order_puts_the_plain_model_first_once():
    assert evaluation_order(["yarn", NONE, "pi"]) == [NONE, "yarn", "pi"]
    assert evaluation_order([]) == [NONE]  # the plain model is always evaluated: it is the reference


def test_record_extension_stamps_the_pass_and_only_the_settings_an_extension_has():
    plain, yarn, rerope = {}, {}, {}
    record_extension(plain, NONE, None, 256, 1024)
    record_extension(yarn, "yarn", 4.0, 256, 1024)
    record_extension(rerope, "rerope", None, 256, 1024, {"rerope": ReRoPEConfig(window=64)})
    assert plain == {"extension": NONE, "extension_factor": None}
    assert yarn == {"extension": "yarn", "extension_factor": 4.0}
    assert rerope["extension"] == "rerope" and rerope["extension_options"]["window"] == 64
