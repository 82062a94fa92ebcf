"""posbench viz: the numbers its figures draw, checked against formulas written here, and the
command end to end (method=<name> without training, run=<tiny trained run>, a sweep)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import QUICK_TRAIN, compose_config, posbench_cli

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
    assert torch.allclose(maps.sum(-1), torch.ones(4, 24), atol=1e-5)
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


@pytest.mark.slow
def test_viz_method_cli_needs_no_training(tmp_path):
    out = tmp_path / "sin"
    proc = posbench_cli("viz", "method=sinusoidal", f"out={out}", "formats=[png,svg]")
    for stem in ("position_table", "position_similarity"):
        assert (out / f"{stem}.png").stat().st_size > 1000 and (out / f"{stem}.svg").is_file()
    assert "wrote" in proc.stdout + proc.stderr
    written = run_viz(compose_config("viz", ["method=alibi", "model=tiny", f"out={tmp_path / 'alibi'}"]),
                      log=lambda _: None)
    assert written == [tmp_path / "alibi" / "score_terms.png"]


def test_viz_method_of_a_wrapper_whose_base_option_names_a_method(tmp_path):
    """ssmax's `base` option is a method name, not a rotary frequency base: the decay curves read
    the frequency base from the Rotary capability (a wrapper over rope has none of its own)."""
    written = run_viz(compose_config("viz", ["method=ssmax", "model=tiny", "context=16", "span=2",
                                             f"out={tmp_path / 'ssmax'}"]), log=lambda _: None)
    assert written == [tmp_path / "ssmax" / "qk_decay.png"]


@pytest.mark.slow
def test_viz_is_a_listed_command_and_errors_are_one_line(tmp_path):
    from posbench.commands.cli import usage
    from posbench.core.errors import PosbenchError

    assert "\n  viz " in usage()
    proc = posbench_cli("viz", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "posbench viz: error: posbench viz needs method=<name> (no training) or run=<run or sweep directory>")
    with pytest.raises(PosbenchError, match="is not a directory"):
        run_viz(compose_config("viz", [f"run={tmp_path / 'missing'}"]))
    with pytest.raises(PosbenchError, match="unknown decay rule 'nonsense'"):
        run_viz(compose_config("viz", ["method=rope", "decay.rules=[nonsense]"]))
    with pytest.raises(PosbenchError, match="not both"):
        run_viz(compose_config("viz", ["method=rope", f"run={tmp_path}"]))
    with pytest.raises(PosbenchError, match="unsupported figure format"):
        run_viz(compose_config("viz", ["method=rope", "formats=[jpg]"]))


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


@pytest.fixture(scope="module")
def trained_sweep(tmp_path_factory) -> Path:
    """Two tiny trained runs (learned, relative) in one sweep-like folder."""
    from posbench.train.trainer import train

    sweep = tmp_path_factory.mktemp("sweep")
    for i, method in enumerate(("learned", "relative")):
        train(compose_config("train", [*QUICK_TRAIN, f"method={method}"]), sweep / f"{i}_{method}-s0",
              log=lambda _: None)
    return sweep


@pytest.mark.slow
def test_viz_run_cli(trained_sweep, tmp_path):
    run = trained_sweep / "0_learned-s0"
    posbench_cli("viz", f"run={run}", "attention.num_sequences=2")
    out = run / "figures" / "viz"
    for stem in ("position_table", "position_similarity", "attention_maps_layer0", "attention_maps_layer1",
                 "attention_entropy_distance"):
        assert (out / f"{stem}.png").stat().st_size > 1000, stem


@pytest.mark.slow
def test_viz_sweep_overview_and_content_dependent_score(trained_sweep, tmp_path):
    out = tmp_path / "viz"
    cfg = compose_config("viz", [f"run={trained_sweep}", f"out={out}", "attention.num_sequences=2",
                                 "attention.length_factor=4"])
    written = run_viz(cfg, log=lambda _: None)
    assert out / "overview.png" in written
    assert (out / "1_relative-s0" / "score_terms.png").is_file()  # from real queries of the run
    assert not (out / "0_learned-s0" / "score_terms.png").exists()


@pytest.mark.slow
def test_figures_go_to_the_runs_wandb_run(tmp_path, monkeypatch):
    """Offline: the figures are logged by resuming the W&B run id recorded in the run dir."""
    from omegaconf import OmegaConf

    from posbench.train.wandb_session import wandb_init
    from posbench.viz.command import log_to_wandb

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    run_dir = tmp_path / "run"
    first = wandb_init(mode="offline", dir=run_dir, project="posbench", name="alibi-s0")
    run_id = first.id
    first.finish()
    written = run_viz(compose_config("viz", ["method=alibi", "model=tiny", f"out={run_dir / 'figures'}"]),
                      log=lambda _: None)
    config = OmegaConf.create({"logger": {"name": "wandb", "mode": "offline", "project": "posbench"}})
    messages: list[str] = []
    assert log_to_wandb(run_dir, config, written, messages.append), messages
    assert messages == [f"logged 1 figures to W&B run {run_id} (offline)"]
    # W&B names offline run folders by start second and id, adding "-1" when a second W&B run of
    # the id starts within the same second (the plain glob missed that folder on fast machines).
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2  # the training run's and the one that added the figures, same id
    assert list(runs[-1].glob("files/media/images/viz/score_terms_*.png"))
    # No W&B run recorded (or logger=none): nothing happens.
    assert not log_to_wandb(tmp_path / "elsewhere", config, written, messages.append)


@pytest.mark.slow
def test_sweep_callback_adds_the_viz_pictures(trained_sweep):
    from omegaconf import OmegaConf

    from posbench.commands.sweep import ComparePlotsCallback

    ComparePlotsCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(trained_sweep)}}}))
    viz = trained_sweep / "comparison" / "viz"
    assert (viz / "overview.png").is_file() and (viz / "1_relative-s0" / "attention_entropy_distance.png").is_file()
    assert (trained_sweep / "comparison" / "loss_by_position.png").is_file()  # posbench plot's, as before


@pytest.mark.slow
def test_qk_decay_of_a_run_is_titled_as_analytic_not_by_step(tmp_path, monkeypatch):
    """Rope's q.k decay comes from its definition, so naming the run's step
    (``rope, step 400``) misleads; a method with trained q/k parameters keeps the step."""
    import posbench.viz.draw as viz
    from posbench.train.trainer import train

    titles = []
    original = viz.qk_decay_figure
    monkeypatch.setattr(viz, "qk_decay_figure", lambda curves, context, title: titles.append(title)
                        or original(curves, context, title))
    run = tmp_path / "rope-s0"
    train(compose_config("train", [*QUICK_TRAIN, "method=rope"]), run, log=lambda _: None)
    run_viz(compose_config("viz", [f"run={run}", f"out={tmp_path / 'viz'}", "attention.num_sequences=2"]),
            log=lambda _: None)
    (title,) = titles
    assert "step" not in title.split("\n")[0] and "analytic" in title and title.startswith("rope")


@pytest.mark.slow
def test_viz_of_a_task_run_draws_attention_on_its_task_sequences(tmp_path, monkeypatch):
    """A task run (task=flipflop) has no text: viz asked the hub for TinyStories and told the
    user to use data=sample. Its attention is now measured on the task's own held-out sequences."""
    from posbench.runs.load import load_run
    from posbench.tasks.base import VALID, make_task
    from posbench.train.trainer import train
    from posbench.viz import attention as viz
    from posbench.viz.settings import AttentionSettings

    run_dir = tmp_path / "flipflop-rope-s0"
    train(compose_config("train", [*QUICK_TRAIN, "task=flipflop", "method=rope"]), run_dir, log=lambda _: None)

    def no_text(*args, **kwargs):
        raise AssertionError("a task run has no text to load")

    monkeypatch.setattr(viz, "run_data", no_text)
    run = load_run(run_dir)
    settings = AttentionSettings(num_sequences=2)
    tokens, where = viz.held_out_windows(run, 64, settings, log=lambda _: None)
    expected, _ = make_task(run.config.task, 32).sequences(VALID, 64, 2).inputs_targets()
    assert torch.equal(tokens, expected) and tokens.shape == (2, 64)
    assert where == "2 held-out flipflop sequences (validation) of 64 tokens"
    written = run_viz(compose_config("viz", [f"run={run_dir}", "attention.num_sequences=2", "wandb=false"]),
                      log=lambda _: None)
    assert {p.stem for p in written} >= {"attention_maps_layer0", "attention_entropy_distance"}
    with pytest.raises(PosbenchError, match="attention.split=train is not held out"):
        viz.held_out_windows(run, 64, AttentionSettings(split="train"), log=lambda _: None)
