"""posbench viz: the numbers its figures draw, checked against formulas written here, and the
command end to end (method=<name> without training, run=<tiny trained run>, a sweep)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import compose_config

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method
from posbench.model.transformer import ModelConfig, build_model
from posbench.train.wandb_session import wandb_run_id
from posbench.viz.attention import record_attention, recording_attention
from posbench.viz.command import run_viz
from posbench.viz.measures import (
    attention_entropy,
    cosine_similarity_matrix,
    mean_attended_distance,
    mean_by_distance,
    qk_decay,
    score_curves,
)

DIMS = ModelDims(d_model=32, n_heads=4, n_layers=2)


def causal_uniform(T: int) -> torch.Tensor:
    """(T, T) attention spread evenly over keys 0..i."""
    mask = torch.tril(torch.ones(T, T))
    return mask / mask.sum(-1, keepdim=True)


def test_entropy_of_uniform_rows_is_log_n():
    entropy = attention_entropy(causal_uniform(50))
    assert torch.allclose(entropy, torch.log(torch.arange(1, 51).double()).float(), atol=1e-5)
    one_hot = torch.eye(7)
    assert torch.allclose(attention_entropy(one_hot), torch.zeros(7))


def test_mean_attended_distance_of_known_patterns():
    T = 9
    first_token = torch.zeros(T, T)
    first_token[:, 0] = 1  # attention sink: query i looks at key 0, distance i
    assert torch.allclose(mean_attended_distance(first_token), torch.arange(T).float())
    assert torch.allclose(mean_attended_distance(torch.eye(T)), torch.zeros(T))
    assert torch.allclose(mean_attended_distance(causal_uniform(T)), torch.arange(T).float() / 2)
    # half on the token itself, half two tokens back: distance 1 (queries >= 2)
    split = 0.5 * torch.eye(T) + 0.5 * torch.diag(torch.ones(T - 2), -2)
    assert torch.allclose(mean_attended_distance(split)[2:], torch.ones(T - 2))


def test_mean_by_distance_averages_each_diagonal():
    T = 6
    term = torch.arange(T * T).float().view(T, T)
    expected = [term.diagonal(-d).mean() for d in range(T)]
    assert torch.allclose(mean_by_distance(term), torch.stack(expected))


def test_alibi_drawn_curve_is_minus_slope_times_distance():
    alibi = build_method("alibi", DIMS)
    T = 300
    curves = score_curves(alibi.score_term(torch.zeros(1, 4, T, 8), torch.arange(T), 0), range(4), T)
    slopes = [2.0 ** (-8 * h / 4) for h in range(1, 5)]  # Press et al.: 2^-2, 2^-4, 2^-6, 2^-8 for 4 heads
    d = torch.arange(T).float()
    for head, slope in enumerate(slopes):
        assert torch.allclose(curves[head], -slope * d, atol=1e-4)


def test_rope_decay_is_the_mean_of_cosines():
    D, T = 16, 200
    rope = build_method("rope", ModelDims(d_model=4 * D, n_heads=4, n_layers=1), base=10000.0)
    theta = 10000.0 ** (-torch.arange(0, D, 2).double() / D)  # (D/2,)
    d = torch.arange(T).double()
    expected = torch.cos(d[:, None] * theta[None, :]).mean(-1)  # (2/D) sum_i cos(d theta_i)
    assert torch.allclose(qk_decay(rope, T, D).double(), expected, atol=1e-5)


def test_sinusoidal_similarity_depends_on_distance_only():
    sinusoidal = build_method("sinusoidal", DIMS)
    T = 40
    similarity = cosine_similarity_matrix(sinusoidal.input_embedding(torch.arange(T)))
    omega = 10000.0 ** (-torch.arange(0, 32, 2).double() / 32)
    i, j = torch.meshgrid(torch.arange(T), torch.arange(T), indexing="ij")
    # <PE(i), PE(j)> = sum_k cos((i - j) w_k) and |PE|^2 = d/2
    expected = torch.cos((i - j)[..., None].double() * omega).mean(-1)
    assert torch.allclose(similarity.double(), expected, atol=1e-5)


@pytest.mark.parametrize("method", posbench.list_methods())
def test_recorded_attention_is_the_model_itself(method):
    """Every method, pope too (its q and k are wider than v: the sweep's viz once failed on it)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, attention="eager")
    model = build_model(cfg, method).eval()
    tokens = torch.randint(0, 50, (2, 24))
    with torch.no_grad():
        expected = model(tokens[:1])
    with torch.no_grad(), recording_attention(2, [1]) as record:
        got = model(tokens[:1])
    assert torch.allclose(got, expected, atol=1e-5)
    assert len(record.layers) == 2 and record.layers[0].maps is None
    maps = torch.from_numpy(record.layers[1].maps)  # (H, T, T)
    if model.position.normalizer(1) is None:
        assert torch.allclose(maps.sum(-1), torch.ones(4, 24), atol=1e-5)
    else:  # a normaliser may leave mass to no key (gpt_oss's sink column)
        assert bool((maps.sum(-1) <= 1 + 1e-5).all()) and bool((maps.sum(-1) > 0).all())
    assert torch.all(maps.triu(1) == 0)  # causal
    merged = record_attention(model, tokens, [-1])
    assert merged.layers[0].entropy.shape == (4, 24) and merged.layers[1].maps is not None
    if method == "alibi":  # the recorded score term is ALiBi's line, whatever the queries
        slopes = torch.tensor([2.0 ** (-8 * h / 4) for h in range(1, 5)])
        expected_score = -slopes[:, None] * torch.arange(24).float()
        assert torch.allclose(torch.from_numpy(merged.layers[0].score), expected_score, atol=1e-4)


@pytest.mark.parametrize("method", ["alibi", "rope"])
def test_recorded_attention_is_the_models_eager_attention(method, monkeypatch):
    """viz records the probabilities of the model's own eager backend, not a copy of it: for a
    method with a score term (alibi) and a rotary one (rope), every layer's recorded map equals,
    bit for bit, what the eager model computes, and the recorded forward is the eager forward."""
    import posbench.model.attention as attention

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, attention="eager"), method).eval()
    tokens = torch.randint(0, 50, (1, 24))
    eager, original = [], attention.eager_probabilities

    def kept(*args, **kwargs):
        eager.append(original(*args, **kwargs))
        return eager[-1]

    monkeypatch.setattr(attention, "eager_probabilities", kept)  # the backend's own calls, not viz's
    with torch.no_grad():
        expected = model(tokens)
        with recording_attention(2, [0, 1]) as record:
            got = model(tokens)
    assert len(eager) == 2 and eager[0].shape == (1, 4, 24, 24)
    assert torch.equal(got, expected)
    for layer, probs in enumerate(eager):
        assert torch.equal(torch.from_numpy(record.layers[layer].maps), probs[0])
    assert not torch.allclose(eager[0][0, :, -1], causal_uniform(24)[-1])  # position-dependent, not uniform


