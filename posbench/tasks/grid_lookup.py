"""Relative lookup on a grid: read the symbol a fixed offset away from a marked cell.

Every cell holds a random symbol; one cell holds instead a query token that names an offset
``(dy, dx)`` from a small fixed set (:data:`OFFSETS`, 1 to 3 cells in each direction); the answer,
scored at the query cell only, is the symbol at ``(row + dy, col + dx)`` (always inside the grid).
The rule is the same at every cell, so a method that encodes offsets can read it on any grid; an
absolute method must have learnt, cell by cell, which cell lies at each offset.
"""

from __future__ import annotations

import numpy as np

from posbench.core.errors import PosbenchError
from posbench.tasks.base import STANDARD, Batch, positive_int, register_task
from posbench.tasks.grid import GridTask, square_side

OFFSETS: tuple[tuple[int, int], ...] = ((0, 1), (1, 0), (0, -2), (-2, 0), (1, 1), (-1, 2), (2, -1), (-3, -3))
"""The query offsets (dy, dx): query token ``q<i>`` asks for the symbol at the i-th one."""


@register_task
class Lookup(GridTask):
    """Relative lookup: the symbol at the query cell's offset (module docstring)."""

    name = "lookup"
    MIN_SIDE = 4  # every offset fits somewhere
    TEST_NOTES = {STANDARD: "one query cell per grid asks for the symbol 1-3 cells away; baselines: `most_frequent` "
                            "(the grid's most frequent symbol) and `one_offset` (the best single offset for every query)"}

    def __init__(self, context: int, *, seed: int = 0, num_symbols: int = 8, tests=None, learnt_at_c=None) -> None:
        super().__init__(context, seed=seed, tests=tests, learnt_at_c=learnt_at_c)
        self.num_symbols = positive_int(self.name, "num_symbols", num_symbols, minimum=2)
        self.vocab = tuple(f"s{i}" for i in range(self.num_symbols)) + tuple(f"q{i}" for i in range(len(OFFSETS)))
        if self.side < self.MIN_SIDE:
            raise PosbenchError(f"task=lookup needs grids of at least {self.MIN_SIDE} x {self.MIN_SIDE}; "
                                f"set trainer.context >= {self.MIN_SIDE ** 2}")

    def chance(self) -> float:
        return 1.0 / self.num_symbols

    @staticmethod
    def valid_queries(side: int) -> np.ndarray:
        """(K, s*s) bool: whether offset k from cell i lands inside the grid."""
        rows, cols = np.divmod(np.arange(side * side), side)
        return np.stack([(rows + dy >= 0) & (rows + dy < side) & (cols + dx >= 0) & (cols + dx < side)
                         for dy, dx in OFFSETS])

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        side = square_side(length, "length")
        symbols = rng.integers(0, self.num_symbols, size=(n, length))  # (N, L)
        offset = rng.integers(0, len(OFFSETS), size=n)  # (N,)
        valid = self.valid_queries(side)[offset]  # (N, L): cells whose offset stays inside
        query = (rng.random((n, length)) * valid).argmax(axis=1)  # (N,) uniform among the valid cells
        dy, dx = np.array(OFFSETS)[offset].T  # (N,) each
        target = query + dy * side + dx  # (N,) the cell read
        rows = np.arange(n)
        labels = symbols.copy()
        labels[rows, query] = symbols[rows, target]
        inputs = symbols.copy()
        inputs[rows, query] = self.num_symbols + offset
        answers = np.zeros((n, length), dtype=bool)
        answers[rows, query] = True
        return self.batch(inputs, labels, answers)

    @staticmethod
    def query_cells(batch: Batch) -> np.ndarray:
        """(N,) each grid's query cell (its one answer)."""
        return batch.answers.argmax(axis=1)

    def baselines(self, batch: Batch) -> dict[str, np.ndarray]:
        """``most_frequent``: the grid's most frequent symbol (the lowest on a tie); ``one_offset``:
        the symbol at the best single offset for every query (a guess where it leaves the grid),
        the best over :data:`OFFSETS` on these sequences: guesses that never read the asked cell."""
        inputs, labels, answers = batch.inputs, batch.labels, batch.answers
        n, length = inputs.shape
        side, rows = square_side(length, "length"), np.arange(n)
        query = self.query_cells(batch)
        answer = labels[rows, query]  # (N,)
        counts = np.stack([(inputs == s).sum(axis=1) for s in range(self.num_symbols)], axis=1)  # (N, S)
        frequent = (counts.argmax(axis=1) == answer).astype(np.float64)
        valid = self.valid_queries(side)
        best = None
        for k, (dy, dx) in enumerate(OFFSETS):
            inside = valid[k, query]
            read = inputs[rows, np.where(inside, query + dy * side + dx, query)]
            hits = np.where(inside, (read == answer).astype(np.float64), self.chance())
            best = hits if best is None or hits.mean() > best.mean() else best
        spread = np.zeros(answers.shape)  # (N, L): each guess at its query cell
        one = spread.copy()
        spread[rows, query], one[rows, query] = frequent, best
        return {**super().baselines(batch), "most_frequent": spread, "one_offset": one}


__all__ = ["Lookup", "OFFSETS"]
