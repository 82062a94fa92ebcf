"""ReRoPE (Su 2023, bojone/rerope) and Self-Extend (Jin et al. 2024, datamllab/LongLM) at
evaluation (posbench/model/extension.py) against their reference patches' formulas, written here with
transformers' Llama rotation, and for every rotary method against 'its own logit at the remapped
positions', one (query, key) pair at a time."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from model_checks import assert_causal_model, assert_matches_reference

import posbench
from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError
from posbench.evaluation.loss import evaluate_model, per_position_loss
from posbench.evaluation.settings import EvalConfig, ReRoPEConfig, SelfExtendConfig
from posbench.methods import ModelDims, build_method, list_methods, method_class
from posbench.methods.base import Rotary, dense_score
from posbench.model.extended_position import ExtendedPosition
from posbench.model.extension import (
    EXTENSIONS,
    Setting,
    extended,
    list_extensions,
    resolve_extensions,
)

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

C = 64
DIMS = ModelDims(d_model=32, n_heads=2, n_layers=1)  # head dim 16
ROTARY = [m for m in list_methods() if issubclass(method_class(m), Rotary)]


def extended_logits(method, name: str, T: int, q, k, options=None):
    """The logits the backends compute under extension ``name``: q'.k' / sqrt(D') + score term."""
    wrapped = EXTENSIONS[name].install(method, Setting(C, T, None, options or {}))
    positions = torch.arange(T)
    qe, ke = wrapped.rotate_qk(q, k, positions)
    logits = torch.einsum("bhid,bhjd->bhij", qe.double(), ke.double()) * qe.shape[-1] ** -0.5
    return logits + dense_score(wrapped.score_term(qe, positions, 0, k=ke), q.shape[0], q.shape[1], T, q.device).double()


def llama_rotate(x, positions, base=10000.0):
    """transformers' apply_rotary_pos_emb at (float) ``positions`` (T,)."""
    D = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = positions.double()[:, None] * inv_freq  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # (1, T, D)
    out, _ = apply_rotary_pos_emb(x.double(), x.double(), emb.cos(), emb.sin())
    return out


def causal(logits):
    T = logits.shape[-1]
    keep = torch.ones(T, T, dtype=torch.bool).tril()
    return logits[..., keep]


def qk(T, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, T, D, generator=g, dtype=torch.float64), torch.randn(2, 2, T, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("leaky", [None, 4.0])
@pytest.mark.parametrize("log_scaling", [True, False])
def test_rerope_matches_the_reference_patch(leaky, log_scaling):
    """rerope_patch.py / leaky_rerope_patch.py: q scaled by max(1, log(n+1)/log C); logits1 from q, k
    rotated at their positions, logits2 from q at w (leaky: (n + w (k - 1)) / k) and k unrotated
    (leaky: at m / k); logits1 where |n - m| < w, else logits2."""
    T, w = 3 * C, 8
    q, k = qk(T)
    pos = torch.arange(T)
    q_in = q * (torch.log(pos.double() + 1) / math.log(C)).clamp(min=1)[:, None] if log_scaling else q
    logits1 = llama_rotate(q_in, pos) @ llama_rotate(k, pos).transpose(-1, -2)
    if leaky is None:
        q2, k2 = llama_rotate(q_in, torch.full((T,), float(w))), k
    else:
        q2, k2 = llama_rotate(q_in, (pos.double() + w * (leaky - 1)) / leaky), llama_rotate(k, pos.double() / leaky)
    logits2 = q2 @ k2.transpose(-1, -2)
    near = (pos[:, None] - pos[None, :]).abs() < w
    expected = torch.where(near, logits1, logits2) / math.sqrt(16)
    options = {"rerope": ReRoPEConfig(window=w, leaky=leaky, log_scaling=log_scaling)}
    got = extended_logits(build_method("rope", DIMS), "rerope", T, q.float(), k.float(), options)
    assert_matches_reference(causal(got), causal(expected), method="rerope (rope)",
                             reference=f"bojone/rerope {'leaky_' if leaky else ''}rerope_patch formula"
                                       f"{'' if log_scaling else ', log_scaling=false'}", atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("window,group", [(16, 4), (12, 5), (16, 3)])
def test_self_extend_matches_longlm(window, group):
    """self_extend_patch/Llama.py: neighbour logits at the positions; group logits with the query at
    n // G + W - W / G and the key at m // G; neighbour where n - m < W (tril minus the tril
    shifted by W), group elsewhere. No query scaling (LongLM's scale_base=-1 default)."""
    T = 3 * C
    q, k = qk(T, seed=1)
    pos = torch.arange(T)
    neighbor = llama_rotate(q, pos) @ llama_rotate(k, pos).transpose(-1, -2)
    group_q = llama_rotate(q, pos // group + window - window / group)
    group_k = llama_rotate(k, pos // group)
    grouped = group_q @ group_k.transpose(-1, -2)
    mask = torch.ones(T, T).tril()
    mask[window:, :-window] -= torch.ones(T - window, T - window).tril()
    expected = torch.where(mask.bool(), neighbor, grouped) / math.sqrt(16)
    options = {"self_extend": SelfExtendConfig(window=window, group=group)}
    got = extended_logits(build_method("rope", DIMS), "self_extend", T, q.float(), k.float(), options)
    assert_matches_reference(causal(got), causal(expected), method="self_extend (rope)",
                             reference="datamllab/LongLM self_extend_patch Llama formula", atol=5e-5, rtol=1e-5)


def own_pair_logit(method, q_vec, k_vec, q_pos: float, k_pos: float) -> float:
    """The method's own logit of one query at q_pos and one key at k_pos, from a 2-token call."""
    q = q_vec.float().view(1, -1, 1, q_vec.shape[-1]).expand(1, -1, 2, -1)
    k = k_vec.float().view(1, -1, 1, k_vec.shape[-1]).expand(1, -1, 2, -1)
    qr, kr = method.rotate_qk(q, k, torch.tensor([k_pos, q_pos]))
    return (qr[0, :, 1].double() * kr[0, :, 0].double()).sum(-1) * qr.shape[-1] ** -0.5  # (H,)


@pytest.mark.parametrize("method", ROTARY)
def test_every_rotary_method_scores_far_keys_at_the_remapped_positions(method):
    """Far keys score as the method's own q.k with the query at w (rerope) / n // G + W - W / G
    (self_extend) and the key at 0 / m // G; near keys as plain. xpos's decay and pope's key
    phase bias come along."""
    torch.manual_seed(0)
    m = build_method(method, DIMS)
    for p in m.parameters():  # pope: a non-zero key phase bias
        torch.nn.init.uniform_(p, -1.0, 0.0)
    T, w, W, G = 24, 5, 8, 3
    q, k = qk(T, seed=2)
    options = {"rerope": ReRoPEConfig(window=w, log_scaling=False), "self_extend": SelfExtendConfig(window=W, group=G)}
    worst = 0.0
    for name, window, q_at, k_at in (("rerope", w, lambda n: w, lambda j: 0),
                                     ("self_extend", W, lambda n: n // G + W - W / G, lambda j: j // G)):
        got = extended_logits(m, name, T, q.float(), k.float(), options)[0]  # (H, T, T)
        for n in range(T):
            for j in range(n + 1):
                far = n - j >= window
                with torch.no_grad():
                    want = own_pair_logit(m, q[0, :, n], k[0, :, j], q_at(n) if far else n, k_at(j) if far else j)
                worst = max(worst, float((got[:, n, j] - want).detach().abs().max()))
    assert worst < 1e-4, worst


@pytest.mark.parametrize("name", ["rerope", "self_extend"])
@pytest.mark.parametrize("method", ["rope", "pope"])
def test_causal_at_four_times_the_context_and_exact_inside_the_window(name, method):
    torch.manual_seed(0)
    model = posbench.create_model(method, flavour="tiny", vocab_size=64).eval()
    idx = torch.randint(0, 64, (1, 4 * C), generator=torch.Generator().manual_seed(0))  # assert_causal_model's
    with torch.no_grad():
        plain = model(idx)
    with extended(model, name, C, 4 * C):
        a = assert_causal_model(model, 4 * C, 200)
    window = {"rerope": C // 8, "self_extend": C // 4}[name]
    torch.testing.assert_close(a[0, :window], plain[0, :window], atol=1e-5, rtol=1e-5)  # no far key yet
    assert not torch.allclose(a[0, window:], plain[0, window:])
    assert model.position.name == method and not isinstance(model.position, ExtendedPosition)


@pytest.mark.parametrize("name", ["rerope", "self_extend", "streaming_llm", "lm_infinite", "dual_chunk"])
def test_backends_agree(name):
    """Every remapping rule (these two; streaming_llm, lm_infinite, dual_chunk: test_extension_streams.py)."""
    tokens = torch.randint(0, 64, (2, 2 * C + 1), generator=torch.Generator().manual_seed(0))
    losses = []
    for backend in ("eager", "sdpa", "flex"):
        torch.manual_seed(0)
        model = posbench.create_model("rope", flavour="tiny", vocab_size=64, attention=backend).eval()
        with extended(model, name, C, 2 * C):
            losses.append(per_position_loss(model, tokens, batch_size=2, device="cpu"))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(losses[2], losses[0], rtol=1e-4, atol=1e-4)


def test_identity_while_no_key_is_far():
    m = build_method("rope", DIMS)
    assert EXTENSIONS["rerope"].install(m, Setting(C, C // 8, None)) is None
    assert EXTENSIONS["self_extend"].install(m, Setting(C, C // 4, None)) is None
    assert EXTENSIONS["rerope"].install(m, Setting(C, C // 8 + 1, None)) is not None
    # logn scaling alone past C still changes the model when the window covers the length
    opts = {"rerope": ReRoPEConfig(window=4 * C)}
    assert EXTENSIONS["rerope"].install(m, Setting(C, 2 * C, None, opts)) is not None
    assert EXTENSIONS["rerope"].install(m, Setting(C, C, None, opts)) is None


def test_menu_and_one_line_refusal_for_non_rotary_methods():
    assert {"rerope", "self_extend"} <= set(list_extensions())
    assert {"rerope", "self_extend"} <= set(resolve_extensions("all", "hope"))
    assert not {"rerope", "self_extend"} & set(resolve_extensions("all", "alibi"))
    rotary = ", ".join(ROTARY)
    with pytest.raises(PosbenchError, match=rf"^extension rerope does not apply to method=alibi; it applies to rotary methods \({rotary}\)$"):
        resolve_extensions(["rerope"], "alibi")
    lines: list[str] = []
    assert resolve_extensions(["self_extend", "window"], "t5", log=lines.append) == ["none", "window"]
    assert lines == [f"skipping extension self_extend does not apply to method=t5; it applies to rotary methods ({rotary})"]


def test_settings_are_validated_and_recorded_in_the_entries():
    e = from_section(EvalConfig, "eval", {"rerope": {"window": 16, "leaky": 8}, "self_extend": {"group": 4}})
    assert e.rerope == ReRoPEConfig(window=16, leaky=8.0) and e.self_extend == SelfExtendConfig(group=4)
    for section, match in (({"rerope": {"window": 0}}, "eval.rerope.window must be positive"),
                           ({"rerope": {"leaky": 1}}, "eval.rerope.leaky must be > 1"),
                           ({"self_extend": {"group": 0}}, "eval.self_extend.group must be positive"),
                           ({"self_extend": {"groups": 2}}, "unknown option.*eval.self_extend.groups"),
                           ({"rerope": 3}, "eval.rerope must be a mapping")):
        with pytest.raises(PosbenchError, match=match):
            from_section(EvalConfig, "eval", section)
    torch.manual_seed(0)
    model = posbench.create_model("rope", flavour="tiny", vocab_size=64).eval()
    tokens = torch.randint(0, 64, (4 * C,), generator=torch.Generator().manual_seed(0))
    evaluation = replace(e, lengths=[2 * C], num_sequences=1, batch_size=1, extension=["rerope", "self_extend"])
    entries = evaluate_model(model, tokens, evaluation, C, "cpu", log=lambda _: None)
    assert [x["extension"] for x in entries] == ["none", "rerope", "self_extend"]
    assert "extension_options" not in entries[0]
    assert entries[1]["extension_options"] == {"window": 16, "leaky": 8.0, "log_scaling": True}
    assert entries[2]["extension_options"] == {"window": C // 4, "group": 4}  # window: C / 4 by default
    assert entries[1]["extension_factor"] is None
    json.dumps(entries)  # results.json-ready
    assert len({x["bands"][f"{C}-{2 * C}"] for x in entries}) == 3


def test_entries_measured_with_other_settings_are_variants_labelled_by_them():
    """A rerope entry measured with another window never replaces the run's rerope entry: it is
    a variant labelled compactly by the settings (eval and copy probe entries alike)."""
    from posbench.evaluation.probes.merge import probe_variant_label
    from posbench.runs.entries import variant_label

    old = {"extension": "rerope", "extension_options": {"window": 32, "leaky": None, "log_scaling": True}}
    new = {"extension": "rerope", "extension_options": {"window": 16, "leaky": None, "log_scaling": True}}
    assert variant_label(new, old) == "extension_options=window:16/leaky:None/log_scaling:True"
    assert variant_label(old, old) is None
    assert variant_label(new, {"extension": "rerope"}) is None  # an entry from before the record
    assert variant_label(new, {"extension": "none"}) is None  # other extensions: not compared
    assert probe_variant_label(new, old) == "extension_options=window:16/leaky:None/log_scaling:True"
