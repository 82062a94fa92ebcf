"""Intervals and paired differences against explicit computations (no scipy)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from posbench.evaluation.stats import (
    ONE_SEED,
    Interval,
    SeedSpread,
    across_runs,
    bootstrap_interval,
    moving_average,
    one_seed_interval,
    paired_difference,
    pointwise_t_band,
    pooled_seed_sd,
    t_interval,
    t_quantile,
)

# Two-sided 95 % Student-t critical values t_{0.975, df} from a printed table.
T_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
           10: 2.228, 15: 2.131, 20: 2.086, 29: 2.045, 30: 2.042, 60: 2.000, 120: 1.980}


@pytest.mark.parametrize("df", sorted(T_TABLE))
def test_t_quantile_matches_the_table(df: int) -> None:
    assert t_quantile(df) == pytest.approx(T_TABLE[df], abs=6e-4)


def test_t_quantile_other_levels_and_limit() -> None:
    assert t_quantile(4, level=0.90) == pytest.approx(2.132, abs=6e-4)
    assert t_quantile(10, level=0.99) == pytest.approx(3.169, abs=6e-4)
    assert t_quantile(5000) == pytest.approx(1.95996, abs=1e-3)  # the normal limit


def test_t_interval_explicit() -> None:
    values = [3.10, 3.16, 3.13]
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    got = t_interval(values)
    half = 4.303 * sd / math.sqrt(3)
    assert got.kind == "t" and got.n == 3 and got.mean == pytest.approx(mean)
    assert got.low == pytest.approx(mean - half, abs=1e-4) and got.high == pytest.approx(mean + half, abs=1e-4)
    single = t_interval([3.1])
    assert single.low is None and single.kind == "none" and single.distinguishable is None


def test_bootstrap_interval_explicit_loop() -> None:
    values = np.random.default_rng(1).normal(0.3, 1.0, 40)
    got = bootstrap_interval(values, resamples=2000, seed=7)
    rng = np.random.default_rng(7)
    draws = rng.integers(0, 40, size=(2000, 40))
    means = sorted(sum(values[j] for j in row) / 40 for row in draws)
    # numpy's default quantile: linear interpolation at (resamples - 1) * q
    def quantile(q: float) -> float:
        pos = (len(means) - 1) * q
        lo = int(math.floor(pos))
        return means[lo] + (means[min(lo + 1, len(means) - 1)] - means[lo]) * (pos - lo)
    assert got.kind == "bootstrap" and got.n == 40
    assert got.low == pytest.approx(quantile(0.025)) and got.high == pytest.approx(quantile(0.975))


@pytest.mark.slow
def test_bootstrap_close_to_the_normal_interval_for_many_values() -> None:
    values = np.random.default_rng(2).normal(0.0, 1.0, 2000)
    got = bootstrap_interval(values)
    half = 1.96 * values.std(ddof=1) / math.sqrt(values.size)
    assert got.half_width == pytest.approx(half, rel=0.08)


def test_across_runs_picks_seeds_or_sequences() -> None:
    assert across_runs([1.0, 1.2]).kind == "t"
    assert across_runs([1.0], [0.9, 1.1, 1.0, 1.0]).kind == "bootstrap"
    assert across_runs([1.0]).kind == "none"


def test_paired_difference_by_seed_and_by_sequence() -> None:
    a, b = {0: 3.0, 1: 3.2, 2: 3.1}, {0: 2.9, 1: 3.05, 2: 3.0, 5: 1.0}
    diff = paired_difference(a, b)
    expected = t_interval([3.0 - 2.9, 3.2 - 3.05, 3.1 - 3.0])
    assert diff == expected and diff.distinguishable is True
    assert paired_difference({0: 1.0}, {1: 1.0}) is None
    # one common seed: the bootstrap over the per-sequence differences widened by the seed spread
    seq_a = {0: [1.0, 2.0, 3.0, 4.0]}
    seq_b = {0: [0.5, 2.5, 2.0, 4.5]}
    spread = SeedSpread(0.015, 20, 45)
    one = paired_difference({0: 2.5}, {0: 2.375}, seq_a, seq_b, spread=spread)
    half = math.hypot(bootstrap_interval(np.subtract(seq_a[0], seq_b[0])).half_width, 2.086 * 0.015)
    assert one.kind == ONE_SEED and one.n == 1 and one.mean == pytest.approx(0.125)
    assert one.half_width == pytest.approx(half, rel=1e-3) and one.distinguishable is None
    # different windows (lengths differ): the seed spread alone
    other = paired_difference({0: 2.5}, {0: 2.0}, seq_a, {0: [1.0, 2.0]}, spread=spread)
    assert other.half_width == pytest.approx(2.086 * 0.015, rel=1e-3) and other.distinguishable is None
    # no seed spread to widen by: the difference alone, never the sequences' interval
    bare = paired_difference({0: 2.5}, {0: 2.375}, seq_a, seq_b)
    assert bare.low is None and bare.kind == ONE_SEED and bare.distinguishable is None


def test_one_seed_never_gives_a_verdict() -> None:
    """A one-seed difference far from 0 on its sequences still orders nothing (cpu_quick's
    three seeds: fox - alibi per seed -0.015 / +0.014 / -0.008, a one-seed half-width of 0.005)."""
    seq_a = {0: list(np.linspace(3.0, 3.2, 50))}
    seq_b = {0: list(np.linspace(3.0, 3.2, 50) + 0.015)}
    spread = pooled_seed_sd([[-0.015, 0.014, -0.008]])
    one = paired_difference({0: 3.1}, {0: 3.115}, seq_a, seq_b, spread=spread)
    assert one.low <= 0 <= one.high and one.distinguishable is None
    wide = one_seed_interval(-1.0, None, spread)  # even an interval that excludes 0
    assert wide.high < 0 and wide.distinguishable is None


def test_pooled_seed_sd_explicit() -> None:
    samples = [[1.0, 1.2, 1.1], [2.0, 2.4], [5.0]]  # the single value adds nothing
    squares = (0.01 + 0.01 + 0.0) + (0.04 + 0.04)
    got = pooled_seed_sd(samples)
    assert got == SeedSpread(pytest.approx(math.sqrt(squares / 3)), 3, 2)
    assert pooled_seed_sd(samples, max_df=2).df == 2
    assert pooled_seed_sd([[1.0], [2.0]]) is None
    interval = one_seed_interval(3.0, Interval(3.0, 2.9, 3.1, 40, "bootstrap"), SeedSpread(0.05, 3, 2))
    half = math.hypot(0.1, 3.182 * 0.05)
    assert interval.low == pytest.approx(3.0 - half, abs=1e-4) and interval.high == pytest.approx(3.0 + half, abs=1e-4)
    assert one_seed_interval(3.0, None, None).low is None


def test_interval_crossing_zero_is_not_distinguishable() -> None:
    assert Interval(0.01, -0.01, 0.03, 3, "t").distinguishable is False
    assert Interval(-0.02, -0.03, -0.01, 3, "t").distinguishable is True


def test_pointwise_band_and_moving_average() -> None:
    curves = np.array([[1.0, 2.0], [1.2, 2.0], [1.4, 2.6]])
    mean, low, high = pointwise_t_band(curves)
    first = t_interval(curves[:, 0])
    assert mean[0] == pytest.approx(first.mean) and low[0] == pytest.approx(first.low)
    assert high[1] == pytest.approx(t_interval(curves[:, 1]).high)
    np.testing.assert_allclose(moving_average(np.arange(5.0), 3), [0.5, 1, 2, 3, 3.5])
