"""What ``posbench viz`` shows of a grid method (``method=<a grid method>``) or a grid run
(``run=<a run of a grid task>``): the grid encoder of docs/grid.md.

Grids of side s, 2s, ... up to span x s (s: the training side, sqrt of the training context;
:func:`posbench.viz.grid_measures.grid_sides`), and on each the query cells of
:func:`posbench.viz.grid_measures.query_cells` (centre and far corner):

- ``grid_position_similarity``: cosine similarity of the input embeddings (methods with one);
- ``grid_qk_similarity[_layer<l>]``: cosine similarity of the rotated all-ones query and key
  (methods with a q-k transform), per head;
- ``grid_score_term[_layer<l>]``: the score term with no content (methods with one), per head;
- runs: ``grid_attention_distance`` (mean attended Euclidean distance in cells, inside vs beyond
  the training square, against the grid side; its numbers in ``grid_attention_distance.json``)
  and ``grid_attention_layer<l>`` (the attention of the query cells on every side).

A map whose layers all agree is drawn once (``all layers``), otherwise one figure per layer of
``attention.layers``. The 1D figures (q.k decay and score term against i - j, the T x T maps, the
curves against query position) assume a causal sequence and are not drawn (one log line says so).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from posbench.core.errors import PosbenchError
from posbench.core.io import write_json_atomic
from posbench.methods import ModelDims, PositionMethod, grid_side
from posbench.report.figures import save
from posbench.viz.attention import held_out_windows, record_attention
from posbench.viz.grid_figures import grid_distance_figure, grid_maps_figure
from posbench.viz.grid_measures import (
    cell_distances,
    cell_index,
    embedding_similarity,
    grid_sides,
    query_cells,
    ring_means,
    rotation_similarity,
    score_map,
)
from posbench.viz.measures import has_qk_transform
from posbench.viz.settings import VizSettings

Log = Callable[[str], None]
Maps = dict[int, dict[str, np.ndarray]]  # side -> query cell name -> (P, side, side)

SKIPPED = ("not drawn on the grid (they assume a causal 1D sequence): qk_decay and score_terms (against i - j; "
           "see grid_qk_similarity, grid_score_term), position_table and position_similarity (see "
           "grid_position_similarity), attention_maps (see grid_attention_layer<l>), attention_entropy_distance "
           "(see grid_attention_distance)")


def _maps(fn: Callable[[int, tuple[int, int]], Tensor | None], sides: list[int], label: str, log: Log) -> Maps | None:
    """``fn(side, cell)`` on every side and query cell; None when the method has no such signal.
    A side the method cannot reach (a table of fixed size) is left out with one log line."""
    maps: Maps = {}
    for side in sides:
        try:
            by_cell = {name: fn(side, cell) for name, cell in query_cells(side).items()}
        except PosbenchError as err:
            log(f"{label}: {side} x {side} not drawn: {err}")
            continue
        if any(v is None for v in by_cell.values()):
            return None
        maps[side] = {name: v.float().cpu().numpy() for name, v in by_cell.items()}
    return maps or None


def _layered(fn: Callable[[int, tuple[int, int], int], Tensor | None], dims: ModelDims, sides: list[int],
             layers: list[int], label: str, log: Log) -> list[tuple[str, Maps]]:
    """Per-layer maps of ``fn(side, cell, layer)`` (a layer without the signal: zeros) -> one
    ``("all layers", maps)`` when every layer agrees, else ``("layer <l>", maps)`` per ``layers``."""
    per_layer = []
    for layer in range(dims.n_layers):
        def at(side: int, cell: tuple[int, int], layer: int = layer) -> Tensor:
            value = fn(side, cell, layer)
            return torch.zeros(dims.n_heads, side, side) if value is None else value
        maps = _maps(at, sides, label, log)
        if maps is None:
            return []
        per_layer.append(maps)
    first = per_layer[0]
    if all(np.allclose(m[side][c], first[side][c]) for m in per_layer[1:] for side in first for c in first[side]):
        return [("all layers", first)]
    return [(f"layer {layer}", per_layer[layer]) for layer in sorted({l % dims.n_layers for l in layers})]


def _stem(stem: str, which: str) -> str:
    """``grid_qk_similarity`` for maps every layer shares, ``grid_qk_similarity_layer1`` for one layer's."""
    return stem if which == "all layers" else f"{stem}_{which.replace(' ', '')}"


