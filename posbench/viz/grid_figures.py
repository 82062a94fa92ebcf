"""The figures of ``posbench viz`` for grid runs and grid methods (:mod:`posbench.viz.grid`).

Every figure marks the training square: a dashed square over the cells of ring < s on the maps,
a dashed line at the training side on the distance figure.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from posbench.report.figures import new_figure, palette
from posbench.viz.grid_measures import BEYOND, INSIDE, query_cells


def _training_square(ax: Any, train_side: int, colour: str) -> None:
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((-0.5, -0.5), train_side, train_side, fill=False, edgecolor=colour,
                           linestyle="--", linewidth=1.0))


def grid_maps_figure(maps: dict[int, dict[str, np.ndarray]], train_side: int, title: str, colour_label: str,
                     *, panel: str | None = "head", log_floor: float | None = None):
    """``maps[side][cell]``: (P, side, side) maps for query ``cell`` (see
    :func:`posbench.viz.grid_measures.query_cells`), one panel per (cell, P) row and grid side
    column. Cosine similarities in [-1, 1] draw on a fixed diverging scale, other values on a
    symmetric one, attention weights (``log_floor``) on a log scale from the floor to 1."""
    from matplotlib.colors import LogNorm

    sides = sorted(maps)
    same = all(np.allclose(m, m[:1]) for by_cell in maps.values() for m in by_cell.values())
    if same and panel is not None:  # every head alike (a rotation shared by the heads): one row per cell
        maps = {side: {cell: m[:1] for cell, m in by_cell.items()} for side, by_cell in maps.items()}
    rows = [(cell, p) for cell in maps[sides[0]] for p in range(maps[sides[0]][cell].shape[0])]
    fig = new_figure(max(2.6 * len(sides) + 1.2, 8.0), 2.4 * len(rows) + 0.8)  # wide enough for the title
    axes = fig.subplots(len(rows), len(sides), squeeze=False)
    values = np.concatenate([m.ravel() for by_cell in maps.values() for m in by_cell.values()])
    if log_floor is not None:
        style: dict[str, Any] = dict(cmap="magma", norm=LogNorm(log_floor, 1.0))
    else:
        limit = 1.0 if np.nanmin(values) >= -1 - 1e-6 and np.nanmax(values) <= 1 + 1e-6 else \
            float(np.nanmax(np.abs(values))) or 1.0
        style = dict(cmap="RdBu_r", vmin=-limit, vmax=limit)
    image = None
    for r, (cell, p) in enumerate(rows):
        for c, side in enumerate(sides):
            ax = axes[r, c]
            shown = maps[side][cell][p]
            image = ax.imshow(np.clip(shown, log_floor, 1.0) if log_floor is not None else shown,
                              interpolation="nearest", **style)
            _training_square(ax, train_side, "black" if log_floor is None else "white")  # seen on the dark log map
            row, col = query_cells(side)[cell]
            ax.plot(col, row, marker="x", color="lime", markersize=6, markeredgewidth=1.5)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"{side} x {side}", fontsize=9)
            if c == 0:
                ax.set_ylabel(cell if panel is None else f"{cell}, all {panel}s" if same else f"{cell}, {panel} {p}",
                              fontsize=8)
    fig.colorbar(image, ax=list(axes.ravel()), label=colour_label, shrink=0.6)
    fig.suptitle(f"{title}\nx: the query cell; dashed square: the {train_side} x {train_side} training square",
                 fontsize=10)
    return fig


def grid_distance_figure(summary: dict[int, np.ndarray], uniform: dict[int, np.ndarray], train_side: int,
                         title: str):
    """``summary[side]``: (L, H, 2) mean attended distance in cells of the queries inside and
    beyond the training square; ``uniform[side]``: (2,) the same under uniform attention. One
    panel per layer, one colour per head; solid inside, dashed beyond."""
    sides = sorted(summary)
    n_layers, n_heads, _ = summary[sides[0]].shape
    cols = min(n_layers, 2)
    fig = new_figure(5.5 * cols, 4.0 * math.ceil(n_layers / cols) + 0.5)
    axes = fig.subplots(math.ceil(n_layers / cols), cols, squeeze=False).ravel()
    colours = palette()
    x = np.asarray(sides, dtype=np.float64)
    for layer, ax in enumerate(axes[:n_layers]):
        for head in range(n_heads):
            for ring, style, name in ((INSIDE, "-", "inside"), (BEYOND, "--", "beyond")):
                y = np.asarray([summary[side][layer, head, ring] for side in sides])
                ax.plot(x, y, linestyle=style, marker="o", markersize=3, color=colours[head % len(colours)],
                        label=f"head {head}, {name}")
        for ring, style, name in ((INSIDE, ":", "inside"), (BEYOND, "-.", "beyond")):
            ax.plot(x, [uniform[side][ring] for side in sides], linestyle=style, color="grey",
                    label=f"uniform attention, {name}")
        ax.axvline(train_side, color="black", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(s) for s in sides])
        ax.set_xlabel("grid side (cells)")
        ax.set_ylabel("mean attended distance (cells)")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    for ax in axes[n_layers:]:
        ax.set_visible(False)
    fig.suptitle(f"{title}\nqueries inside the training square (ring < {train_side}, solid) and beyond "
                 f"(dashed); dashed line: training side {train_side}", fontsize=10)
    return fig


__all__ = ["grid_distance_figure", "grid_maps_figure"]
