"""learned_2d: a learned embedding per grid cell (ViT), resized bicubically at a new grid side
(DeiT) or read cell by cell (the un-interpolated control)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_checks import assert_matches_reference

from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method, grid_positions
from posbench.model.transformer import ModelConfig, build_model

DIMS = ModelDims(d_model=16, n_heads=2, n_layers=1)
GRID = ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, layout="grid")


def method(**options):
    torch.manual_seed(0)
    return build_method("learned_2d", DIMS, train_context=64, **options)


def deit_resize(pos_embed: torch.Tensor, new_size: int) -> torch.Tensor:
    """DeiT's / MAE's ``interpolate_pos_embed``, written from their formula: a flattened (1, N, d)
    table of an orig x orig grid -> (1, new_size**2, d), bicubic, align_corners=False."""
    orig = int(pos_embed.shape[-2] ** 0.5)
    tokens = pos_embed.reshape(-1, orig, orig, pos_embed.shape[-1]).permute(0, 3, 1, 2)
    tokens = F.interpolate(tokens, size=(new_size, new_size), mode="bicubic", align_corners=False)
    return tokens.permute(0, 2, 3, 1).flatten(1, 2)


@pytest.mark.parametrize("side", [4, 12, 16, 32])
def test_interpolated_embedding_is_deits_bicubic_resize_of_the_trained_block(side):
    m = method()
    with torch.no_grad():
        m.table.normal_()  # a table far from its init, so a wrong layout cannot pass by chance
    trained = m.table[:8, :8].detach().reshape(1, 64, 16)  # row-major cells, as ViT's tokens
    expected = deit_resize(trained, side)[0]  # (side**2, d)
    with torch.no_grad():
        got = m.input_embedding(grid_positions(side, side))
    assert_matches_reference(got, expected, method="learned_2d", reference="DeiT / MAE interpolate_pos_embed (bicubic)",
                             atol=1e-6, rtol=0)
    assert not torch.allclose(got[: min(side, 8)], trained[0, : min(side, 8)])  # resized, not the raw rows


def test_the_training_side_reads_the_table_exactly_in_both_modes():
    for interpolate in (True, False):
        m = method(interpolate=interpolate)
        with torch.no_grad():
            got = m.input_embedding(grid_positions(8, 8))
        assert torch.equal(got, m.table[:8, :8].reshape(64, 16).detach())


def test_uninterpolated_reads_each_cells_own_row():
    m = method(interpolate=False)
    cells = torch.randint(0, 32, (3, 50, 2))  # (B, T, 2): any cells of the table
    with torch.no_grad():
        got = m.input_embedding(cells)
        assert torch.equal(got, m.table[cells[..., 0], cells[..., 1]])
        plain = m.input_embedding(grid_positions(16, 16))  # (256, d)
    assert torch.equal(plain[5 * 16 + 11], m.table[5, 11].detach())  # cell (5, 11) of a 16 x 16 grid
    assert torch.equal(plain.reshape(16, 16, 16), m.table[:16, :16].detach())


def test_batched_cells_read_the_same_rows_as_shared_cells():
    m = method()
    cells = grid_positions(16, 16)
    with torch.no_grad():
        shared, batched = m.input_embedding(cells), m.input_embedding(cells.expand(2, -1, -1))
    assert batched.shape == (2, 256, 16) and torch.equal(batched[1], shared)


def test_init_is_normal_at_init_std_and_the_same_draw_in_both_modes():
    interpolated, plain = method(), method(interpolate=False)
    assert interpolated.table.shape == plain.table.shape == (32, 32, 16)
    assert torch.equal(interpolated.table, plain.table)
    table = plain.table.detach()
    std = float(table.std())
    assert abs(std - 0.02) < 0.0005 and abs(float(table.mean())) < 0.0005
    assert abs(float(method(init_std=0.1).table.detach().std()) - 0.1) < 0.0025


@pytest.mark.parametrize("interpolate, side", [(True, 8), (True, 16), (False, 8), (False, 16)])
def test_gradients_reach_exactly_the_cells_read(interpolate, side):
    """Training (side 8) reaches only the top-left 8 x 8 block; the resize at 16 also reads only
    that block; the plain read at 16 reaches its own 16 x 16 cells."""
    m = method(interpolate=interpolate)
    m.input_embedding(grid_positions(side, side)).pow(2).sum().backward()
    reached = m.table.grad.abs().sum(-1) > 0  # (32, 32)
    block = 8 if interpolate else side
    expected = torch.zeros(32, 32, dtype=torch.bool)
    expected[:block, :block] = True
    assert torch.equal(reached, expected)


def test_the_two_modes_train_identically():
    """Same draw, same cells read at the training side: a few optimizer steps leave the two
    modes' tables bitwise equal, and the cells past the training block at their init."""
    tables = []
    for interpolate in (True, False):
        torch.manual_seed(1)
        model = build_model(GRID, "learned_2d", {"train_context": 16, "interpolate": interpolate, "max_side": 8})
        init = model.position.table.detach().clone()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        for _ in range(3):
            x = torch.randint(0, 11, (2, 16))
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
        table = model.position.table.detach()
        assert torch.equal(table[4:], init[4:]) and torch.equal(table[:, 4:], init[:, 4:])
        assert not torch.equal(table[:4, :4], init[:4, :4])
        tables.append(table)
    assert torch.equal(tables[0], tables[1])


