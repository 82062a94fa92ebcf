"""Adding a position method touches its module, its config and its tests, nothing else: a rotary
method defined here and registered through the public registry is found by the extension menu,
the evaluation, ``posbench bench`` and ``posbench viz`` with no other edit."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import Tensor

import posbench
from posbench.bench import command as bench
from posbench.evaluation.loss import per_position_loss
from posbench.methods import ModelDims, PositionMethod, Rotary, register, unregister
from posbench.model.extension import EXTENSIONS, applies_text, extended, resolve_extensions
from posbench.viz.draw import decay_curves, viz_method
from posbench.viz.measures import decay_rules
from posbench.viz.settings import DecaySettings, VizSettings

NAME = "test_spin"


class Spin(Rotary, PositionMethod):
    """A throwaway rotary method: RoPE's rotation written out, interleaved pairs, base 500."""

    name = NAME
    relative_scores = True

    def __init__(self, dims: ModelDims, *, base: float = 500.0) -> None:
        super().__init__(dims)
        self.base, self.rotary_dim = base, dims.head_dim
        inv_freq = base ** (-torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # (R/2,)

    def rotate_qk(self, q: Tensor, k: Tensor, positions: Tensor, layer: int = 0) -> tuple[Tensor, Tensor]:
        angles = (positions.float()[..., None] * self.inv_freq).repeat_interleave(2, dim=-1)  # (T, R)
        cos, sin = angles.cos(), angles.sin()

        def turn(x: Tensor) -> Tensor:  # (x0, x1, ...) -> (-x1, x0, ...)
            return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

        return (q * cos + turn(q) * sin).to(q.dtype), (k * cos + turn(k) * sin).to(k.dtype)


@pytest.fixture
def spin():
    register(Spin)
    yield Spin
    unregister(NAME)
    assert NAME not in posbench.list_methods()


def test_a_new_rotary_method_gets_every_rotary_extension(spin):
    rotary = [name for name, ext in EXTENSIONS.items() if ext.applies_to is not None and Rotary in ext.applies_to]
    assert {"linear", "ntk", "dynamic_ntk", "yarn", "llama3"} <= set(rotary)
    assert resolve_extensions("all", NAME) == ["none", *(e for e, x in EXTENSIONS.items() if x.in_all)]
    assert NAME in applies_text("yarn")
    torch.manual_seed(0)
    model = posbench.create_model(NAME, flavour="tiny", vocab_size=64).eval()
    trained = model.position.inv_freq.clone()
    sequences = torch.randint(0, 64, (2, 65), generator=torch.Generator().manual_seed(0))
    plain = per_position_loss(model, sequences, 2, torch.device("cpu"))
    for name in ("linear", "ntk", "yarn", "llama3"):
        with extended(model, name, 16, 64):
            losses = per_position_loss(model, sequences, 2, torch.device("cpu"))
        assert torch.isfinite(losses).all() and not torch.equal(losses, plain), name
        assert torch.equal(model.position.inv_freq, trained)  # the trained module is never changed


@pytest.mark.slow
def test_a_new_method_is_benchmarked(spin, tmp_path):
    cfg = OmegaConf.create({"methods": [NAME], "model": {"flavour": "tiny", "d_model": 64, "n_layers": 2,
                                                         "n_heads": 4},
                            "steps": 1, "warmup_steps": 0, "eval_lengths": [32], "eval_steps": 1, "batch_size": 2,
                            "context": 16, "peer": False, "device": "cpu", "out": str(tmp_path)})
    report = bench.run_bench(cfg)
    assert report["methods"][NAME]["train"]["tokens_per_second_median"] > 0
    assert (tmp_path / "bench.md").read_text().count(f"| {NAME} |") == 1


def test_a_new_method_is_drawn_with_its_extensions(spin, tmp_path):
    cfg = OmegaConf.create({"method": {"name": NAME}, "model": {"flavour": "tiny", "d_model": 64, "n_layers": 2,
                                                                "n_heads": 4}, "out": str(tmp_path)})
    assert "yarn" in decay_rules(Spin(ModelDims(64, 4, 2)))
    written = viz_method(cfg, VizSettings(context=16, span=2, decay=DecaySettings(rules=["yarn"])).validate(), lambda _: None)
    assert tmp_path / "qk_decay.png" in written
    curves = decay_curves(Spin(ModelDims(64, 4, 2)), ModelDims(64, 4, 2), NAME, {},
                          VizSettings(context=16, span=2, decay=DecaySettings(rules=["yarn"])))
    assert "yarn (base=500, to 32)" in curves and not (curves["yarn (base=500, to 32)"] == curves[f"{NAME} base=500 (this model)"]).all()