def test_decay_rules_come_from_the_config_and_the_extensions():
    """decay.rules names evaluation-time extensions; linear at span 2 (factor L / C = 2) halves
    the positions, so its curve at distance 10 is the method's own at 5."""
    from posbench.viz.checks import settings_from_config
    from posbench.viz.draw import decay_curves
    from posbench.viz.measures import decay_rules
    from posbench.viz.settings import VizSettings

    cfg = compose_config("viz", ["method=rope", "model=tiny", "context=16", "span=2", "decay.rules=[linear,window]"])
    settings = settings_from_config(cfg)
    assert isinstance(settings, VizSettings) and settings.decay.rules == ["linear", "window"]
    rope = build_method("rope", ModelDims(64, 4, 2))
    assert "linear" in decay_rules(rope) and "ntk" in decay_rules(rope)
    curves = decay_curves(rope, ModelDims(64, 4, 2), "rope", {}, settings)
    rule = curves["linear (base=10000, to 32)"]
    own = curves["rope base=10000 (this model)"]
    assert rule[10] == pytest.approx(own[5], abs=1e-5)
    assert "window (base=10000, to 32)" in curves  # applies to every method (q.k unchanged)
    with pytest.raises(PosbenchError, match="unknown decay rule 'bogus'"):
        settings_from_config(compose_config("viz", ["method=rope", "decay.rules=[bogus]"]))


def test_wandb_run_id_is_read_from_the_run_dir(tmp_path):
    assert wandb_run_id(tmp_path) is None
    (tmp_path / "wandb" / "offline-run-20260101_000000-abc123").mkdir(parents=True)
    assert wandb_run_id(tmp_path) == "abc123"


# --------------------------------------------------------------------------- the command


def test_viz_method_of_a_wrapper_whose_base_option_names_a_method(tmp_path):
    """ssmax's `base` option is a method name, not a rotary frequency base: the decay curves read
    the frequency base from the Rotary capability (a wrapper over rope has none of its own)."""
    written = run_viz(compose_config("viz", ["method=ssmax", "model=tiny", "context=16", "span=2",
                                             f"out={tmp_path / 'ssmax'}"]), log=lambda _: None)
    assert written == [tmp_path / "ssmax" / "qk_decay.png"]


@pytest.mark.parametrize("override, message", [
    ("+attention.foo=1", "unknown option(s) attention.foo"),
    ("+decay.base=1", "unknown option(s) decay.base"),
    ("context=abc", "context must be an integer, got 'abc'"),
    ("span=0", "viz span must be a positive integer, got 0"),
    ("attention.length_factor=0", "viz attention.length_factor must be a positive integer, got 0"),
    ("attention.num_sequences=two", "attention.num_sequences must be an integer"),
    ("attention.layers=[last]", "attention.layers must be layer numbers"),
    ("decay.bases=[abc]", "decay.bases must be positive numbers"),
    ("attention=null", "attention must be a mapping of settings, got None"),
])
def test_bad_viz_settings_are_one_line_before_any_figure(override, message, tmp_path):
    """The settings are built by the config's from_section: every section's key is typed and checked."""
    with pytest.raises(PosbenchError, match=re.escape(message)):
        run_viz(compose_config("viz", ["method=rope", "model=tiny", f"out={tmp_path}", override]))
    assert not any(tmp_path.iterdir())


def test_viz_settings_mirror_the_yaml():
    from posbench.viz.checks import settings_from_config
    from posbench.viz.settings import AttentionSettings, DecaySettings

    s = settings_from_config(compose_config("viz", ["attention.layers=[1]", "decay.bases=[5000]", "formats=[svg,png]"]))
    assert s.attention == AttentionSettings(layers=[1]) and s.decay == DecaySettings(bases=[5000.0])
    assert isinstance(s.decay.bases[0], float) and s.formats == ["svg", "png"]
    assert s.in_context(32).context == 32 and s.context == 256