@pytest.mark.parametrize("interpolate", [True, False])
def test_grid_model_forward_backward_at_the_training_side_and_past_it(interpolate):
    torch.manual_seed(0)
    model = build_model(GRID, "learned_2d", {"train_context": 16, "interpolate": interpolate})
    for T in (16, 64):
        x = torch.randint(0, 11, (2, T))
        logits = model(x)
        assert logits.shape == (2, T, 11) and torch.isfinite(logits).all()
        logits.float().pow(2).mean().backward()
        assert model.position.table.grad is not None and torch.isfinite(model.position.table.grad).all()
        model.zero_grad()


def test_a_side_past_the_table_is_one_error_naming_max_side():
    m = method(interpolate=False)
    assert m.max_positions == 32**2
    with pytest.raises(PosbenchError, match="method.max_side"):
        m.input_embedding(grid_positions(33, 33))
    interpolated = method()
    assert interpolated.max_positions is None  # a resize reaches any side
    assert interpolated.input_embedding(grid_positions(40, 40)).shape == (1600, 16)


@pytest.mark.parametrize("options, match", [
    ({"train_context": 63}, "not a square grid"),
    ({"train_context": 0}, "train_context"),
    ({"train_context": 1600}, "raise method.max_side to at least 40"),
    ({"max_side": 0}, "max_side"),
    ({"init_std": 0.0}, "init_std"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        build_method("learned_2d", DIMS, **options)


def test_a_run_fills_train_context_and_refuses_a_grid_past_max_side_before_training():
    from helpers import compose_config

    from posbench.runs.spec import build_spec

    spec = build_spec(compose_config("train", ["task=life", "method=learned_2d"]))
    assert spec.trainer.context == 64 and spec.method_options["train_context"] == 64
    assert build_method("learned_2d", DIMS).train_side == 16  # outside a run: trainer.context's default, 256
    overrides = ["task=life", "method=learned_2d", "method.interpolate=false", "eval.lengths=[64,256,4096]"]
    with pytest.raises(PosbenchError, match="needs 4096; raise method.max_side to at least 64$"):
        build_spec(compose_config("train", overrides))
    build_spec(compose_config("train", [*overrides, "method.max_side=64"]))
    build_spec(compose_config("train", overrides[:2] + overrides[3:]))  # interpolated: any side


def test_in_training_validation_past_c_is_left_out_where_the_table_stops():
    """The task runs' validation on 2x the side (256 cells for life) read cells past a
    max_side of 12 and failed at the first validation, after training had started; it is now
    left out with a note naming the fix, as the text runs' C-2C set is."""
    from types import SimpleNamespace

    from posbench.tasks import make_task
    from posbench.train.task_workload import TaskWorkload

    workload = TaskWorkload(make_task({"name": "life"}, 64), {"name": "life"})
    t = SimpleNamespace(context=64, val_sequences=4, val_extrapolation_sequences=2)
    for max_side, expected in ((12, ["val"]), (16, ["val", "val_64_256"])):
        model = build_model(GRID, "learned_2d", {"train_context": 64, "interpolate": False, "max_side": max_side})
        notes: list[str] = []
        sets = workload.validation_sets(model, t, notes.append)
        assert list(sets) == expected
        assert notes == ([] if max_side == 16 else [
            "note: no val_accuracy_64_256 during training: the method's positions stop at 144 "
            "(raise method.max_side to at least 16)"])
        workload.validation_row(model, sets, 64, 4, torch.device("cpu"), None)  # every set it keeps is readable


def test_a_sequence_table_still_names_max_positions():
    from helpers import compose_config

    from posbench.runs.spec import build_spec

    with pytest.raises(PosbenchError, match=r"needs 1024; raise method.max_positions to at least 1024$"):
        build_spec(compose_config("train", ["method=learned", "method.max_positions=512", "eval.lengths=[256,512,1024]"]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["learned_2d", "sincos_2d"])
def test_viz_draws_an_absolute_grid_method_on_the_grid(name, tmp_path):
    """viz once read a grid method's cells as sequence positions (learned_2d: an IndexError); it
    now draws the embedding's cosine map of the query cells on the grid."""
    from helpers import compose_config

    from posbench.viz.command import run_viz

    files = run_viz(compose_config("viz", [f"method={name}", "model=task", "context=64", f"out={tmp_path / 'out'}"]),
                    log=lambda _: None)
    assert any("grid" in p.name and "similarity" in p.name for p in files), [p.name for p in files]