def grid_signal_figures(method: PositionMethod, dims: ModelDims, train_side: int, s: VizSettings, out: Path,
                        label: str, log: Log) -> list[Path]:
    """The method's own position maps on grids of side s .. span x s (see the module's docstring)."""
    sides = grid_sides(train_side, s.span)
    written: list[Path] = []
    with torch.no_grad():
        embedding = _maps(lambda side, cell: embedding_similarity(method, side, cell), sides, label, log)
        if embedding is not None:
            title = f"{label}: cosine similarity of the position embeddings"
            written += save(grid_maps_figure(embedding, train_side, title, "cosine similarity", panel=None),
                            out, "grid_position_similarity", s.formats)
        if has_qk_transform(method):
            for which, maps in _layered(lambda side, cell, layer: rotation_similarity(method, dims, side, cell, layer),
                                        dims, sides, s.attention.layers, label, log):
                title = (f"{label}: cosine similarity of the rotated all-ones query at x and key at each cell, "
                         f"{which}")
                written += save(grid_maps_figure(maps, train_side, title, "cosine similarity"), out,
                                _stem("grid_qk_similarity", which), s.formats)
        if method.has_score_term:
            for which, maps in _layered(lambda side, cell, layer: score_map(method, dims, side, cell, layer),
                                        dims, sides, s.attention.layers, label, log):
                title = f"{label}: score term with no content (q = k = 0), query at x, {which}"
                written += save(grid_maps_figure(maps, train_side, title, "score term (added to the logit)"), out,
                                _stem("grid_score_term", which), s.formats)
    return written


def grid_attention(run: Any, s: VizSettings, train_side: int, log: Log,
                   ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray], dict[int, Maps], str]:
    """The run's attention on held-out grids of every side: per side the (L, H, 2) mean attended
    distance inside / beyond the training square, the (2,) uniform-attention reference, the
    attention of the query cells per layer of ``attention.layers``, and what the inputs were."""
    model = run.model
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    map_layers = sorted({layer % n_layers for layer in s.attention.layers})
    summary, uniform, attention = {}, {}, {layer: {} for layer in map_layers}
    where = ""
    for side in grid_sides(train_side, s.span):
        inputs, where = held_out_windows(run, side * side, s.attention, log)
        record = record_attention(model, inputs, map_layers)
        summary[side] = np.stack([ring_means(torch.from_numpy(stats.distance), train_side).numpy()
                                  for stats in record.layers])  # (L, H, 2)
        uniform[side] = ring_means(cell_distances(side).mean(-1), train_side).numpy()  # (2,)
        for layer in map_layers:
            maps = record.layers[layer].maps  # (H, T, T) of the first grid
            attention[layer][side] = {name: maps[:, cell_index(side, cell)].reshape(n_heads, side, side)
                                      for name, cell in query_cells(side).items()}
    return summary, uniform, attention, where


def _finite(values: np.ndarray) -> Any:
    """An array as nested lists for JSON, NaN (no query in that ring) as null."""
    return [None if isinstance(v, float) and math.isnan(v) else v for v in values.tolist()] if values.ndim == 1 \
        else [_finite(row) for row in values]


def viz_grid_run(run: Any, s: VizSettings, out: Path, device: str, log: Log, label: str,
                 signal_label: str) -> list[Path]:
    """A trained grid run: its method's position maps and its attention on held-out grids."""
    model, method = run.model, run.model.position
    train_side = grid_side(int(run.config.trainer.context))
    log(f"{label}: {SKIPPED}")
    written = grid_signal_figures(method.cpu(), model.cfg.dims, train_side, s, out, signal_label, log)
    model.to(device)
    summary, uniform, attention, where = grid_attention(run, s, train_side, log)
    written += save(grid_distance_figure(summary, uniform, train_side, f"{label}: mean attended distance on the grid, per head, "
                                         f"{where.split(' of ')[0]} per side"),
                    out, "grid_attention_distance", s.formats)
    for layer, maps in attention.items():
        title = f"{label}: attention of the query cell, layer {layer}, first held-out grid of each side"
        written += save(grid_maps_figure(maps, train_side, title, "attention weight (log)", log_floor=1e-4),
                        out, f"grid_attention_layer{layer}", s.formats)
    numbers = {
        "train_side": train_side,
        "sides": sorted(summary),
        "rings": ["inside", "beyond"],
        "what": "mean attended Euclidean distance in cells, mean over the queries of each ring "
                "(inside: ring = max(row, col) < train_side), by side, layer, head, ring",
        "distance": {str(side): _finite(values) for side, values in sorted(summary.items())},
        "uniform": {str(side): _finite(values) for side, values in sorted(uniform.items())},
    }
    path = Path(out) / "grid_attention_distance.json"
    write_json_atomic(path, numbers)
    return [*written, path]


__all__ = ["SKIPPED", "grid_attention", "grid_signal_figures", "viz_grid_run"]
