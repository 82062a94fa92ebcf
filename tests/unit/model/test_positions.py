"""Randomized positions (posbench.model.positions): the seeded draw, its config checks, and per-sequence
positions in the model for every method that reads position ids."""

from __future__ import annotations

import pytest
import torch
from helpers import slow_beyond
from omegaconf import OmegaConf

import posbench
from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method
from posbench.model.positions import draw_positions, method_label, randomize_max_from_config

ALL_METHODS = posbench.list_methods()
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_draw_positions_is_a_seeded_sorted_subset():
    a = draw_positions(seed=0, step=7, batch=3, length=16, randomize_max=100)
    assert a.shape == (3, 16) and a.dtype == torch.int64
    assert (a[:, 1:] > a[:, :-1]).all() and int(a.min()) >= 0 and int(a.max()) < 100
    assert torch.equal(a, draw_positions(0, 7, 3, 16, 100))  # resume repeats the draw
    assert not torch.equal(a, draw_positions(0, 8, 3, 16, 100))
    assert not torch.equal(a, draw_positions(1, 7, 3, 16, 100))
    assert not torch.equal(a, draw_positions(0, 7, 3, 16, 100, rank=1))
    assert not torch.equal(a[0], a[1])  # per sequence
    assert torch.equal(draw_positions(0, 1, 2, 16, 16), torch.arange(16).expand(2, 16))


def test_randomize_max_config_checks():
    cfg = lambda m: OmegaConf.create({"positions": {"randomize_max": m}})  # noqa: E731
    assert randomize_max_from_config(cfg(None), "rope", 32, None) is None
    assert randomize_max_from_config(cfg(256), "learned", 32, 4096) == 256
    for bad, match in ((16, ">= trainer.context"), (True, ">= trainer.context")):
        with pytest.raises(PosbenchError, match=match):
            randomize_max_from_config(cfg(bad), "rope", 32, None)
    with pytest.raises(PosbenchError, match="reads no position ids"):
        randomize_max_from_config(cfg(256), "fox", 32, None)
    with pytest.raises(PosbenchError, match="max_positions"):
        randomize_max_from_config(cfg(8192), "learned", 32, 4096)
    assert method_label("rope", None) == "rope" and method_label("rope", 2048) == "rope+rand2048"


@pytest.mark.parametrize("name", [n for n in ALL_METHODS if build_method(n, ModelDims(32, 4, 2)).uses_positions])
def test_per_sequence_positions_equal_per_row_forward(name):
    """(B, T) positions: each row is computed as if its positions were given alone."""
    torch.manual_seed(0)
    model = posbench.create_model(name, flavour="tiny", vocab_size=64, attention="eager").eval()
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = draw_positions(0, 0, 2, 12, 200)
    with torch.no_grad():
        both = model(idx, pos)
        rows = [model(idx[r : r + 1], pos[r]) for r in range(2)]
        plain = model(idx)
    torch.testing.assert_close(both, torch.cat(rows), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(both, plain, atol=1e-4)  # the positions do matter




def allowed_backends(name: str) -> list[str]:
    """The attention backends ``name`` can run in on this machine (flex where torch has it)."""
    from posbench.model.attention import FLEX_AVAILABLE

    limits = build_method(name, ModelDims(64, 4, 4)).backend_limits()
    return [b for b in ("eager", "sdpa", "flex") if b not in limits and (b != "flex" or FLEX_AVAILABLE)]


SEQUENCE_METHODS = posbench.list_methods("sequence")  # every method and recipe of the language model


# FlexAttention on the CPU runs unfused and slowly: the fast lane keeps two flex cases, the full suite all.
@pytest.mark.parametrize("name, backend", slow_beyond(
    [(n, b) for n in SEQUENCE_METHODS for b in allowed_backends(n)],
    fast={(n, b) for n in SEQUENCE_METHODS for b in allowed_backends(n) if b != "flex"} | {("alibi", "flex"), ("llama4", "flex")}))
def test_explicit_positions_are_the_default_and_a_gap_moves_exactly_the_position_methods(name, backend):
    """Custom position ids on every backend a method allows (fused paths that drop custom ids are a
    known silent bug elsewhere): ids 0..T-1 given explicitly, shared (T,) or per row (B, T), give
    the outputs of no ids; ids with a gap in the middle (a non-uniform shift, which moves relative
    methods too) change the outputs of every method that reads ids and leave the others' (nope,
    cope, fox, stickbreaking) bit for bit."""
    torch.manual_seed(0)
    model = posbench.create_model(name, flavour="tiny", vocab_size=64, n_layers=4, attention=backend).eval()
    B, T = 2, 12
    idx = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(0))
    ids = torch.arange(T)
    gap = ids + (ids >= T // 2) * 5  # 0..5, then 11..16
    with torch.no_grad():
        plain = model(idx)
        assert torch.equal(model(idx, ids), plain)
        torch.testing.assert_close(model(idx, ids.expand(B, T)), plain, atol=1e-6, rtol=1e-6)
        shifted, shifted_rows = model(idx, gap), model(idx, gap.expand(B, T))
    torch.testing.assert_close(shifted_rows, shifted, atol=1e-6, rtol=1e-6)
    if model.position.uses_positions:
        assert (shifted - plain).abs().max() > 1e-5
        assert (shifted[:, : T // 2] - plain[:, : T // 2]).abs().max() < 1e-6  # causal: the ids before the gap are the same
    else:
        assert torch.equal(shifted, plain) and torch.equal(shifted_rows, plain)
