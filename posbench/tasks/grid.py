"""Grid tasks: a square grid of cells read by the bidirectional grid encoder (docs/grid.md).

A grid task's sequence is its grid in row-major order (``length`` = side**2 cells) and the model
is the grid encoder (``model.layout=grid``, set by the run spec from :attr:`GridTask.layout`):
every cell sees every cell, and a cell's position is its (row, col). Answers are labels of cells
(``Batch.labels``), never the next input. Trained at one side (``trainer.context`` = side**2,
e.g. 64 for 8 x 8) and tested at 2x and 4x per side (``eval.lengths: [64, 256, 1024]``).

Accuracy is reported by ``ring`` = max(row, col), the square the cell lies in (``by_position``
and ``by_ring``): ring < side is inside the training grid's square (the top-left corner of a
larger grid), ring >= side is a cell at a row or column never seen in training.

This module holds the shared :class:`GridTask` and ``life``; ``lookup`` and ``same_line`` are in
:mod:`posbench.tasks.grid_lookup` and :mod:`posbench.tasks.grid_same_line`.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from posbench.core.errors import PosbenchError
from posbench.tasks.base import STANDARD, Batch, Task, register_task


def square_side(length: int, what: str) -> int:
    """The side of a square grid of ``length`` cells, or one line naming the fix."""
    side = math.isqrt(length)
    if side * side != length:
        near = ", ".join(str(s * s) for s in (side, side + 1) if s > 0)
        raise PosbenchError(f"{what}={length} is not a square grid; grid lengths are side**2 (e.g. {near})")
    return side


class GridTask(Task):
    """A task on a square grid: subclasses implement :meth:`make` (cells -> inputs, labels,
    answers) and :meth:`chance`; the grid layout, lengths and the ``ring`` axis are shared."""

    layout = "grid"
    MIN_SIDE = 2
    AXES = {}  # the ring axis is stored (by_ring), but by_position already holds the rings: not tabled twice

    def __init__(self, context: int, *, seed: int = 0, tests=None, learnt_at_c=None) -> None:
        super().__init__(context, seed=seed, tests=tests, learnt_at_c=learnt_at_c)
        self.side = square_side(context, "trainer.context")

    def check_length(self, length: int) -> None:
        side = square_side(length, "eval.lengths")
        if side < self.MIN_SIDE:
            raise PosbenchError(f"task={self.name} needs grids of at least {self.MIN_SIDE} x {self.MIN_SIDE}, "
                                f"got eval length {length}")

    def check_lengths(self, lengths) -> None:
        """Square grids, at least one of them past the training grid: twice its side or more
        (the sequence runs' C-2C headline, per side)."""
        super().check_lengths(lengths)
        wanted = self.extrapolation_length()
        if max(lengths) < wanted:
            shown = ",".join(map(str, sorted(set(lengths) | {wanted})))
            raise PosbenchError(f"eval.lengths {list(lengths)} has no grid of twice the training side "
                                f"((2 x {self.side})^2 = {wanted} cells), so nothing is measured past the training "
                                f"grid; add it, e.g. eval.lengths=[{shown}]")

    def extrapolation_length(self) -> int:
        """The in-training validation's second grid: twice the side (4x the cells)."""
        return (2 * self.side) ** 2

    def beyond_context(self, length: int) -> np.ndarray:
        """(L,) bool: the cells outside the training grid's square (ring >= side)."""
        return self.rings(length) >= self.side

    @staticmethod
    def rings(length: int) -> np.ndarray:
        """(L,) max(row, col) of every cell of the square grid of ``length`` cells."""
        side = square_side(length, "length")
        rows, cols = np.divmod(np.arange(length), side)
        return np.maximum(rows, cols)

    def answer_axes(self, batch: Batch) -> dict[str, np.ndarray]:
        """``ring``: max(row, col) of the answer's cell."""
        return {"ring": np.broadcast_to(self.rings(batch.answers.shape[1]), batch.answers.shape).astype(np.int64)}

    def axis_bands(self, axis: str, length: int) -> list[tuple[int, int]]:
        """Rings 0-s (the training square), s-2s, 2s-4s, ... up to the grid's side."""
        side, edges = square_side(length, "length"), [0, min(self.side, square_side(length, "length"))]
        while edges[-1] * 2 <= side:
            edges.append(edges[-1] * 2)
        if edges[-1] < side:
            edges.append(side)
        return list(itertools.pairwise(edges))

    def position_bands(self, length: int) -> dict[str, np.ndarray]:
        """``by_position`` by ring, not by the flattened index: ``"a-b"`` = the cells with
        a <= max(row, col) < b, over :meth:`axis_bands` (0-s, s-2s, 2s-4s, ...)."""
        rings = self.rings(length)
        return {f"{a}-{b}": (rings >= a) & (rings < b) for a, b in self.axis_bands("ring", length)}

    @staticmethod
    def batch(inputs: np.ndarray, labels: np.ndarray, answers: np.ndarray) -> Batch:
        """(N, L) cell inputs, labels and answer mask -> a :class:`Batch` (the inputs plus one
        unused token, so ``Batch.inputs`` is the grid)."""
        tokens = np.concatenate([inputs, np.zeros((inputs.shape[0], 1), dtype=np.int64)], axis=1)
        return Batch(tokens.astype(np.int64), answers, labels.astype(np.int64))


@register_task
class Life(GridTask):
    """One step of Conway's Game of Life: every cell's next state from its 3 x 3 neighbourhood
    (born with 3 live neighbours, survives with 2 or 3; cells outside the grid are dead). The
    rule is purely local and the same everywhere, so a method that encodes relative offsets can
    apply it on any grid; an absolute one must have learnt it per cell."""

    name = "life"
    vocab = ("dead", "alive")
    TEST_NOTES = {STANDARD: "one Game of Life step at every cell; baselines: `unchanged` (every cell keeps its state) "
                            "and `all_dead`"}
    DEAD, ALIVE = 0, 1

    def __init__(self, context: int, *, seed: int = 0, density: float = 0.35, tests=None, learnt_at_c=None) -> None:
        super().__init__(context, seed=seed, tests=tests, learnt_at_c=learnt_at_c)
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density < 1:
            raise PosbenchError(f"task.density={density!r} must be a probability in (0, 1) (task=life)")
        self.density = float(density)

    def chance(self) -> float:
        return 0.5

    @staticmethod
    def step(cells: np.ndarray) -> np.ndarray:
        """(N, s, s) 0/1 -> the next generation (dead beyond the edges)."""
        padded = np.pad(cells, ((0, 0), (1, 1), (1, 1)))
        s = cells.shape[1]
        neighbours = sum(padded[:, 1 + dy:1 + dy + s, 1 + dx:1 + dx + s]
                         for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0))
        return ((neighbours == 3) | ((cells == 1) & (neighbours == 2))).astype(np.int64)

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        side = square_side(length, "length")
        cells = (rng.random((n, side, side)) < self.density).astype(np.int64)  # (N, s, s)
        nxt = self.step(cells)
        return self.batch(cells.reshape(n, -1), nxt.reshape(n, -1), np.ones((n, length), dtype=bool))

    def baselines(self, batch: Batch) -> dict[str, np.ndarray]:
        """``unchanged`` (each cell keeps its state) and ``all_dead`` (every cell dies): the
        guesses that read no neighbour."""
        labels, cells = batch.labels, batch.inputs
        return {**super().baselines(batch), "unchanged": (cells == labels).astype(np.float64),
                "all_dead": (labels == self.DEAD).astype(np.float64)}


__all__ = ["GridTask", "Life", "square_side"]
