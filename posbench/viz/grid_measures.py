"""What ``posbench viz`` measures on the grid layout: pure tensor functions, each tested against a
direct computation (tests/unit/viz/test_grid.py).

Cells are (row, col) in row-major order, as the grid encoder's default positions
(:func:`posbench.methods.grid_positions`); ``ring`` = max(row, col), so ring < s is inside the
s x s training square (the top-left corner of a larger grid).

Position maps: for a query cell c and every cell c' of a side x side grid, what the method's
position signal alone says about the pair, read through the method interface only:

- :func:`embedding_similarity`: methods with an input embedding: the cosine similarity of the
  position vectors ``input_embedding(c)`` and ``input_embedding(c')``;
- :func:`rotation_similarity`: methods with a q-k transform: the cosine similarity of the query's
  and the key's rotated fixed vector, ``rotate_qk(1, 1)`` at c and c' (RoFormer's convention for
  the long-term decay: q, k with iid entries of mean 1; the mean over zero-mean random q, k is 0
  for any rotation, so it shows nothing). For a norm-preserving rotation it equals
  ``E[q.k] / D``; per head;
- :func:`score_map`: methods with a score term: the term with no content (q = k = 0 and a zero
  layer input), added to the logit of query c for key c'; per head.

Attention distance: :func:`grid_attended_distance` (Euclidean distance in cells, expected under
each query's attention) and :func:`ring_means` (its mean over queries inside / beyond the
training square).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posbench.methods import ModelDims, PositionMethod, grid_positions, grid_side

INSIDE, BEYOND = 0, 1
"""The two ring classes of :func:`ring_means`: ring < training side, ring >= training side."""


def query_cells(side: int) -> dict[str, tuple[int, int]]:
    """The query cells the maps are drawn for: the grid's centre and its far corner (which lies
    beyond the training square once the grid is larger than it)."""
    return {"centre": (side // 2, side // 2), "corner": (side - 1, side - 1)}


def cell_index(side: int, cell: tuple[int, int]) -> int:
    """Row-major index of ``cell`` (row, col) in a side x side grid."""
    row, col = cell
    return row * side + col


def grid_sides(train_side: int, span: int) -> list[int]:
    """The training side, then doubled while it stays within span x the training side."""
    sides = [train_side]
    while sides[-1] * 2 <= span * train_side:
        sides.append(sides[-1] * 2)
    return sides


def embedding_similarity(method: PositionMethod, side: int, cell: tuple[int, int]) -> Tensor | None:
    """(1, side, side) cosine similarity of the input embedding of ``cell`` with that of every
    cell, or None for a method without an input embedding."""
    table = method.input_embedding(grid_positions(side, side))  # (T, d_model)
    if table is None:
        return None
    unit = torch.nn.functional.normalize(table.float(), dim=-1)  # (T, d)
    return (unit @ unit[cell_index(side, cell)]).view(1, side, side)


def rotation_similarity(method: PositionMethod, dims: ModelDims, side: int, cell: tuple[int, int],
                        layer: int = 0) -> Tensor:
    """(H, side, side) cosine similarity of the rotated query of ``cell`` with the rotated key of
    every cell, for q = k = all-ones through ``rotate_qk`` of ``layer``."""
    T = side * side
    ones = torch.ones(1, dims.n_heads, T, dims.head_dim)
    q, k = method.rotate_qk(ones, ones, grid_positions(side, side), layer)  # (1, H, T, D')
    query = torch.nn.functional.normalize(q[0, :, cell_index(side, cell)].float(), dim=-1)  # (H, D')
    keys = torch.nn.functional.normalize(k[0].float(), dim=-1)  # (H, T, D')
    return torch.einsum("hd,htd->ht", query, keys).view(-1, side, side)


def score_map(method: PositionMethod, dims: ModelDims, side: int, cell: tuple[int, int],
              layer: int = 0) -> Tensor | None:
    """(H, side, side) the score term of ``layer`` with no content (q = k = 0, zero layer input)
    for query ``cell`` against every key cell, or None where the layer has no score term."""
    T = side * side
    zeros = torch.zeros(1, dims.n_heads, T, dims.head_dim)
    fn = method.score_term(zeros, grid_positions(side, side), layer, k=zeros, x=torch.zeros(1, T, dims.d_model))
    if fn is None:
        return None
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(dims.n_heads).view(1, -1, 1, 1)
    q_idx = torch.full((1, 1, 1, 1), cell_index(side, cell))
    kv_idx = torch.arange(T).view(1, 1, 1, -1)
    term = fn(b, h, q_idx, kv_idx).float()  # broadcasts to (1, H, 1, T)
    return term.expand(1, dims.n_heads, 1, T)[0, :, 0].reshape(dims.n_heads, side, side)


def cell_distances(side: int, device: torch.device | str = "cpu") -> Tensor:
    """(T, T) Euclidean distance in cells between every pair of cells of a side x side grid."""
    cells = grid_positions(side, side, device).double()  # (T, 2)
    return torch.cdist(cells, cells)


def grid_attended_distance(weights: Tensor) -> Tensor:
    """(..., T, T) attention rows of a square grid in row-major order -> (..., T): the expected
    Euclidean distance in cells, sum_j p_ij |cell_i - cell_j|."""
    distance = cell_distances(grid_side(weights.shape[-1]), weights.device).to(weights.dtype)
    return (weights * distance).sum(-1)


def rings(side: int) -> Tensor:
    """(T,) max(row, col) of every cell of a side x side grid, row-major."""
    cells = grid_positions(side, side)
    return cells.max(-1).values


def ring_means(per_query: Tensor, train_side: int) -> Tensor:
    """(..., T) a value per query cell of a square grid -> (..., 2): its mean over the queries
    inside the training square (ring < train_side) and beyond it (NaN when the grid has none)."""
    inside = rings(grid_side(per_query.shape[-1])).to(per_query.device) < train_side  # (T,)
    means = [per_query[..., mask].double().mean(-1) if bool(mask.any()) else
             torch.full(per_query.shape[:-1], float("nan"), dtype=torch.float64, device=per_query.device)
             for mask in (inside, ~inside)]
    return torch.stack(means, dim=-1)


__all__ = [
    "BEYOND",
    "INSIDE",
    "cell_distances",
    "cell_index",
    "embedding_similarity",
    "grid_attended_distance",
    "grid_sides",
    "query_cells",
    "ring_means",
    "rings",
    "rotation_similarity",
    "score_map",
]
