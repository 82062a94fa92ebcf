"""The figures of ``posbench viz``, drawn with the figure toolkit of :mod:`posbench.report.figures`.

Each function takes the numbers (numpy arrays from :mod:`posbench.viz.measures` and
:mod:`posbench.viz.attention`) and returns a figure; every figure marks the training context C.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from posbench.evaluation.stats import moving_average
from posbench.report.figures import colour_of, new_figure, no_data
from posbench.viz.attention import AttentionRecord

TRAINED_SHADE = "#d9ead3"  # light green behind 0..C: distances/positions seen in training
EXTRAPOLATED_SHADE = "#f4cccc"  # light red behind C..span x C: never seen in training


def _mark_context(ax: Any, context: int, axis: str = "x", label: bool = True) -> None:
    kwargs = dict(color="black", linestyle="--", linewidth=1)
    if axis in ("x", "xy"):
        ax.axvline(context, label=f"training context C = {context}" if label else None, **kwargs)
    if axis in ("y", "xy"):
        ax.axhline(context, **kwargs)


def _shade_ranges(ax: Any, context: int, end: int) -> None:
    ax.axvspan(0, context, color=TRAINED_SHADE, alpha=0.6, linewidth=0, label="trained range")
    ax.axvspan(context, end, color=EXTRAPOLATED_SHADE, alpha=0.5, linewidth=0, label="extrapolated")
    _mark_context(ax, context)


def _heads_legend(ax: Any, n_heads: int) -> None:
    ax.legend(fontsize=7, ncol=2 if n_heads > 6 else 1, loc="best")


def _heatmap_figure(values: np.ndarray, context: int, title: str, *, size: tuple[float, float], marks: str,
                    colour_label: str, xlabel: str, ylabel: str, legend_loc: str, **imshow: Any):
    """A diverging-colour heatmap with the training context marked on ``marks`` ("x" or "xy")."""

    fig = new_figure(*size)
    ax = fig.add_subplot()
    image = ax.imshow(values, cmap="RdBu_r", interpolation="nearest", **imshow)
    _mark_context(ax, context, marks)
    fig.colorbar(image, ax=ax, label=colour_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.suptitle(title, fontsize=10)  # over the figure: a long title must not run into the colour bar
    ax.legend(fontsize=8, loc=legend_loc)
    return fig


def position_table_figure(table: np.ndarray, context: int, title: str):
    """(T, d) input-embedding table as a heatmap: position on x, dimension on y."""
    limit = float(np.abs(table).max()) or 1.0
    return _heatmap_figure(table.T, context, title, size=(9.0, 4.5), marks="x",
                           colour_label="value added to the token embedding", xlabel="position",
                           ylabel="dimension", legend_loc="upper right", aspect="auto", origin="lower",
                           vmin=-limit, vmax=limit, extent=(0, table.shape[0], 0, table.shape[1]))


def position_similarity_figure(similarity: np.ndarray, context: int, title: str):
    """(T, T) cosine similarity of position embeddings; the context marked on both axes."""
    n = similarity.shape[0]
    return _heatmap_figure(similarity, context, title, size=(6.5, 5.5), marks="xy",
                           colour_label="cosine similarity", xlabel="position j", ylabel="position i",
                           legend_loc="lower left", vmin=-1, vmax=1, origin="upper", extent=(0, n, n, 0))


def qk_decay_figure(curves: dict[str, np.ndarray], context: int, title: str):

    fig = new_figure(8.0, 4.5)
    ax = fig.add_subplot()
    end = max(len(c) for c in curves.values())
    _shade_ranges(ax, context, end)
    for label, curve in curves.items():
        ax.plot(np.arange(len(curve)), curve, linewidth=1.2, label=label)
    ax.set_xlim(0, end)
    ax.set_xlabel("distance i - j")
    ax.set_ylabel("E[q.k] / D  (q, k iid, mean 1)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def score_terms_figure(per_layer: list[np.ndarray], context: int, title: str):
    """``per_layer``: (H, T) curves per layer; layers whose curves are all equal share a panel."""

    panels: list[tuple[str, np.ndarray]] = []
    if all(np.allclose(c, per_layer[0], equal_nan=True) for c in per_layer[1:]):
        panels.append(("all layers" if len(per_layer) > 1 else "layer 0", per_layer[0]))
    else:
        panels += [(f"layer {i}", c) for i, c in enumerate(per_layer)]
    cols = min(len(panels), 2)
    rows = math.ceil(len(panels) / cols)
    fig = new_figure(6.0 * cols, 3.8 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (name, curves) in zip(axes, panels):
        end = curves.shape[1]
        _shade_ranges(ax, context, end)
        for head, curve in enumerate(curves):
            ax.plot(np.arange(end), curve, linewidth=1.1, label=f"head {head}")
        ax.set_xlim(0, end)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("distance i - j")
        ax.set_ylabel("score term (added to the logit)")
        ax.grid(alpha=0.3)
        _heads_legend(ax, curves.shape[0])
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    return fig


def attention_maps_figure(maps: np.ndarray, context: int, title: str):
    """(H, T, T) attention of one window, one panel per head, log colour scale."""
    from matplotlib.colors import LogNorm


    H, T, _ = maps.shape
    cols = min(H, 4)
    rows = math.ceil(H / cols)
    fig = new_figure(3.4 * cols, 3.4 * rows + 0.5)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    floor = 1e-4
    future = np.triu(np.ones((T, T), dtype=bool), 1)  # keys after the query: masked, drawn white
    image = None
    for head, ax in enumerate(axes[:H]):
        shown = np.where(future, np.nan, np.clip(maps[head], floor, 1.0))
        image = ax.imshow(shown, cmap="magma", norm=LogNorm(floor, 1.0),
                          interpolation="antialiased", extent=(0, T, T, 0))
        _mark_context(ax, context, "xy", label=False)
        ax.set_title(f"head {head}", fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    for ax in axes[H:]:
        ax.set_visible(False)
    fig.colorbar(image, ax=list(axes[:H]), label="attention weight (log)", shrink=0.8)
    fig.suptitle(f"{title}\ndashed: training context C = {context}", fontsize=10)
    return fig


def _position_axis(ax: Any, context: int, length: int, ylabel: str) -> None:
    _mark_context(ax, context)
    ax.set_xlim(0, length)
    ax.set_xlabel("query position")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def attention_stats_figure(record: AttentionRecord, context: int, title: str):
    """Entropy and mean attended distance against query position, one line per layer."""

    fig = new_figure(12.0, 4.5)
    ax_entropy, ax_distance = fig.subplots(1, 2)
    T = record.layers[0].entropy.shape[1]
    x = np.arange(T)
    window = max(1, T // 64)
    for layer, stats in enumerate(record.layers):
        ax_entropy.plot(x, moving_average(stats.entropy.mean(0), window), label=f"layer {layer}")
        ax_distance.plot(x, moving_average(stats.distance.mean(0), window), label=f"layer {layer}")
    ax_entropy.plot(x, np.log(x + 1), color="grey", linestyle=":", label="uniform over keys: log(i+1)")
    ax_distance.plot(x, x / 2, color="grey", linestyle=":", label="uniform over keys: i/2")
    _position_axis(ax_entropy, context, T, "attention entropy (nats)")
    _position_axis(ax_distance, context, T, "mean attended distance (tokens)")
    ax_entropy.legend(fontsize=8)
    ax_distance.legend(fontsize=8)
    fig.suptitle(f"{title}\nmean over heads and windows, moving average of {window} positions", fontsize=10)
    return fig


def overview_figure(rows: list[tuple[str, str, dict[str, Any], AttentionRecord]], title: str):
    """Per run: loss by position (left) next to mean attended distance (right), same x axis."""

    fig = new_figure(12.0, 2.6 * len(rows) + 0.6)
    axes = fig.subplots(len(rows), 2, squeeze=False)
    for (name, method, results, record), (ax_loss, ax_dist) in zip(rows, axes):
        context = int(results.get("train_context", 0)) or None
        length = record.layers[0].distance.shape[1]
        entries = sorted((e for e in results.get("eval", []) if e.get("split") == "validation"),
                         key=lambda e: (e["length"] != length, -e["length"]))
        colour = colour_of(method)
        if entries:
            loss = np.asarray(entries[0]["loss_by_position"], dtype=np.float64)
            ax_loss.plot(np.arange(loss.size), moving_average(loss, max(1, loss.size // 64)), color=colour)
        else:
            no_data(fig, ax_loss, "no results.json eval")
        for layer, stats in enumerate(record.layers):
            ax_dist.plot(np.arange(length), moving_average(stats.distance.mean(0), max(1, length // 64)),
                         color=colour, alpha=0.35 + 0.65 * (layer + 1) / len(record.layers), linewidth=1.0,
                         label=f"layer {layer}")
        ax_dist.plot(np.arange(length), np.arange(length) / 2, color="grey", linestyle=":", label="uniform: i/2")
        for ax, ylabel in ((ax_loss, "loss (nats)"), (ax_dist, "mean attended distance")):
            if context:
                _position_axis(ax, context, length, ylabel)
            ax.set_title(f"{method}: {name}", fontsize=9)
        ax_dist.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{title}\nleft: validation loss by position; right: mean attended distance per layer "
                 "(darker = deeper); dashed: C", fontsize=10)
    return fig


__all__ = [
    "attention_maps_figure",
    "attention_stats_figure",
    "overview_figure",
    "position_similarity_figure",
    "position_table_figure",
    "qk_decay_figure",
    "score_terms_figure",
]
