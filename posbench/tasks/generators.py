"""The built-in tasks: flip-flop (Liu et al. 2023), MQAR (Arora et al. 2023) and copy.

Each ``generate`` returns the tokens and the answer mask of :class:`posbench.tasks.Batch`; the
answers are right by construction (tests/test_tasks.py re-derives them with a plain oracle).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from posbench.errors import PosbenchError
from posbench.tasks.base import IGNORE, Batch, Task, positive_int, register_task


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
    """Multi-query associative recall (MQAR) as Zoology's ``multiquery_ar`` (Arora et al. 2023):
    ``N = num_pairs`` key-value pairs ``k v`` (distinct keys, distinct values), then a query
    region of two-token slots holding the filler ``_ _``; each key is queried once, at a slot
    drawn without replacement with probability proportional to ``(gap + 1) ** (power_a - 1)``
    (a power law: near the pairs more often; ``power_a = 1`` is uniform). A query is the key
    followed by the filler: the value is the *label* of the key's position, never an input, so
    earlier answers cannot be read off the sequence. ``N`` is the same at every length; only the
    query region, and so the gaps, grow with ``L``."""

    name = "assoc_recall"

    def __init__(self, context: int, *, seed: int = 0, num_pairs: int = 8, num_keys: int = 64,
                 num_values: int = 64, power_a: float = 0.01) -> None:
        super().__init__(context, seed=seed)
        self.num_pairs = positive_int(self.name, "num_pairs", num_pairs)
        self.num_keys = positive_int(self.name, "num_keys", num_keys)
        self.num_values = positive_int(self.name, "num_values", num_values, minimum=2)
        if isinstance(power_a, bool) or not isinstance(power_a, (int, float)) or not 0.0 < power_a <= 1.0:
            raise PosbenchError(f"task.power_a={power_a!r} must be in (0, 1]: Zoology's 0.01 puts queries near "
                                "the pairs, 1.0 anywhere in the query region")
        self.power_a = float(power_a)
        for key, size in (("num_keys", num_keys), ("num_values", num_values)):
            if size < num_pairs:
                raise PosbenchError(f"task.{key}={size} cannot give task.num_pairs={num_pairs} pairs distinct "
                                    f"{key[4:]}; raise task.{key} to {num_pairs}")
        if 4 * num_pairs > context:
            raise PosbenchError(f"task.num_pairs={num_pairs} needs a training context of at least {4 * num_pairs} "
                                f"(pairs and queries of 2 tokens each); got trainer.context={context}; "
                                f"use task.num_pairs<={context // 4}")
        self.vocab = tuple([f"k{i}" for i in range(num_keys)] + [f"v{i}" for i in range(num_values)] + ["_"])
        self.filler = num_keys + num_values

    def check_length(self, length: int) -> None:
        if length < 4 * self.num_pairs:
            raise PosbenchError(f"task=assoc_recall at length {length} has no room for task.num_pairs="
                                f"{self.num_pairs} pairs and their queries (2 tokens each, {4 * self.num_pairs} in "
                                f"all); drop lengths below {4 * self.num_pairs} from eval.lengths or set "
                                f"task.num_pairs<={length // 4}")

    def check_lengths(self, lengths: Sequence[int]) -> None:
        """``N`` is the same at every length, so the shortest length binds."""
        if len(lengths):
            self.check_length(min(lengths))

    def chance(self) -> float:
        return 1.0 / self.num_values

    def gap_probabilities(self, slots: int) -> np.ndarray:
        """``(slots,)``: Zoology's power law over the query slots, ``p(g) ~ (g + 1) ** (a - 1)``."""
        p = np.arange(1, slots + 1, dtype=np.float64) ** (self.power_a - 1.0)
        return p / p.sum()

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        self.check_length(length)
        pairs, keys_end = self.num_pairs, 2 * self.num_pairs
        slots = (length - keys_end) // 2  # a query key at keys_end + 2 g <= length - 2
        p = self.gap_probabilities(slots)
        tokens = np.full((n, length + 1), self.filler, dtype=np.int64)
        labels = np.full((n, length), IGNORE, dtype=np.int64)
        for row in range(n):
            keys = rng.choice(self.num_keys, pairs, replace=False)
            values = self.num_keys + rng.choice(self.num_values, pairs, replace=False)
            tokens[row, 0:keys_end:2], tokens[row, 1:keys_end:2] = keys, values
            gaps = rng.choice(slots, pairs, replace=False, p=p)  # (pairs,) distinct query slots
            order = rng.permutation(pairs)  # which pair is queried at each slot
            at = keys_end + 2 * gaps  # query key positions; the next input stays the filler
            tokens[row, at], labels[row, at] = keys[order], values[order]
        return Batch(tokens, labels != IGNORE, labels)

    def guesses(self, batch: Batch) -> dict[str, np.ndarray]:
        """``(N, L)`` float arrays: the probability that a guess without the lookup is right at
        each answer (0 off the answers). ``in_context`` guesses among the values in the inputs so
        far (1/N here); ``elimination`` among the values of the pairs that have not yet appeared
        as inputs in the query region: 1/(N - j) at the j-th query where answers are visible
        inputs, 1/N where they are labels only, as here."""
        keys_end, lo, hi = 2 * self.num_pairs, self.num_keys, self.num_keys + self.num_values
        odds = {"in_context": np.zeros(batch.answers.shape), "elimination": np.zeros(batch.answers.shape)}
        for row, (inputs, targets, answers) in enumerate(zip(batch.inputs, batch.targets, batch.answers)):
            seen = [int(v) if lo <= v < hi else None for v in inputs]  # the value shown at each input
            paired = {v for v in seen[:keys_end] if v is not None}
            for at in np.flatnonzero(answers):
                pools = {"in_context": {v for v in seen[: at + 1] if v is not None},
                         "elimination": paired - set(seen[keys_end: at + 1])}
                for name, pool in pools.items():
                    odds[name][row, at] = 1.0 / len(pool) if int(targets[at]) in pool else 0.0
        return odds

    def baselines(self, batch: Batch) -> dict[str, float]:
        """``chance`` (a uniform guess among the values) and the :meth:`guesses`, each a mean over
        sequences of the mean over its answers, as the model's accuracy."""
        counts = batch.answers.sum(axis=1)
        rows = counts > 0
        means = {name: float((odds.sum(axis=1)[rows] / counts[rows]).mean()) if rows.any() else float("nan")
                 for name, odds in self.guesses(batch).items()}
        return {"chance": self.chance(), **means}


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
