"""Context extension on the grid encoder: the rotary rules apply per axis (FiT), with the side
ratio as their factor; the rules that read sequence distances, and non-rotary methods, are refused."""

from __future__ import annotations

import math

import pytest
import torch

from posbench.core.errors import PosbenchError
from posbench.evaluation.settings import EvalConfig
from posbench.evaluation.tasks import evaluate_task
from posbench.methods import grid_positions
from posbench.model.extension import extended, record_extension, resolve_extensions
from posbench.model.transformer import ModelConfig, build_model
from posbench.runs.spec import build_spec
from posbench.tasks.base import make_task
from tests.helpers import compose_config

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

GRID = ModelConfig(vocab_size=11, d_model=64, n_layers=1, n_heads=2, layout="grid")  # head dim 32: 16 per axis
C, L = 64, 1024  # 8 x 8 cells trained, 32 x 32 evaluated: the side ratio is 4, the cell ratio 16


def axial_model():
    torch.manual_seed(0)
    return build_model(GRID, "axial_rope")


def hf_frequencies(rope_type: str, factor: float, train_side: int, rotary_dim: int, base: float, **extra):
    """transformers' frequencies (R/2,) and attention factor of one axis: R = rotary_dim channels,
    trained at ``train_side`` positions, scaled by ``factor``."""
    scaling = {"rope_type": rope_type, "factor": factor, "original_max_position_embeddings": train_side, **extra}
    shape = dict(hidden_size=rotary_dim, num_attention_heads=1, head_dim=rotary_dim,
                 max_position_embeddings=math.ceil(factor * train_side))
    if int(transformers.__version__.split(".")[0]) >= 5:
        config = LlamaConfig(**shape, rope_parameters={**scaling, "rope_theta": base})
    else:
        config = LlamaConfig(**shape, rope_theta=base, rope_scaling=scaling)
    inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(attention)


def test_pi_on_the_grid_divides_each_axis_by_the_side_ratio():
    model = axial_model()
    trained = model.position
    q, k = torch.randn(2, 1, 2, L, 32).unbind(0)
    cells = grid_positions(32, 32)
    with extended(model, "linear", C, L) as factor:
        assert factor == 4.0  # 32 / 8, not 1024 / 64
        torch.testing.assert_close(model.position.inner.inv_freq, trained.inv_freq / 4, rtol=1e-6, atol=0)
        rq, rk = model.position.rotate_qk(q, k, cells)
        eq, ek = trained.rotate_qk(q, k, cells.float() / 4)  # equivalently: every cell at (row / 4, col / 4)
        torch.testing.assert_close(rq, eq, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rk, ek, rtol=1e-5, atol=1e-5)
    assert model.position is trained


@pytest.mark.parametrize("rule, extra", [("yarn", {}), ("llama3", {"low_freq_factor": 1.0, "high_freq_factor": 4.0})])
def test_yarn_and_llama3_on_the_grid_are_transformers_rules_for_the_side_ratio(rule, extra):
    model = axial_model()
    trained = model.position
    expected, attention = hf_frequencies(rule, 4.0, train_side=8, rotary_dim=16, base=trained.base, **extra)
    cell_ratio, _ = hf_frequencies(rule, 16.0, train_side=64, rotary_dim=16, base=trained.base, **extra)
    assert not torch.allclose(expected, cell_ratio)  # the two readings differ: the test can tell them apart
    with extended(model, rule, C, L) as factor:
        assert factor == 4.0
        torch.testing.assert_close(model.position.inner.inv_freq, expected, rtol=1e-6, atol=0)
        assert model.position.qk_scale == pytest.approx(attention)
    if rule == "yarn":
        assert attention == pytest.approx(0.1 * math.log(4) + 1)


def test_ntk_on_the_grid_is_the_base_change_for_the_side_ratio():
    """NTK-aware scaling per axis: the axis's R = D/2 channels with base * 4^(R / (R - 2))."""
    model = axial_model()
    R, base = 16, model.position.base
    expected = (base * 4.0 ** (R / (R - 2))) ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    with extended(model, "ntk", C, L) as factor:
        assert factor == 4.0
        torch.testing.assert_close(model.position.inner.inv_freq, expected.float(), rtol=1e-5, atol=0)
    with extended(model, "dynamic_ntk", C, L):  # at its default factor 1, the same base for the side 32
        torch.testing.assert_close(model.position.inner.inv_freq, expected.float(), rtol=1e-5, atol=0)


