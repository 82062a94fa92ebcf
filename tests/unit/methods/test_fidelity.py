"""Learned position parameters follow their reference parametrisation, the old one stays
reproducible as an option, and their movement during training is logged (docs/fidelity.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import run_train
from model_checks import assert_matches_reference

import posbench
from posbench.config import load_group_option
from posbench.methods import ModelDims, build_method, dense_score
from posbench.methods.base import ParameterDrift
from posbench.methods.t5 import causal_bucket

LEARNED = ["learned", "t5", "relative", "abs_attention", "cope", "fire", "kerple", "fox"]


def make(name: str, d_model: int = 64, n_heads: int = 2, n_layers: int = 2, **options):
    torch.manual_seed(0)
    return build_method(name, ModelDims(d_model=d_model, n_heads=n_heads, n_layers=n_layers), **options)


def t5_dense(method, T: int = 300) -> torch.Tensor:
    """The t5 score term on the full (H, T, T) grid (it reads neither q nor the batch)."""
    H = method.dims.n_heads
    q = torch.zeros(1, H, T, method.dims.head_dim)
    return dense_score(method.score_term(q, torch.arange(T), 0), 1, H, T, q.device)[0]


def randomised(method):
    with torch.no_grad():
        method.bias.weight.normal_()
    return method


# ---------------------------------------------------------------------------------------------- t5


def test_t5_default_bias_scale_is_sqrt_head_dim_as_x_transformers():
    """The default follows x-transformers' RelativePositionBias(scale=dim_head ** 0.5), the
    implementation the scale comes from, with its table copied in."""
    xt = pytest.importorskip("x_transformers.x_transformers")
    H, d_model, T = 2, 64, 300
    ours = randomised(make("t5", d_model=d_model, n_heads=H))
    assert ours.bias_scale == math.sqrt(d_model // H)
    ref = xt.RelativePositionBias(scale=(d_model // H) ** 0.5, causal=True, num_buckets=32, max_distance=128, heads=H)
    with torch.no_grad():
        ref.relative_attention_bias.weight.copy_(ours.bias.weight)
        expected = ref(T, T)  # (H, T, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    assert_matches_reference(t5_dense(ours)[:, mask], expected[:, mask], method="t5",
                             reference="x_transformers RelativePositionBias(scale=dim_head**0.5)", atol=1e-6, rtol=0)


def test_t5_default_is_the_formula_scale_times_table_of_the_bucket():
    """Written out: bias(h, i, j) = sqrt(D) * table[bucket(i - j), h]; and the YAML's null is that default."""
    H, d_model, T = 2, 64, 300
    ours = randomised(make("t5", d_model=d_model, n_heads=H, **{"bias_scale": load_group_option("method", "t5")["bias_scale"]}))
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    expected = math.sqrt(d_model // H) * ours.bias.weight.detach()[causal_bucket(i - j)].permute(2, 0, 1)
    mask = (i >= j).expand(T, T)
    torch.testing.assert_close(t5_dense(ours)[:, mask], expected[:, mask], atol=1e-6, rtol=0)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_t5_bias_scale_multiplies_the_score_term_exactly(scale):
    one = randomised(make("t5", bias_scale=1.0))
    scaled = randomised(make("t5", bias_scale=scale))
    assert torch.equal(one.bias.weight, scaled.bias.weight)  # same seed, same table
    assert torch.equal(t5_dense(scaled), scale * t5_dense(one))


def test_t5_bias_scale_one_reproduces_the_old_unscaled_bias_bitwise():
    """bias_scale=1 is the first t5 parametrisation: table[bucket(i - j), h], no factor,
    same initialisation (same draws from the same seed)."""
    old = make("t5", bias_scale=1.0)
    torch.manual_seed(0)
    reference_init = torch.nn.init.normal_(torch.nn.Embedding(32, 2).weight.detach(), std=0.02)  # the old init
    assert torch.equal(old.bias.weight.detach(), reference_init)
    T = 300
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    expected = old.bias.weight.detach()[causal_bucket(i - j)].permute(2, 0, 1)
    mask = (i >= j).expand(T, T)
    assert torch.equal(t5_dense(old)[:, mask], expected[:, mask])


def test_t5_bias_scale_changes_no_parameter_or_rng_draw():
    """The scale is a constant: same parameters, same init, same RNG state after building, so the
    rest of the model (built after the method) is bitwise the same with either option."""
    torch.manual_seed(0)
    a = build_method("t5", ModelDims(64, 2, 2), bias_scale=1.0)
    after_a = torch.rand(3)
    torch.manual_seed(0)
    b = build_method("t5", ModelDims(64, 2, 2))
    after_b = torch.rand(3)
    assert torch.equal(a.bias.weight, b.bias.weight) and torch.equal(after_a, after_b)
    assert [n for n, _ in a.named_parameters()] == [n for n, _ in b.named_parameters()] == ["bias.weight"]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_t5_bias_scale_must_be_positive(bad):
    with pytest.raises(ValueError, match="bias_scale"):
        make("t5", bias_scale=bad)


def test_t5_bias_scale_is_a_documented_config_option():
    option = load_group_option("method", "t5")
    assert "bias_scale" in option and option["bias_scale"] is None
    # the meaning of each method option is written once, in docs/configuration.md's method table
    docs = Path(posbench.__file__).resolve().parents[1] / "docs" / "configuration.md"
    (row,) = [line for line in docs.read_text().splitlines() if line.startswith("| `t5` |")]
    assert "`bias_scale` (null = sqrt(d_head)" in row and "1.0 = the unscaled bias of the first t5 parametrisation" in row


# ------------------------------------------------------------------------- position parameters / drift


@pytest.mark.parametrize("name", LEARNED)
def test_every_learned_method_reports_its_position_parameters(name):
    method = make(name)
    params = method.position_parameters()
    assert params and params == {n: p for n, p in method.named_parameters()}


@pytest.mark.parametrize("name", ["nope", "rope", "alibi", "sinusoidal", "sandwich", "xpos"])
def test_parameter_free_methods_report_none(name):
    assert make(name).position_parameters() == {}


def test_drift_is_the_relative_movement_and_absolute_from_zero():
    torch.manual_seed(0)
    zero_init = make("cope")  # tables start at 0 (the paper's init)
    t5 = make("t5")
    zero_drift, t5_drift = ParameterDrift(zero_init), ParameterDrift(t5)
    start = t5.bias.weight.detach().clone()
    assert set(t5_drift.metrics()) == {"position/bias.weight/norm", "position/bias.weight/move"}
    assert t5_drift.metrics()["position/bias.weight/move"] == 0.0
    with torch.no_grad():
        t5.bias.weight.mul_(3.0)  # p_t - p_0 = 2 p_0
        zero_init.tables[0].fill_(0.5)
    m = t5_drift.metrics()
    assert m["position/bias.weight/norm"] == pytest.approx(3 * float(start.norm()), rel=1e-6)
    assert m["position/bias.weight/move"] == pytest.approx(2.0, rel=1e-6)
    z = zero_drift.metrics()
    cells = zero_init.tables[0].numel()
    assert z["position/tables.0/move"] == pytest.approx(0.5 * math.sqrt(cells), rel=1e-6)  # ||p_t||, p_0 = 0
    assert z["position/tables.1/move"] == 0.0


@pytest.mark.slow
def test_training_logs_position_parameter_norms_and_movement_at_each_validation(tmp_path):
    results = run_train(tmp_path, "method=t5", "trainer.val_every=3")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val_rows] == [3, 6]
    moves = [r["position/bias.weight/move"] for r in val_rows]
    assert all(move > 0 for move in moves)
    assert all(r["position/bias.weight/norm"] > 0 for r in val_rows)
    # Against the checkpoint: the final movement is ||p_T - p_0|| / ||p_0|| with p_0 the seed's init.
    from posbench.runs.checkpoint import list_checkpoints, read_checkpoint

    final = read_checkpoint(list_checkpoints(tmp_path)[-1])["model"]["position.bias.weight"].float()
    torch.manual_seed(0)  # the trainer seeds before building the model
    fresh = posbench.create_model("t5", flavour="tiny", vocab_size=results["model"]["vocab_size"]).position.bias.weight.detach()
    expected = float((final - fresh).norm() / fresh.norm())
    assert moves[-1] == pytest.approx(expected, rel=1e-5)
    # scripts/position_drift.py (for runs trained before the logging) gives the same numbers.
    import importlib.util

    spec = importlib.util.spec_from_file_location("position_drift", Path(__file__).parents[3] / "scripts" / "position_drift.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (row,) = [r for r in script.drift_rows(tmp_path, []) if r["step"] == 6]
    assert row["position/bias.weight/move"] == pytest.approx(moves[-1], rel=1e-6)
    assert row["position/bias.weight/norm"] == pytest.approx(val_rows[-1]["position/bias.weight/norm"], rel=1e-6)
