"""Means, 95 % intervals and paired differences for results that come in seeds and sequences.

Two sources of noise matter in posbench and each has its interval:

- **Across seeds** (>= 2 runs): a Student-t interval over the runs' values. Seeds differ in
  initialisation and data order, so this is the spread a reader cares about when asking "would
  another training run give the same number?".
- **One seed**: a percentile bootstrap over the evaluated sequences, using the per-sequence band
  means stored in results.json. It only measures which windows were evaluated, not training
  noise: on the cpu_quick runs it is 3-9x narrower than the spread between seeds. So a one-seed
  value is *widened* by the between-seed sd pooled over the values that do have seeds
  (:func:`pooled_seed_sd`, :func:`one_seed_interval`): half-width
  ``sqrt(bootstrap half-width^2 + (t_df * pooled sd)^2)``, kind ``1 seed``.

Differences between two methods are *paired*: by seed over the seeds both have (a t-interval over
the per-seed differences, which holds the between-seed variance). With one common seed the
difference is that seed's, with an interval widened as above by the pooled between-seed sd of
paired differences, or none when no pair has two seeds to estimate it from; it never gets a
verdict (:attr:`Interval.distinguishable` is None), because one seed cannot order two methods.
A difference over >= 2 seeds whose interval contains 0 is reported as not distinguishable.

No scipy: the t quantile comes from the closed-form Student-t distribution function for integer
degrees of freedom (Abramowitz & Stegun 26.7.3-26.7.4), inverted by bisection.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from posbench.runs.results_types import IntervalSummary

LEVEL = 0.95
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
ONE_SEED = "1 seed"


@dataclass(frozen=True)
class Interval:
    """A mean with a two-sided interval. ``low``/``high`` are None when no interval exists (one
    value without per-sequence data)."""

    mean: float
    low: float | None
    high: float | None
    n: int
    """Number of values the interval is over (seeds, or sequences for a bootstrap)."""
    kind: str
    """``t`` (Student-t over seeds), ``bootstrap`` (over sequences, one seed), ``1 seed`` (one
    seed's value widened by a pooled between-seed sd: never a verdict) or ``none``."""

    @property
    def half_width(self) -> float | None:
        return None if self.low is None or self.high is None else (self.high - self.low) / 2

    @property
    def distinguishable(self) -> bool | None:
        """Whether the interval excludes 0 (None when there is no interval, and for a ``1 seed``
        value, which orders nothing)."""
        if self.low is None or self.high is None or self.kind == ONE_SEED:
            return None
        return not (self.low <= 0.0 <= self.high)

    def to_dict(self) -> IntervalSummary:
        return asdict(self) | {"half_width": self.half_width}


def t_cdf_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer ``df`` >= 1 (exact, A&S 26.7.3 / 26.7.4)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:  # odd: (2/pi) * (theta + sin cos * (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        total, term = 0.0, 1.0
        if df > 1:
            total = term
            for k in range(1, (df - 3) // 2 + 1):
                term *= (2 * k) / (2 * k + 1) * c2
                total += term
        return 2 / math.pi * (theta + s * math.cos(theta) * total)
    # even: sin * (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...), up to cos^(df-2)
    total, term = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):
        term *= (2 * k - 1) / (2 * k) * c2
        total += term
    return s * total


def t_quantile(df: int, level: float = LEVEL) -> float:
    """The t with P(|T| <= t) = ``level``: the multiplier of a two-sided ``level`` interval."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    lo, hi = 0.0, 1.0
    while t_cdf_two_sided(hi, df) < level:
        hi *= 2
    for _ in range(200):  # bisection to float precision
        mid = (lo + hi) / 2
        if t_cdf_two_sided(mid, df) < level:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


def _values(values: Sequence[float], name: str) -> tuple[np.ndarray, float, Interval | None]:
    """(values as float64, their mean, the no-interval answer for a single value or None)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError(f"{name} needs at least one value")
    mean = float(x.mean())
    return x, mean, Interval(mean, None, None, 1, "none") if x.size < 2 else None


def t_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean and Student-t interval ``mean +- t_{n-1} * sd / sqrt(n)`` (sd with n - 1); a single
    value gets no interval."""
    x, mean, single = _values(values, "t_interval")
    if single:
        return single
    half = t_quantile(x.size - 1, level) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(mean, mean - half, mean + half, int(x.size), "t")


def bootstrap_interval(values: Sequence[float], level: float = LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = BOOTSTRAP_SEED) -> Interval:
    """Mean and percentile-bootstrap interval of the mean over ``values`` (e.g. sequences).

    Deterministic: ``resamples`` resamples drawn with ``numpy.random.default_rng(seed)``, each
    ``n`` indices with replacement; the interval is the (1 - level)/2 and (1 + level)/2
    quantiles (numpy's default linear interpolation) of the resampled means.
    """
    x, mean, single = _values(values, "bootstrap_interval")
    if single:
        return single
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)  # (resamples,)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return Interval(mean, float(low), float(high), int(x.size), "bootstrap")


def across_runs(run_values: Sequence[float], sequence_values: Sequence[float] | None = None,
                level: float = LEVEL) -> Interval:
    """The interval of one method: over seeds when there are >= 2 runs, else a bootstrap over the
    single run's per-sequence values (when given), else none."""
    if len(run_values) >= 2 or not sequence_values:
        return t_interval(run_values, level)
    return bootstrap_interval(sequence_values, level)


@dataclass(frozen=True)
class SeedSpread:
    """The between-seed sd of a quantity, pooled over the samples that have >= 2 seeds."""

    sd: float
    df: int
    """Degrees of freedom of the pooled variance (what the t multiplier uses)."""
    samples: int
    """How many samples (groups, or pairs of groups) it was pooled over."""


def pooled_seed_sd(samples: Iterable[Sequence[float]], max_df: int | None = None) -> SeedSpread | None:
    """Pooled sd ``sqrt(sum_i sum_s (x_is - mean_i)^2 / sum_i (n_i - 1))`` over the ``samples``
    (one value per seed each) with >= 2 values; None when none has. ``max_df`` caps the degrees
    of freedom where the samples are not independent (differences sharing a group)."""
    squares, df, used = 0.0, 0, 0
    for sample in samples:
        x = np.asarray(sample, dtype=np.float64)
        if x.size >= 2:
            squares += float(((x - x.mean()) ** 2).sum())
            df += x.size - 1
            used += 1
    if not df:
        return None
    return SeedSpread(math.sqrt(squares / df), max(1, min(df, max_df)) if max_df is not None else df, used)


def one_seed_interval(value: float, sequences: Interval | None, spread: SeedSpread | None,
                      level: float = LEVEL) -> Interval:
    """One seed's ``value`` with a ``level`` interval for what another seed would give:
    half-width ``sqrt(h_seq^2 + (t_df * spread.sd)^2)``, ``h_seq`` the half-width of the bootstrap
    over its sequences (``sequences``; 0 without one). No interval without a ``spread``. Kind
    ``1 seed``: it is never a verdict (:attr:`Interval.distinguishable` is None)."""
    if spread is None:
        return Interval(value, None, None, 1, ONE_SEED)
    seq_half = (sequences.half_width if sequences is not None else None) or 0.0
    half = math.hypot(seq_half, t_quantile(spread.df, level) * spread.sd)
    return Interval(value, value - half, value + half, 1, ONE_SEED)


def paired_difference(a_by_seed: dict[Any, float], b_by_seed: dict[Any, float],
                      a_sequences: dict[Any, Sequence[float]] | None = None,
                      b_sequences: dict[Any, Sequence[float]] | None = None,
                      level: float = LEVEL, spread: SeedSpread | None = None) -> Interval | None:
    """A minus B, paired by seed over the seeds both have: with >= 2 a t-interval over the
    per-seed differences (between-seed variance included). With one common seed, that seed's
    difference as a :func:`one_seed_interval` widened by ``spread`` (the pooled between-seed sd of
    paired differences; no interval without it), its sequence part a bootstrap over the paired
    per-sequence values when both hold them for the same windows (same length). None when the two
    share no seed."""
    common = [s for s in a_by_seed if s in b_by_seed]
    if not common:
        return None
    if len(common) >= 2:
        return t_interval([a_by_seed[s] - b_by_seed[s] for s in common], level)
    seed = common[0]
    a_seq = (a_sequences or {}).get(seed)
    b_seq = (b_sequences or {}).get(seed)
    sequences = None
    if a_seq is not None and b_seq is not None and len(a_seq) == len(b_seq) and len(a_seq) >= 2:
        sequences = bootstrap_interval(np.subtract(a_seq, b_seq, dtype=np.float64), level)
    return one_seed_interval(a_by_seed[seed] - b_by_seed[seed], sequences, spread, level)


def pointwise_t_band(curves: np.ndarray, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) per column of ``curves`` ``[runs, points]``; low = high = mean for one run."""
    curves = np.asarray(curves, dtype=np.float64)
    mean = curves.mean(axis=0)
    if curves.shape[0] < 2:
        return mean, mean, mean
    half = t_quantile(curves.shape[0] - 1, level) * curves.std(axis=0, ddof=1) / math.sqrt(curves.shape[0])
    return mean, mean - half, mean + half


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average of ``window`` points that ignores non-finite values and shrinks at
    the ends (point i averages i - window//2 .. i - window//2 + window - 1, clipped)."""
    values = np.asarray(values, dtype=np.float64)
    if window <= 1 or values.size == 0:
        return values
    finite = np.isfinite(values)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    ccount = np.concatenate([[0], np.cumsum(finite)])
    idx = np.arange(values.size)
    lo = np.clip(idx - window // 2, 0, values.size)
    hi = np.clip(idx - window // 2 + window, 0, values.size)
    count = ccount[hi] - ccount[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (csum[hi] - csum[lo]) / np.maximum(count, 1), np.nan)


__all__ = ["Interval", "LEVEL", "ONE_SEED", "SeedSpread", "across_runs", "bootstrap_interval", "moving_average",
           "one_seed_interval", "paired_difference", "pointwise_t_band", "pooled_seed_sd", "t_cdf_two_sided",
           "t_interval", "t_quantile"]