def test_inside_the_training_grid_the_rules_are_the_identity():
    model = axial_model()
    for rule in ("linear", "ntk", "yarn"):
        with extended(model, rule, C, C) as factor:
            assert factor == 1.0 and model.position.name == "axial_rope"
            assert type(model.position).__name__ == "AxialRoPE"  # not installed: the plain model


def test_the_menu_on_the_grid_is_the_per_axis_rules_and_refuses_the_rest_in_one_line():
    per_axis = ["none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3"]
    assert resolve_extensions("all", "axial_rope", layout="grid") == per_axis
    assert resolve_extensions("all", "mixed_rope", layout="grid") == ["none"]
    with pytest.raises(PosbenchError, match=r"extension window does not apply to the grid layout .* per axis: linear"):
        resolve_extensions(["window"], "axial_rope", layout="grid")
    with pytest.raises(PosbenchError, match=r"extension linear does not apply to method=mixed_rope; "
                                            r"it applies to rotary or input-table methods \(axial_rope\)"):
        resolve_extensions(["linear"], "mixed_rope", layout="grid")
    skipped = []
    assert resolve_extensions(["yarn", "rerope"], "axial_rope", skipped.append, layout="grid") == ["none", "yarn"]
    assert skipped == [f"skipping extension rerope does not apply to the grid layout (it reads sequence distances); "
                       f"on the grid the rotary rules apply per axis: {', '.join(per_axis[1:])}"]
    with pytest.raises(PosbenchError, match="does not apply to the grid layout"):  # also at evaluation
        with extended(axial_model(), "log_scaling", C, L):
            pass


def test_a_grid_run_refuses_a_sequence_rule_before_any_work():
    base = ["task=life", "method=axial_rope"]
    spec = build_spec(compose_config("train", [*base, "eval.extension=all"]))
    assert spec.eval.extension == ["none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3"]
    with pytest.raises(PosbenchError, match="extension self_extend does not apply to the grid layout"):
        build_spec(compose_config("train", [*base, "eval.extension=[self_extend]"]))
    with pytest.raises(PosbenchError, match="extension yarn does not apply to method=mixed_rope"):
        build_spec(compose_config("train", ["task=life", "method=mixed_rope", "eval.extension=[yarn]"]))


def test_grid_entries_record_the_sides_and_sequence_entries_stay_as_they_were():
    grid, sequence, plain = {}, {}, {}
    record_extension(grid, "yarn", 4.0, C, L, layout="grid")
    record_extension(sequence, "yarn", 16.0, C, L)
    record_extension(plain, "none", None, C, L, layout="grid")
    assert grid == {"extension": "yarn", "extension_factor": 4.0, "extension_per_axis": {"train_side": 8, "side": 32}}
    assert sequence == {"extension": "yarn", "extension_factor": 16.0}
    assert plain == {"extension": "none", "extension_factor": None}


def test_a_grid_task_evaluation_scales_per_axis():
    """evaluate_task on Life: the factor of each length is its side ratio, recorded with the sides;
    inside the training grid the rule changes nothing, past it the answers move."""
    task = make_task({"name": "life"}, C)
    model = build_model(ModelConfig(vocab_size=task.vocab_size, d_model=32, n_layers=1, n_heads=2, layout="grid"),
                        "axial_rope")
    evaluation = EvalConfig(lengths=[64, 256], num_sequences=4, batch_size=4, extension=["none", "linear"])
    entries = evaluate_task(model, task, evaluation, C, torch.device("cpu"), None, lambda _: None)
    by = {(e["length"], e["extension"]): e for e in entries}
    assert by[(256, "linear")]["extension_factor"] == 2.0
    assert by[(256, "linear")]["extension_per_axis"] == {"train_side": 8, "side": 16}
    assert by[(64, "linear")]["extension_factor"] == 1.0
    assert by[(64, "linear")]["sequence_accuracy"] == by[(64, "none")]["sequence_accuracy"]
    assert by[(256, "linear")]["loss"] != by[(256, "none")]["loss"]
