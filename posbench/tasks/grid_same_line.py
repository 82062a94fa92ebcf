"""Same row or same column on a grid: where does marker B lie relative to marker A?

Two marker cells, ``A`` and ``B``, among empty cells; the answer, scored at B only, is ``row``
(A and B share a row), ``col`` (they share a column) or ``neither``; the three classes are
balanced in every generated set. Whether two cells share a row or a column is a property of
their offset (dy = 0 or dx = 0) at every distance, so a method that encodes offsets can answer
on any grid; an absolute method must have learnt which cells share a line, cell by cell.
"""

from __future__ import annotations

import numpy as np

from posbench.tasks.base import STANDARD, Batch, register_task
from posbench.tasks.grid import GridTask, square_side


@register_task
class SameLine(GridTask):
    """Same row / same column / neither, answered at marker B (module docstring)."""

    name = "same_line"
    vocab = ("empty", "A", "B", "row", "col", "neither")
    TEST_NOTES = {STANDARD: "markers A and B: row, col or neither at B, balanced; baseline: `majority` (the most common "
                            "answer)"}
    EMPTY, A, B, ROW, COL, NEITHER = range(6)

    def chance(self) -> float:
        return 1.0 / 3.0

    @staticmethod
    def distinct(rng: np.random.Generator, n: int, side: int) -> tuple[np.ndarray, np.ndarray]:
        """(N,) pairs of different indices in ``0 .. side - 1``, uniform."""
        first = rng.integers(0, side, size=n)
        return first, (first + rng.integers(1, side, size=n)) % side

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        side = square_side(length, "length")
        kind = rng.permutation(np.arange(n) % 3)  # (N,) 0 row, 1 col, 2 neither: balanced
        r1, r2 = self.distinct(rng, n, side)
        c1, c2 = self.distinct(rng, n, side)
        r2 = np.where(kind == 0, r1, r2)  # same row
        c2 = np.where(kind == 1, c1, c2)  # same column
        a, b, rows = r1 * side + c1, r2 * side + c2, np.arange(n)
        inputs = np.full((n, length), self.EMPTY, dtype=np.int64)
        inputs[rows, a], inputs[rows, b] = self.A, self.B
        labels = inputs.copy()
        labels[rows, b] = self.ROW + kind
        answers = np.zeros((n, length), dtype=bool)
        answers[rows, b] = True
        return self.batch(inputs, labels, answers)

    def baselines(self, batch: Batch) -> dict[str, np.ndarray]:
        """``majority``: the most common answer of these sequences (the lowest on a tie) everywhere."""
        labels, answers = batch.labels, batch.answers
        classes = (self.ROW, self.COL, self.NEITHER)
        majority = classes[int(np.argmax([(labels[answers] == c).sum() for c in classes]))]
        return {**super().baselines(batch), "majority": ((labels == majority) & answers).astype(np.float64)}


__all__ = ["SameLine"]
