"""DroPE (posbench/methods/drope.py): the base method until ``drop_step`` optimizer steps, then no
position encoding at all; the step count travels in the state dict; bases that cannot be dropped
are refused in one line. Training across the switch: tests/integration/test_drope_run.py."""

from __future__ import annotations

import pytest
import torch

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method

DIMS = ModelDims(d_model=32, n_heads=2, n_layers=2)


def model(name: str, **options):
    torch.manual_seed(0)
    return posbench.create_model(name, flavour="tiny", vocab_size=64, method_options=options or None).eval()


@pytest.mark.parametrize("base", ["rope", "alibi", "learned"])
def test_the_base_until_the_drop_then_nope(base):
    """Same seed, same body: before the drop the logits are the base's, after it NoPE's, bit for bit."""
    idx = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(0))
    drope = model("drope", base=base, drop_step=3)
    with torch.no_grad():
        plain, nope = model(base)(idx), model("nope")(idx)
        for step in range(1, 5):
            drope.position.before_step()  # what the training step calls once per optimizer step
            out = drope(idx)
            assert torch.equal(out, nope if step > 3 else plain), step
    assert drope.position.switched_at_step == 3 and not drope.position.has_score_term


def test_a_mutated_switch_fails():
    """A drope that ignores its step count (never drops) is caught by the comparison above."""
    idx = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(0))
    drope = model("drope", drop_step=1)
    for _ in range(2):
        drope.position.before_step()
    drope.position._dropped = False  # the mutation: the switch lost
    with torch.no_grad():
        assert not torch.equal(drope(idx), model("nope")(idx))


def test_the_step_count_travels_in_the_state_dict():
    drope = model("drope", drop_step=2)
    for _ in range(3):
        drope.position.before_step()
    fresh = model("drope", drop_step=2)
    assert not fresh.position.dropped and fresh.position.switched_at_step is None
    fresh.load_state_dict(drope.state_dict())
    assert fresh.position.dropped and int(fresh.position.steps_done) == 3 and fresh.position.switched_at_step == 2


@pytest.mark.parametrize("base,why", [
    ("nope", "nope reads no position ids, so there is nothing to drop"),
    ("stickbreaking", "stickbreaking reads no position ids"),
    ("swan", "swan's layers impose attention windows"),
    ("ssmax", "ssmax wraps another method"),
    ("axial_rope", "axial_rope is a grid method"),
])
def test_a_base_that_cannot_be_dropped_is_refused_in_one_line(base, why):
    with pytest.raises(PosbenchError, match=rf"^method=drope cannot drop method.base={base}: {why}.*e.g. method.base=rope$"):
        build_method("drope", DIMS, base=base)
    with pytest.raises(PosbenchError, match="^method.drop_step must be a step >= 1"):
        build_method("drope", DIMS, drop_step=0)
