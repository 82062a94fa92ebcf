"""StreamingLLM, LM-Infinite, Dual Chunk Attention and LongRoPE at evaluation
(posbench/model/extension_rules.py) against their references: StreamingLLM and LM-Infinite against
their papers' rules written here as a naive per-query loop (StreamingLLM: the reference's start +
recent KV cache simulated token by token, keys rotated at their index in the cache; LM-Infinite:
the Λ mask and the stationary query at the distance limit with unrotated global keys), Dual Chunk
Attention as the reference computes it (chunk by chunk, three attentions merged by their
log-sum-exp), LongRoPE against transformers' Phi-3 rotary embedding. Each reference test also runs a mutated implementation, which must fail it."""

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
from posbench.evaluation.loss import evaluate_model
from posbench.evaluation.settings import (
    DualChunkConfig,
    EvalConfig,
    LMInfiniteConfig,
    LongRoPEConfig,
    StreamingLLMConfig,
)
from posbench.methods import ModelDims, build_method
from posbench.methods.base import dense_score
from posbench.model import extension_rules
from posbench.model.extended_position import ExtendedPosition
from posbench.model.extension import EXTENSIONS, Setting, extended, resolve_extensions

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

C = 64
D = 16
DIMS = ModelDims(d_model=32, n_heads=2, n_layers=1)  # head dim 16


