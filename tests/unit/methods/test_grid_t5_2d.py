"""t5_2d: T5's bidirectional buckets per axis (against transformers' T5Attention) and a learned
bias per (row bucket, column bucket, head), against a gather written here."""

from __future__ import annotations

import pytest
import torch
from grid_score_checks import (
    assert_backends_agree,
    assert_gradients_reach_parameters,
    assert_scores_depend_only_on_offsets,
    dense_term,
)
from model_checks import assert_matches_reference
from transformers.models.t5.modeling_t5 import T5Attention

from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method, grid_positions
from posbench.model.transformer import ModelConfig, build_model


def make(**options):
    torch.manual_seed(0)
    method = build_method("t5_2d", ModelDims(d_model=32, n_heads=2, n_layers=2), **options)
    with torch.no_grad():
        method.bias.normal_()
    return method


def hf_bucket(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    return T5Attention._relative_position_bucket(relative, bidirectional=True, num_buckets=num_buckets,
                                                 max_distance=max_distance)


@pytest.mark.parametrize("num_buckets, max_distance", [(16, 8), (32, 128), (8, 20), (6, 5)])
def test_t5_2d_buckets_are_t5s_bidirectional_buckets_of_each_axis(num_buckets, max_distance):
    """Offsets (key - query) from -300 to 300 on each axis, as transformers buckets them."""
    method = make(num_buckets=num_buckets, max_distance=max_distance)
    offsets = torch.arange(-300, 301)
    dy, dx = offsets[:, None].expand(-1, 601), offsets[None, :].expand(601, -1)  # query - key
    row, col = method.buckets(dy, dx)
    for got, offset in ((row, dy), (col, dx)):
        assert_matches_reference(got, hf_bucket(-offset, num_buckets, max_distance), method="t5_2d",
                                 reference="transformers T5Attention._relative_position_bucket (bidirectional)",
                                 atol=0, rtol=0)


def test_t5_2d_default_buckets_give_each_training_offset_its_own_bucket():
    """Defaults (16, 8): on an 8 x 8 grid (offsets -7..7) 15 distinct buckets; every offset of 7 or
    more (of either sign) shares the bucket of 7, so a larger grid reads only trained buckets."""
    method = make()
    offsets = torch.arange(-7, 8)
    row, _ = method.buckets(offsets, offsets)
    assert len(set(row.tolist())) == 15
    far, _ = method.buckets(torch.arange(7, 40), torch.zeros(33, dtype=torch.long))
    near, _ = method.buckets(-torch.arange(7, 40), torch.zeros(33, dtype=torch.long))
    assert set(far.tolist()) == {row[-1].item()} and set(near.tolist()) == {row[0].item()}


def test_t5_2d_bias_is_the_table_gathered_by_the_buckets_of_each_pair():
    """bias[b, h, i, j] = bias_scale * table[bucket(y_j - y_i), bucket(x_j - x_i), h] for per-row
    cells (B, T, 2), the buckets from transformers; the same table for every layer."""
    method = make(num_buckets=8, max_distance=5, bias_scale=3.0)
    cells = torch.stack((grid_positions(5, 5), grid_positions(5, 5).flip(-1) * 4))  # (2, 25, 2)
    want = torch.zeros(2, 2, 25, 25)
    for b in range(2):
        for i in range(25):
            for j in range(25):
                rel = cells[b, j] - cells[b, i]  # key - query
                by, bx = (hf_bucket(rel[k], 8, 5).item() for k in range(2))
                want[b, :, i, j] = 3.0 * method.bias[by, bx].detach()
    q = torch.randn(2, 2, 25, 16)
    with torch.no_grad():
        for layer in (0, 1):
            assert_matches_reference(dense_term(method, q, cells, layer), want, method="t5_2d",
                                     reference="table[HF bucket(dy), HF bucket(dx), h], pair by pair")


def test_t5_2d_bias_scale_defaults_to_sqrt_head_dim():
    assert make().bias_scale == 16**0.5


def test_t5_2d_runs_alike_in_eager_sdpa_and_flex():
    assert_backends_agree("t5_2d", {"num_buckets": 8, "max_distance": 3})  # 5 x 5 grid: log and last buckets


def test_t5_2d_gradients_reach_the_table():
    assert_gradients_reach_parameters("t5_2d")


def test_t5_2d_scores_depend_only_on_offsets():
    assert_scores_depend_only_on_offsets("t5_2d")


@pytest.mark.parametrize("options, message", [
    ({"num_buckets": 7}, "t5_2d needs an even num_buckets >= 4"),
    ({"num_buckets": 16, "max_distance": 4}, "max_distance > num_buckets / 4"),
    ({"bias_scale": 0.0}, "t5_2d needs bias_scale > 0"),
])
def test_t5_2d_refuses_bad_options(options, message):
    with pytest.raises(PosbenchError, match=message):
        build_model(ModelConfig(vocab_size=11, d_model=32, n_layers=2, n_heads=2, layout="grid"), "t5_2d", options)
