"""What a loss curve says: band means, per-sequence band means, cumulative perplexity, perplexity
ratios and the effective length (numpy only: the per-(split, length) numbers of results.json).

Band ``"a-b"`` is the mean over positions ``a .. b-1``: ``0-C`` inside the training context C,
``C-2C`` the headline extrapolation band, then one band per doubling, each only when it lies fully
inside the evaluated length.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from posbench.core.errors import PosbenchError
from posbench.evaluation.stats import moving_average
from posbench.runs.results_types import CurveSummary

# Effective length: smoothing in positions (its tolerance in nats is eval.effective_length_eps).
EFFECTIVE_LENGTH_WINDOW = 64


def band_edges(length: int, train_context: int) -> list[tuple[int, int]]:
    """``(a, b)`` of every band ``"a-b"`` fully inside ``length``: 0-C, C-2C, 2C-4C, ..."""
    if train_context <= 0:
        raise PosbenchError(f"train_context must be positive, got {train_context}")
    edges = [0, train_context]
    while edges[-1] * 2 <= length:
        edges.append(edges[-1] * 2)
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b <= length]


def band_means(loss_by_position: Sequence[float] | Any, train_context: int = 256) -> dict[str, float]:
    """Mean loss per position band: ``"0-C"``, ``"C-2C"``, ``"2C-4C"``, ... (C = train_context).

    Only bands that lie fully inside the evaluated length are returned, so a length below
    ``2 * C`` has no headline band and a length below ``C`` has no band at all. Band ``"a-b"`` is
    the mean over positions ``a .. b-1``.
    """
    if hasattr(loss_by_position, "detach"):  # a torch tensor, of any dtype and device
        values = loss_by_position.detach().double().cpu().numpy()
    else:
        values = np.asarray(loss_by_position, dtype=np.float64)
    return {f"{a}-{b}": float(values[a:b].mean()) for a, b in band_edges(values.shape[0], train_context)}


def sequence_band_means(per_sequence: np.ndarray, train_context: int) -> dict[str, list[float]]:
    """Per-sequence band means of ``[N, L]`` losses: ``{band: [N values]}``, so two runs scored on
    the same windows can be paired sequence by sequence."""
    return {f"{a}-{b}": per_sequence[:, a:b].mean(axis=1).tolist()
            for a, b in band_edges(per_sequence.shape[1], train_context)}


def cumulative_perplexity(loss_by_position: np.ndarray) -> np.ndarray:
    """``P(l) = exp(mean loss over positions 0..l)``: the perplexity of the first ``l + 1``
    positions (of the mean curve, so every token of positions 0..l weighs the same)."""
    values = np.asarray(loss_by_position, dtype=np.float64)
    return np.exp(np.cumsum(values) / np.arange(1, values.size + 1))


def perplexity_ratios(bands: dict[str, float], train_context: int) -> dict[str, float]:
    """``PPL(band) / PPL(0-C) = exp(band - band(0-C))`` per band (empty without a 0-C band)."""
    inner = bands.get(f"0-{train_context}")
    return {} if inner is None else {band: math.exp(value - inner) for band, value in bands.items()}


def effective_length(loss_by_position: np.ndarray, reference: np.ndarray | float, train_context: int,
                     eps: float, window: int = EFFECTIVE_LENGTH_WINDOW) -> int:
    """How far past the training context the loss stays close to a reference.

    The smoothed curve (centred moving average of ``window`` positions,
    :func:`posbench.evaluation.stats.moving_average`) is compared with ``reference`` (a level, e.g. the 0-C
    band mean, or a curve smoothed the same way, e.g. the windowed loss) from position ``C`` on.
    Returns the first position ``t >= C`` where it exceeds the reference by more than ``eps``
    nats, so positions ``0 .. result - 1`` are usable; ``L`` (the evaluated length) means it never
    left within the evaluated length, a lower bound. Only getting worse counts: a loss below the
    reference is the model using its context.
    """
    curve = moving_average(np.asarray(loss_by_position, dtype=np.float64), window)
    if not np.isscalar(reference):
        reference = moving_average(np.asarray(reference, dtype=np.float64), window)
    excess = (curve - reference)[train_context:] > eps
    return int(train_context + np.argmax(excess)) if excess.any() else int(curve.size)


def curve_summary(per_sequence: np.ndarray, train_context: int) -> CurveSummary:
    """``loss_by_position``, ``bands``, ``sequence_bands``, ``cumulative_perplexity`` and
    ``perplexity_ratio`` of ``[N, L]`` per-sequence losses (the per-(split, length) block of
    results.json, for the full or the windowed pass)."""
    curve = per_sequence.mean(axis=0)
    bands = band_means(curve, train_context)
    return {
        "loss_by_position": curve.tolist(),
        "bands": bands,
        "sequence_bands": sequence_band_means(per_sequence, train_context),
        "cumulative_perplexity": cumulative_perplexity(curve).tolist(),
        "perplexity_ratio": perplexity_ratios(bands, train_context),
    }
