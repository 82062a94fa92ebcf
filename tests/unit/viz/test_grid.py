"""posbench viz on the grid layout: the position maps against direct computations written here,
the attended distance in cells against hand-made attention, the recording of bidirectional
attention, and the command on a tiny trained grid run."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import QUICK_TRAIN, QUIET, compose_config

from posbench.methods import ModelDims, PositionMethod, build_method, grid_offset, grid_positions
from posbench.model.transformer import ModelConfig, build_model
from posbench.viz.attention import recording_attention
from posbench.viz.grid_measures import (
    cell_index,
    embedding_similarity,
    grid_attended_distance,
    grid_sides,
    query_cells,
    ring_means,
    rotation_similarity,
    score_map,
)

DIMS = ModelDims(d_model=64, n_heads=4, n_layers=2)  # head_dim 16: 4 frequencies per axis


class Table2D(PositionMethod):
    """A test method: a fixed random row table plus a column table as the input embedding."""

    layouts = ("grid",)

    def __init__(self, dims: ModelDims) -> None:
        super().__init__(dims)
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randn(64, dims.d_model, generator=generator)
        self.cols = torch.randn(64, dims.d_model, generator=generator)

    def input_embedding(self, positions):
        return self.rows[positions[..., 0]] + self.cols[positions[..., 1]]


class Distance2D(PositionMethod):
    """A test method: a score term -slope_h * |cell(q) - cell(k)| in layer 0 only."""

    layouts = ("grid",)
    has_score_term = True

    def score_term(self, q, positions, layer, *, k=None, x=None):
        if layer > 0:
            return None
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

        def fn(b, h, q_idx, kv_idx):
            dy, dx = grid_offset(positions, b, q_idx, kv_idx)
            return -slopes[h] * (dy.float() ** 2 + dx.float() ** 2).sqrt()

        return fn


@pytest.mark.parametrize("side", [8, 16])
def test_axial_rope_map_is_the_mean_of_cosines_per_axis(side):
    """Rotated all-ones vectors: each pair contributes 2 cos(angle difference), so the cosine is
    the mean over the D/2 pairs: half by the column offset, half by the row offset."""
    rope = build_method("axial_rope", DIMS)
    theta = 100.0 ** (-torch.arange(0, 8, 2).double() / 8)  # (D/4,) Heo et al.'s frequencies, R = D/2 = 8
    for cell in query_cells(side).values():
        got = rotation_similarity(rope, DIMS, side, cell).double()  # (H, side, side)
        expected = torch.empty(side, side, dtype=torch.float64)
        for r in range(side):
            for c in range(side):
                dx, dy = cell[1] - c, cell[0] - r
                expected[r, c] = 0.5 * (torch.cos(dx * theta).mean() + torch.cos(dy * theta).mean())
        assert got.shape == (4, side, side)
        assert torch.allclose(got, expected.expand(4, side, side), atol=1e-5)
        assert got[0, cell[0], cell[1]] == pytest.approx(1.0, abs=1e-6)


def test_embedding_map_is_the_cosine_of_the_two_cells_vectors():
    method = Table2D(DIMS)
    side, cell = 6, (2, 3)
    got = embedding_similarity(method, side, cell)
    assert got.shape == (1, side, side)
    query = method.rows[2] + method.cols[3]
    for r in range(side):
        for c in range(side):
            key = method.rows[r] + method.cols[c]
            assert got[0, r, c] == pytest.approx(float(torch.cosine_similarity(query, key, dim=0)), abs=1e-5)
    assert embedding_similarity(build_method("axial_rope", DIMS), side, cell) is None  # no input embedding


def test_score_map_is_the_content_free_term_of_the_query_cell():
    method = Distance2D(DIMS)
    side, cell = 5, (4, 4)
    got = score_map(method, DIMS, side, cell, layer=0)  # (H, side, side)
    for h, slope in enumerate([0.5, 0.25, 0.125, 0.0625]):
        for r in range(side):
            for c in range(side):
                assert got[h, r, c] == pytest.approx(-slope * math.hypot(4 - r, 4 - c), abs=1e-5)
    assert score_map(method, DIMS, side, cell, layer=1) is None


def test_attended_distance_in_cells_of_hand_made_attention():
    side = 3  # cells 0..8, row-major: cell i = (i // 3, i % 3)
    T = side * side
    weights = torch.zeros(T, T)
    weights[0, 8] = 1.0  # (0, 0) -> (2, 2): sqrt(8)
    weights[4, 1] = weights[4, 5] = 0.5  # (1, 1) -> (0, 1) and (1, 2): 1 each
    weights[2, 2] = 1.0  # itself: 0
    weights[6, :] = 1.0 / T  # uniform from (2, 0)
    got = grid_attended_distance(weights)
    assert got[0] == pytest.approx(math.sqrt(8), abs=1e-6)
    assert got[4] == pytest.approx(1.0, abs=1e-6)
    assert got[2] == pytest.approx(0.0, abs=1e-6)
    uniform = sum(math.hypot(2 - r, 0 - c) for r in range(3) for c in range(3)) / T
    assert got[6] == pytest.approx(uniform, abs=1e-5)
    assert torch.equal(got[[1, 3, 5, 7, 8]], torch.zeros(5))  # rows with no attention


def test_ring_means_split_inside_and_beyond_the_training_square():
    side, train_side = 4, 2
    ring = torch.tensor([max(divmod(i, side)) for i in range(side * side)], dtype=torch.float64)
    inside, beyond = ring_means(ring[None], train_side)[0].tolist()
    assert inside == pytest.approx((0 + 1 + 1 + 1) / 4)  # cells (0,0), (0,1), (1,0), (1,1)
    assert beyond == pytest.approx((2 * 5 + 3 * 7) / 12)  # ring 2: 5 cells, ring 3: 7 cells
    at_train = ring_means(torch.ones(2, 4), train_side)  # a 2 x 2 grid: nothing beyond
    assert at_train.shape == (2, 2) and torch.all(at_train[:, 0] == 1) and torch.isnan(at_train[:, 1]).all()


def test_grid_sides_double_up_to_span():
    assert grid_sides(8, 4) == [8, 16, 32]
    assert grid_sides(8, 1) == [8] and grid_sides(4, 3) == [4, 8]
    assert query_cells(8) == {"centre": (4, 4), "corner": (7, 7)} and cell_index(8, (7, 7)) == 63


def test_recorded_grid_attention_is_bidirectional_and_its_distance_in_cells():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8, d_model=32, n_layers=2, n_heads=4, attention="eager", layout="grid")
    model = build_model(cfg, "axial_rope").eval()
    tokens = torch.randint(0, 8, (1, 36))  # a 6 x 6 grid
    with torch.no_grad():
        expected = model(tokens)
        with recording_attention(2, [1]) as record:
            got = model(tokens)
    assert torch.equal(got, expected)
    maps = torch.from_numpy(record.layers[1].maps)  # (H, T, T)
    assert maps.triu(1).sum() > 1  # keys after the query are attended: non-causal
    cells = grid_positions(6, 6).double()
    direct = (maps.double() * torch.cdist(cells, cells)).sum(-1)  # (H, T)
    assert torch.allclose(torch.from_numpy(record.layers[1].distance).double(), direct, atol=1e-5)
    assert record.layers[1].score is None


GRID_TRAIN = [*QUICK_TRAIN, "task=life", "method=axial_rope", "trainer.context=16", "eval.lengths=[16,64]"]


@pytest.mark.slow
def test_viz_of_a_grid_run(trained_run, tmp_path):
    from posbench.viz.command import run_viz

    run = trained_run(*GRID_TRAIN)
    out = tmp_path / "viz"
    lines: list[str] = []
    written = run_viz(compose_config("viz", [f"run={run}", f"out={out}", "span=2", "attention.num_sequences=2",
                                             "wandb=false"]), log=lines.append)
    assert {p.name for p in written} == {"grid_qk_similarity.png", "grid_attention_distance.png",
                                         "grid_attention_layer0.png", "grid_attention_layer1.png",
                                         "grid_attention_distance.json"}
    assert any("not drawn on the grid (they assume a causal 1D sequence)" in line for line in lines)
    numbers = json.loads((out / "grid_attention_distance.json").read_text())
    assert numbers["train_side"] == 4 and numbers["sides"] == [4, 8]
    assert numbers["distance"]["4"][0][0][1] is None  # nothing beyond the training square at its own side
    inside, beyond = numbers["uniform"]["8"]
    cells = grid_positions(8, 8).double()
    mean = torch.cdist(cells, cells).mean(-1)
    ring = cells.max(-1).values
    assert inside == pytest.approx(float(mean[ring < 4].mean())) and beyond == pytest.approx(float(mean[ring >= 4].mean()))
    assert len(numbers["distance"]["8"]) == 2 and len(numbers["distance"]["8"][0]) == 4  # layers, heads


@pytest.mark.slow
def test_viz_of_a_sweep_of_grid_runs_skips_the_overview(trained_run, tmp_path):
    """The overview draws by query position; a sweep of grid runs draws each run and says why not."""
    import shutil

    from posbench.viz.command import run_viz

    sweep = tmp_path / "sweep"
    shutil.copytree(trained_run(*GRID_TRAIN), sweep / "0_life-axial_rope-s0")
    lines: list[str] = []
    written = run_viz(compose_config("viz", [f"run={sweep}", f"out={tmp_path / 'viz'}", "span=1",
                                             "attention.num_sequences=1"]), log=lines.append)
    assert tmp_path / "viz" / "0_life-axial_rope-s0" / "grid_attention_distance.png" in written
    assert not (tmp_path / "viz" / "overview.png").exists()
    assert "overview not drawn: it draws loss and attended distance by query position, which grid runs lack" in lines


@pytest.mark.slow
def test_viz_method_of_a_grid_method_draws_its_maps(tmp_path):
    from posbench.core.errors import PosbenchError
    from posbench.viz.command import run_viz

    out = tmp_path / "axial"
    written = run_viz(compose_config("viz", ["method=axial_rope", "model=tiny", "context=64", f"out={out}"]),
                      log=lambda _: None)
    assert written == [out / "grid_qk_similarity.png"] and written[0].stat().st_size > 1000
    with pytest.raises(PosbenchError, match="context=60 is not a square grid"):
        run_viz(compose_config("viz", ["method=axial_rope", "model=tiny", "context=60", f"out={tmp_path / 'x'}"]))
    assert not (tmp_path / "x").exists()


class LayerScaledRoPE(PositionMethod):
    """A test method: axial RoPE whose cells are scaled by (layer + 1), so its layers differ."""

    layouts = ("grid",)

    def __init__(self, dims: ModelDims) -> None:
        super().__init__(dims)
        self.inner = build_method("axial_rope", dims)

    def rotate_qk(self, q, k, positions, layer=0):
        return self.inner.rotate_qk(q, k, positions * (layer + 1), layer)


@pytest.mark.slow
def test_maps_are_drawn_per_layer_only_when_layers_differ(tmp_path):
    from posbench.viz.grid import grid_signal_figures
    from posbench.viz.settings import VizSettings

    dims = ModelDims(d_model=32, n_heads=2, n_layers=2)
    settings = VizSettings(span=1).validate()
    same = grid_signal_figures(build_method("axial_rope", dims), dims, 4, settings, tmp_path / "a", "a", QUIET)
    assert same == [tmp_path / "a" / "grid_qk_similarity.png"]
    per_layer = grid_signal_figures(LayerScaledRoPE(dims), dims, 4, settings, tmp_path / "b", "b", QUIET)
    assert per_layer == [tmp_path / "b" / "grid_qk_similarity_layer0.png", tmp_path / "b" / "grid_qk_similarity_layer1.png"]
    score = grid_signal_figures(Distance2D(DIMS), DIMS, 4, settings, tmp_path / "c", "c", QUIET)
    assert score == [tmp_path / "c" / "grid_score_term_layer0.png", tmp_path / "c" / "grid_score_term_layer1.png"]
