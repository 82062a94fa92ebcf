"""The built-in tasks: flip-flop (Liu et al. 2023), MQAR (Arora et al. 2023) and copy.

Each ``generate`` returns the tokens and the answer mask of :class:`posbench.tasks.Batch`; the
answers are right by construction (tests/test_tasks.py re-derives them with a plain oracle).
"""

from __future__ import annotations

import numpy as np

from posbench.errors import PosbenchError
from posbench.tasks.base import Batch, Task, positive_int, register_task


@register_task
class FlipFlop(Task):
    """Flip-flop language modelling (Liu et al. 2023, "Exposing Attention Glitches with Flip-Flop
    Language Modeling"): instruction/bit pairs ``w b`` (write), ``i b`` (ignore), ``r b`` (read),
    starting with a write; the bit after every ``r`` must be the last *written* bit. Instructions
    are ignore with probability ``p_ignore``, write or read with (1 - p_ignore) / 2 each: the
    paper's FFL(0.8) trains at 0.8, its sparse test is 0.98 and its dense test 0.1
    (``eval_p_ignore``: the test sequences' probability, null = ``p_ignore``)."""

    name = "flipflop"
    vocab = ("w", "i", "r", "0", "1")
    WRITE, IGNORE_OP, READ, ZERO = 0, 1, 2, 3

    def __init__(self, context: int, *, seed: int = 0, p_ignore: float = 0.8,
                 eval_p_ignore: float | None = None) -> None:
        super().__init__(context, seed=seed)
        for key, value in (("p_ignore", p_ignore), ("eval_p_ignore", eval_p_ignore)):
            if value is None and key == "eval_p_ignore":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise PosbenchError(f"task.{key}={value!r} must be a probability in [0, 1), e.g. 0.8 "
                                    "(dense: 0.1, sparse: 0.98)")
        self.p_ignore = float(p_ignore)
        self.eval_p_ignore = self.p_ignore if eval_p_ignore is None else float(eval_p_ignore)

    def chance(self) -> float:
        return 0.5

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        p = self.p_ignore if split == "train" else self.eval_p_ignore
        k = (length + 2) // 2  # instructions: 2k >= length + 1 tokens
        ops = rng.choice(3, size=(n, k), p=[(1 - p) / 2, p, (1 - p) / 2])  # (N, k)
        ops[:, 0] = self.WRITE
        bits = rng.integers(0, 2, size=(n, k))  # (N, k)
        last_write = np.maximum.accumulate(np.where(ops == self.WRITE, np.arange(k), 0), axis=1)  # (N, k)
        bits = np.where(ops == self.READ, np.take_along_axis(bits, last_write, axis=1), bits)
        tokens = np.empty((n, 2 * k), dtype=np.int64)
        tokens[:, 0::2], tokens[:, 1::2] = ops, self.ZERO + bits
        answers = np.zeros((n, length), dtype=bool)
        answers[:, 0::2] = ops[:, : (length + 1) // 2] == self.READ  # target 2j is the bit after op j
        return Batch(tokens[:, : length + 1], answers)


@register_task
class AssocRecall(Task):
    """Multi-query associative recall (MQAR; Arora et al. 2023, Zoology): ``N`` key-value pairs
    ``k v`` (distinct keys), then a query region of two-token slots; ``N`` of them, at uniformly
    drawn slots in random key order, are queries ``k v`` whose value is the answer, the others
    hold the filler ``_ _``. ``N = num_pairs * L / C`` grows with the length ``L``, and so does the
    query distance (the query region is ``L - 2N`` tokens)."""

    name = "assoc_recall"

    def __init__(self, context: int, *, seed: int = 0, num_pairs: int = 8, num_keys: int = 128,
                 num_values: int = 128) -> None:
        super().__init__(context, seed=seed)
        self.num_pairs = positive_int(self.name, "num_pairs", num_pairs)
        self.num_keys = positive_int(self.name, "num_keys", num_keys)
        self.num_values = positive_int(self.name, "num_values", num_values, minimum=2)
        if 4 * num_pairs > context:
            raise PosbenchError(f"task.num_pairs={num_pairs} needs a training context of at least {4 * num_pairs} "
                                f"(pairs and queries of 2 tokens each); got trainer.context={context}; "
                                f"use task.num_pairs<={context // 4}")
        self.check_length(context)
        self.vocab = tuple([f"k{i}" for i in range(num_keys)] + [f"v{i}" for i in range(num_values)] + ["_"])
        self.filler = num_keys + num_values

    def pairs(self, length: int) -> int:
        return max(1, self.num_pairs * length // self.context)

    def check_length(self, length: int) -> None:
        if self.pairs(length) > self.num_keys:
            raise PosbenchError(f"task=assoc_recall at length {length} needs {self.pairs(length)} distinct keys but "
                                f"task.num_keys={self.num_keys}; raise task.num_keys to {self.pairs(length)}")

    def chance(self) -> float:
        return 1.0 / self.num_values

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        self.check_length(length)
        pairs, keys_end = self.pairs(length), 2 * self.pairs(length)
        slots = (length + 1 - keys_end) // 2
        tokens = np.full((n, length + 1), self.filler, dtype=np.int64)
        answers = np.zeros((n, length), dtype=bool)
        for row in range(n):
            keys = rng.choice(self.num_keys, pairs, replace=False)
            values = self.num_keys + rng.integers(0, self.num_values, pairs)
            tokens[row, 0:keys_end:2], tokens[row, 1:keys_end:2] = keys, values
            order = rng.permutation(pairs)
            at = keys_end + 2 * np.sort(rng.choice(slots, pairs, replace=False))  # query key positions
            tokens[row, at], tokens[row, at + 1] = keys[order], values[order]
            answers[row, at] = True  # the input at the query key predicts its value
        return Batch(tokens, answers)


@register_task
class Copy(Task):
    """Copy: a random string ``s`` of ``n`` symbols, the separator ``|``, then ``s`` again (the
    answers), padded with ``.`` to the sequence length. Training draws ``n`` uniformly from
    ``min_length .. C/2`` (strings up to the training length); a test sequence of length ``L``
    holds the longest string that fits, ``n = L/2``. Metrics: accuracy on the copied symbols and
    exact match (every symbol of the copy right)."""

    name = "copy"
    metrics = ("accuracy", "exact_match")

    def __init__(self, context: int, *, seed: int = 0, num_symbols: int = 16, min_length: int = 1) -> None:
        super().__init__(context, seed=seed)
        self.num_symbols = positive_int(self.name, "num_symbols", num_symbols, minimum=2)
        self.min_length = positive_int(self.name, "min_length", min_length)
        if min_length > context // 2:
            raise PosbenchError(f"task.min_length={min_length} exceeds the longest training string, "
                                f"trainer.context / 2 = {context // 2}; lower it")
        self.vocab = tuple(f"s{i}" for i in range(num_symbols)) + ("|", ".")
        self.sep, self.pad = num_symbols, num_symbols + 1

    def chance(self) -> float:
        return 1.0 / self.num_symbols

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        longest = length // 2  # 2n + 1 <= length + 1 tokens
        sizes = (rng.integers(self.min_length, longest + 1, n) if split == "train"
                 else np.full(n, longest))
        tokens = np.full((n, length + 1), self.pad, dtype=np.int64)
        answers = np.zeros((n, length), dtype=bool)
        for row, size in enumerate(sizes):
            string = rng.integers(0, self.num_symbols, size)
            tokens[row, :size], tokens[row, size] = string, self.sep
            tokens[row, size + 1 : 2 * size + 1] = string
            answers[row, size : 2 * size] = True  # targets size .. 2 size - 1 are the copy
        return Batch(tokens, answers)