def llama_rotate(x, positions, base=10000.0):
    """transformers' apply_rotary_pos_emb at ``positions`` (T,)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = positions.double()[:, None] * inv_freq  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # (1, T, D)
    out, _ = apply_rotary_pos_emb(x.double(), x.double(), emb.cos(), emb.sin())
    return out


def qk(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, T, D, generator=g, dtype=torch.float64),
            torch.randn(2, 2, T, D, generator=g, dtype=torch.float64))


def extended_probs(name: str, T: int, q, k, options) -> torch.Tensor:
    """The attention probabilities the backends compute under extension ``name``:
    softmax(q'.k' / sqrt(D) + score term) over the causal keys. (B, H, T, T)."""
    wrapped = EXTENSIONS[name].install(build_method("rope", DIMS), Setting(C, T, None, options))
    positions = torch.arange(T)
    qe, ke = wrapped.rotate_qk(q.float(), k.float(), positions)
    logits = torch.einsum("bhid,bhjd->bhij", qe.double(), ke.double()) * D**-0.5
    logits = logits + dense_score(wrapped.score_term(qe, positions, 0, k=ke), 2, 2, T, q.device).double()
    return logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)


def streaming_reference(q, k, sinks: int, recent: int) -> torch.Tensor:
    """StreamingLLM token by token: before each token the cache is evicted to the first ``sinks``
    and the last ``recent - 1`` entries (StartRecentKVCache.evict_for_space, num_coming=1), the
    token is appended, keys are rotated at their index in the cache and the query at the last."""
    B, H, T, _ = q.shape
    probs = torch.zeros(B, H, T, T, dtype=torch.float64)
    cache: list[int] = []
    for n in range(T):
        if len(cache) + 1 > sinks + recent:
            cache = cache[:sinks] + cache[len(cache) - recent + 1:]
        cache.append(n)
        keys = llama_rotate(k[..., cache, :], torch.arange(len(cache)))
        query = llama_rotate(q[..., n:n + 1, :], torch.tensor([len(cache) - 1]))
        probs[..., n, cache] = ((query @ keys.transpose(-1, -2)) / math.sqrt(D)).softmax(-1)[..., 0, :]
    return probs


def lm_infinite_reference(q, k, global_tokens: int, window: int) -> torch.Tensor:
    """LM-Infinite one query at a time: keys at distance < window rotated at their positions;
    beyond it only the first ``global_tokens`` keys, unrotated, against the query rotated at the
    distance limit (min(window, T - 1), as the reference's effective limit)."""
    B, H, T, _ = q.shape
    logits = torch.full((B, H, T, T), float("-inf"), dtype=torch.float64)
    positions = torch.arange(T)
    q_rot, k_rot = llama_rotate(q, positions), llama_rotate(k, positions)
    q_stationary = llama_rotate(q, torch.full((T,), min(window, T - 1)))
    for n in range(T):
        keys = positions[: n + 1]
        local = q_rot[..., n, None, :] @ k_rot[..., : n + 1, :].transpose(-1, -2)  # (B, H, 1, n + 1)
        far = q_stationary[..., n, None, :] @ k[..., : n + 1, :].transpose(-1, -2)
        row = torch.where(n - keys < window, local, torch.where(keys < global_tokens, far, float("-inf")))
        logits[..., n, : n + 1] = row[..., 0, :] / math.sqrt(D)
    return logits.softmax(-1)


def matches_or_mutant(got, expected, mutation, **names) -> None:
    """The implementation matches the reference; a mutated one (``mutation`` named) does not."""
    if mutation is not None:
        assert not torch.allclose(got, expected, atol=1e-4), mutation
    else:
        assert_matches_reference(got, expected, **names, atol=2e-5, rtol=1e-5)


def mutated(monkeypatch, change):
    """extension_rules builds its ExtendedPosition with ``change`` applied to the arguments."""
    monkeypatch.setattr(extension_rules, "ExtendedPosition", lambda m, **kw: ExtendedPosition(m, **change(kw)))


STREAMING_MUTATIONS = {
    "no sinks": lambda kw: {**kw, "sinks": 0},
    "recent window one longer": lambda kw: {**kw, "window": kw["window"] + 1},
    "sinks at their own distance (no re-assignment)": lambda kw: {**kw, "remap": None},
}


@pytest.mark.parametrize("mutation", [None, *STREAMING_MUTATIONS])
@pytest.mark.parametrize("sinks,recent", [(4, C - 4), (2, 9)])
def test_streaming_llm_matches_the_reference_cache(sinks, recent, mutation, monkeypatch):
    """Past C (T = 3C), every query's attention equals the reference's over its evicted cache."""
    T = 3 * C
    q, k = qk(T)
    expected = streaming_reference(q, k, sinks, recent)
    if mutation is not None:
        mutated(monkeypatch, STREAMING_MUTATIONS[mutation])
    got = extended_probs("streaming_llm", T, q, k, {"streaming_llm": StreamingLLMConfig(sinks=sinks, window=recent)})
    matches_or_mutant(got, expected, mutation, method="streaming_llm (rope)",
                      reference="mit-han-lab/streaming-llm start+recent cache with pos_shift")


LM_INFINITE_MUTATIONS = {
    "no global tokens": lambda kw: {**kw, "sinks": 0},
    "local window one shorter": lambda kw: {**kw, "window": kw["window"] - 1},
    "global tokens at their own distance (no cap)": lambda kw: {**kw, "remap": None},
}


@pytest.mark.parametrize("mutation", [None, *LM_INFINITE_MUTATIONS])
@pytest.mark.parametrize("global_tokens,window", [(10, C), (3, 17)])
def test_lm_infinite_matches_the_reference_lambda_attention(global_tokens, window, mutation, monkeypatch):
    T = 3 * C
    q, k = qk(T, seed=1)
    expected = lm_infinite_reference(q, k, global_tokens, window)
    if mutation is not None:
        mutated(monkeypatch, LM_INFINITE_MUTATIONS[mutation])
    got = extended_probs("lm_infinite", T, q, k, {"lm_infinite": LMInfiniteConfig(global_tokens=global_tokens,
                                                                                   window=window)})
    matches_or_mutant(got, expected, mutation, method="lm_infinite (rope)",
                      reference="Glaciohound/LM-Infinite lambda attention, limit_distance = local_branch")


def chunkllama_reference(q, k, v, chunk_size: int, local_window: int) -> torch.Tensor:
    """ChunkLlama's forward without a cache: chunks of L = s - w queries; each attends to its own
    chunk causally (query and keys at position % L), to the previous chunk with the query at
    min(n % L + L, s), to every older key with the query at min(2L - 1, s); the parts' outputs
    merged with weights exp(lse_i) / sum exp(lse). -> (B, H, T, D)."""
    T = q.shape[-2]
    L = chunk_size - local_window
    pos = torch.arange(T)
    keys = llama_rotate(k, pos % L)
    q_intra = llama_rotate(q, pos % L)
    q_succ = llama_rotate(q, (pos % L + L).clamp(max=chunk_size))
    q_inter = llama_rotate(q, torch.full((T,), min(2 * L - 1, chunk_size)))

    def attend(qs, ks, vs, causal):
        logits = qs @ ks.transpose(-1, -2) / math.sqrt(D)
        if causal:
            logits = logits.masked_fill(torch.ones(logits.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        return logits.softmax(-1) @ vs, logits.logsumexp(-1)

    outputs = []
    for begin in range(0, T, L):
        end = min(begin + L, T)
        parts = [attend(q_intra[..., begin:end, :], keys[..., begin:end, :], v[..., begin:end, :], True)]
        if begin >= L:
            parts.append(attend(q_succ[..., begin:end, :], keys[..., begin - L:begin, :], v[..., begin - L:begin, :], False))
        if begin >= 2 * L:
            parts.append(attend(q_inter[..., begin:end, :], keys[..., :begin - L, :], v[..., :begin - L, :], False))
        weights = torch.stack([lse for _, lse in parts]).softmax(0)  # exp(lse_i) / sum_i exp(lse_i)
        outputs.append(sum(w[..., None] * out for w, (out, _) in zip(weights, parts)))
    return torch.cat(outputs, dim=-2)


DUAL_CHUNK_MUTATIONS = {
    "successive queries not capped at s": lambda w, L, s: (w, w + L, torch.full_like(w, float(min(2 * L - 1, s)))),
    "inter queries at the successive positions": lambda w, L, s: (w, (w + L).clamp(max=s), (w + L).clamp(max=s)),
    "intra queries half a chunk off": lambda w, L, s: (w + L * 0.5, (w + L).clamp(max=s),
                                                             torch.full_like(w, float(min(2 * L - 1, s)))),
}


@pytest.mark.parametrize("mutation", [None, *DUAL_CHUNK_MUTATIONS])
@pytest.mark.parametrize("chunk_size,local_window", [(None, None), (20, 6)])
def test_dual_chunk_matches_chunkllama(chunk_size, local_window, mutation, monkeypatch):
    """Past C (T = 3C, five chunks at the defaults s = 48, w = 4): the attention output equals the
    reference's three-part, log-sum-exp-merged attention."""
    T = 3 * C
    q, k = qk(T, seed=3)
    v = torch.randn(2, 2, T, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    options = {"dual_chunk": DualChunkConfig(chunk_size=chunk_size, local_window=local_window)}
    s, w = chunk_size or C * 3 // 4, local_window or C // 16
    expected = chunkllama_reference(q, k, v, s, w)
    if mutation is not None:
        change = DUAL_CHUNK_MUTATIONS[mutation]
        monkeypatch.setattr(extension_rules.DualChunk, "query_positions", lambda self, pos: change(
            torch.remainder(pos, self.chunk_len).double(), self.chunk_len, self.chunk_size))
    got = extended_probs("dual_chunk", T, q, k, options) @ v
    matches_or_mutant(got, expected, mutation, method="dual_chunk (rope)",
                      reference="HKUNLP/ChunkLlama chunkllama_attn_replace forward, lse merge")


def factor_file(tmp_path, frequencies=D // 2, seed=0, as_config=True) -> str:
    g = torch.Generator().manual_seed(seed)
    short = (1 + 0.2 * torch.rand(frequencies, generator=g)).tolist()
    long = (1 + 15 * torch.rand(frequencies, generator=g).sort().values).tolist()
    block = {"type": "longrope", "short_factor": short, "long_factor": long}
    path = tmp_path / "factors.json"
    path.write_text(json.dumps({"rope_scaling": block} if as_config else block))
    return str(path)


def phi3_rotate(x, path: str, length: int, factor: float):
    """transformers' Phi-3 rotary embedding with the factor file, max_position_embeddings =
    factor * C (so its attention factor is sqrt(1 + ln factor / ln C)), applied to x (B, H, T, D)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

    block = json.loads(open(path).read())["rope_scaling"]
    config = Phi3Config(hidden_size=D, num_attention_heads=1, num_key_value_heads=1,
                        max_position_embeddings=round(factor * C), original_max_position_embeddings=C,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                         "short_factor": block["short_factor"], "long_factor": block["long_factor"],
                                         "original_max_position_embeddings": C})
    rotary = Phi3RotaryEmbedding(config)
    cos, sin = rotary(x.float(), torch.arange(length)[None])
    out, _ = phi3_apply(x.float(), x.float(), cos, sin)
    return out


@pytest.mark.parametrize("mutation", [None, "short and long swapped"])
@pytest.mark.parametrize("length,factor", [(4 * C, 4.0), (C, 4.0), (2 * C, 32.0)])
def test_longrope_matches_transformers_phi3(tmp_path, length, factor, mutation, monkeypatch):
    """q and k rotated as Phi-3's rotary embedding does: long factors past C, short ones inside,
    cos and sin times sqrt(1 + ln s / ln C)."""
    path = factor_file(tmp_path)
    q, k = qk(length, seed=2)
    if mutation is not None:
        read = extension_rules.read_factors
        monkeypatch.setattr(extension_rules, "read_factors", lambda p, n: read(p, n)[::-1])
    wrapped = EXTENSIONS["longrope"].install(build_method("rope", DIMS),
                                             Setting(C, length, factor, {"longrope": LongRoPEConfig(factors=path)}))
    got_q, got_k = wrapped.rotate_qk(q.float(), k.float(), torch.arange(length))
    want_q, want_k = phi3_rotate(q, path, length, factor), phi3_rotate(k, path, length, factor)
    if mutation is not None:
        assert not torch.allclose(got_q, want_q, atol=1e-3)
        return
    scale = math.sqrt(1 + math.log(factor) / math.log(C))  # the formula, besides transformers
    assert wrapped.qk_scale == pytest.approx(scale)
    assert_matches_reference(got_q, want_q, method="longrope (rope)", reference="transformers Phi3RotaryEmbedding",
                             atol=2e-5, rtol=1e-5)
    assert_matches_reference(got_k, want_k, method="longrope (rope)", reference="transformers Phi3RotaryEmbedding",
                             atol=2e-5, rtol=1e-5)


def test_longrope_reads_the_file_and_refuses_in_one_line(tmp_path):
    m = build_method("rope", DIMS)
    flat = factor_file(tmp_path, as_config=False)
    assert EXTENSIONS["longrope"].install(m, Setting(C, 2 * C, 2.0, {"longrope": LongRoPEConfig(factors=flat)}))
    ones = tmp_path / "ones.json"
    ones.write_text(json.dumps({"short_factor": [1] * 8, "long_factor": [4] * 8}))
    assert EXTENSIONS["longrope"].install(m, Setting(C, C, 1.0, {"longrope": LongRoPEConfig(factors=str(ones))})) is None
    with pytest.raises(PosbenchError, match=r"^eval.extension=longrope needs its factor file: eval.longrope.factors="):
        EXTENSIONS["longrope"].install(m, Setting(C, 2 * C, 2.0, {}))
    wrong = factor_file(tmp_path, frequencies=6)
    with pytest.raises(PosbenchError, match="short_factor must be 8 positive numbers .* got 6$"):
        EXTENSIONS["longrope"].install(m, Setting(C, 2 * C, 2.0, {"longrope": LongRoPEConfig(factors=wrong)}))
    with pytest.raises(PosbenchError, match="is not a readable JSON file"):
        EXTENSIONS["longrope"].install(m, Setting(C, 2 * C, 2.0, {"longrope": LongRoPEConfig(factors="nothing.json")}))


def test_identity_while_nothing_is_evicted_or_out_of_the_window():
    m = build_method("rope", DIMS)
    assert EXTENSIONS["streaming_llm"].install(m, Setting(C, C, None)) is None  # cache C = 4 + (C - 4)
    assert EXTENSIONS["streaming_llm"].install(m, Setting(C, C + 1, None)) is not None
    assert EXTENSIONS["lm_infinite"].install(m, Setting(C, C, None)) is None
    assert EXTENSIONS["lm_infinite"].install(m, Setting(C, C + 1, None)) is not None
    assert EXTENSIONS["dual_chunk"].install(m, Setting(C, 44, None)) is None  # one chunk of 48 - 4
    assert EXTENSIONS["dual_chunk"].install(m, Setting(C, 45, None)) is not None


def test_menu_all_and_refusals():
    everything = resolve_extensions("all", "rope")
    assert {"streaming_llm", "lm_infinite", "dual_chunk"} <= set(everything) and "longrope" not in everything
    assert resolve_extensions(["longrope"], "rope") == ["none", "longrope"]
    with pytest.raises(PosbenchError, match=r"^extension lm_infinite does not apply to method=alibi; it applies to rotary"):
        resolve_extensions(["lm_infinite"], "alibi")


@pytest.mark.parametrize("name", ["streaming_llm", "lm_infinite", "dual_chunk"])
def test_model_causal_past_the_context_and_plain_before_the_first_eviction(name):
    torch.manual_seed(0)
    model = posbench.create_model("rope", flavour="tiny", vocab_size=64).eval()
    idx = torch.randint(0, 64, (1, 4 * C), generator=torch.Generator().manual_seed(0))  # assert_causal_model's
    with torch.no_grad():
        plain = model(idx)
    with extended(model, name, C, 4 * C):
        a = assert_causal_model(model, 4 * C, 200)
    inside = {"dual_chunk": C * 3 // 4 - C // 16}.get(name, C)  # dual_chunk: its first chunk
    torch.testing.assert_close(a[0, :inside], plain[0, :inside], atol=1e-5, rtol=1e-5)  # every key seen as trained
    assert not torch.allclose(a[0, inside:], plain[0, inside:])
    assert not isinstance(model.position, ExtendedPosition)


def test_settings_are_validated_and_recorded(tmp_path):
    e = from_section(EvalConfig, "eval", {"streaming_llm": {"sinks": 2}, "lm_infinite": {"window": 32},
                                          "longrope": {"factors": factor_file(tmp_path)}})
    assert e.streaming_llm == StreamingLLMConfig(sinks=2) and e.lm_infinite == LMInfiniteConfig(window=32)
    for section, match in (({"streaming_llm": {"sinks": 0}}, "eval.streaming_llm.sinks must be positive"),
                           ({"lm_infinite": {"window": 0}}, "eval.lm_infinite.window must be positive"),
                           ({"dual_chunk": {"chunk_size": 8, "local_window": 8}},
                            r"eval.dual_chunk.local_window \(8\) must be below eval.dual_chunk.chunk_size \(8\)")):
        with pytest.raises(PosbenchError, match=match):
            from_section(EvalConfig, "eval", section)
    torch.manual_seed(0)
    model = posbench.create_model("rope", flavour="tiny", vocab_size=64).eval()
    tokens = torch.randint(0, 64, (4 * C,), generator=torch.Generator().manual_seed(0))
    evaluation = replace(e, lengths=[2 * C], num_sequences=1, batch_size=1,
                         extension=["streaming_llm", "lm_infinite", "longrope"])
    entries = evaluate_model(model, tokens, evaluation, C, "cpu", log=lambda _: None)
    assert [x["extension"] for x in entries] == ["none", "streaming_llm", "lm_infinite", "longrope"]
    assert entries[1]["extension_options"] == {"sinks": 2, "window": C - 2}
    assert entries[2]["extension_options"] == {"global_tokens": 10, "window": 32}
    assert entries[3]["extension_options"] == {"factors": e.longrope.factors} and entries[3]["extension_factor"] == 2.0
    json.dumps(entries)
    assert len({x["bands"][f"{C}-{2 * C}"] for x in entries}) == 4
