"""The built-in tasks: flip-flop (Liu et al. 2023), MQAR (Arora et al. 2023) and copy.

Each ``generate`` returns the tokens and the answer mask of :class:`posbench.tasks.Batch`; the
answers are right by construction (tests/unit/tasks/test_generators.py re-derives them with a plain oracle).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from posbench.core.errors import PosbenchError
from posbench.tasks.base import IGNORE, STANDARD, Batch, Task, lookback_bands, positive_int, register_task


@register_task
class FlipFlop(Task):
    """Flip-flop language modelling (Liu et al. 2023, "Exposing Attention Glitches with Flip-Flop
    Language Modeling"): instruction/bit pairs ``w b`` (write), ``i b`` (ignore), ``r b`` (read),
    starting with a write; the bit after every ``r`` must be the last *written* bit. Instructions
    are ignore with probability ``p_ignore``, write or read with (1 - p_ignore) / 2 each: the
    paper's FFL(0.8) trains at 0.8, its sparse test is 0.98 and its dense test 0.1.

    Test sets (``tests``): ``standard`` draws at ``eval_p_ignore`` (null = ``p_ignore``; its
    reads look back about as far at 8C as at C), ``sparse`` at 0.98 (Liu et al.'s sparse test:
    long runs of ignores between writes and reads), and ``far`` scores one read per sequence,
    the last instruction, whose last write lies a drawn distance back (stratified over the bands
    0-C, C-2C, 2C-4C, ... of the test length; only ignores in between, training-distribution
    instructions before), so that at 8C a quarter of the reads look back more than 4C."""

    name = "flipflop"
    vocab = ("w", "i", "r", "0", "1")
    WRITE, IGNORE_OP, READ, ZERO = 0, 1, 2, 3
    TESTS = (STANDARD, "sparse", "far")
    PAIRED_TESTS = TESTS  # the sparse and far tests are the ones whose lookback grows with length
    TEST_NOTES = {
        STANDARD: "instructions drawn as in training (task.eval_p_ignore): the reads look back about as far at 8C as "
                  "at C (see the lookback row)",
        "sparse": "p_ignore 0.98 (Liu et al.'s sparse test): long runs of ignores before a read",
        "far": "one scored read per sequence whose last write lies a drawn lookback back, stratified over the bands "
               "0-C, C-2C, ... of the length: at 8C a quarter of the reads look back > 4C",
    }
    AXES = {"lookback": "lookback"}
    LEARNT_AT_C = 0.95
    SPARSE_P_IGNORE = 0.98

    def __init__(self, context: int, *, seed: int = 0, p_ignore: float = 0.8,
                 eval_p_ignore: float | None = None, tests: list[str] | None = None,
                 learnt_at_c: float | None = None) -> None:
        super().__init__(context, seed=seed, tests=tests, learnt_at_c=learnt_at_c)
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

    def instructions(self, rng: np.random.Generator, n: int, length: int, p: float) -> tuple[np.ndarray, np.ndarray]:
        """``(ops, bits)``, each ``(N, k)`` with ``2k >= length + 1`` tokens, ignore probability ``p``."""
        k = (length + 2) // 2
        ops = rng.choice(3, size=(n, k), p=[(1 - p) / 2, p, (1 - p) / 2])  # (N, k)
        ops[:, 0] = self.WRITE
        return ops, rng.integers(0, 2, size=(n, k))

    def assemble(self, ops: np.ndarray, bits: np.ndarray, length: int) -> Batch:
        """The sequences of ``ops``: every read's bit set to the last written bit, every read an answer."""
        k = ops.shape[1]
        last_write = np.maximum.accumulate(np.where(ops == self.WRITE, np.arange(k), 0), axis=1)  # (N, k)
        bits = np.where(ops == self.READ, np.take_along_axis(bits, last_write, axis=1), bits)
        tokens = np.empty((ops.shape[0], 2 * k), dtype=np.int64)
        tokens[:, 0::2], tokens[:, 1::2] = ops, self.ZERO + bits
        answers = np.zeros((ops.shape[0], length), dtype=bool)
        answers[:, 0::2] = ops[:, : (length + 1) // 2] == self.READ  # target 2j is the bit after op j
        return Batch(tokens[:, : length + 1], answers)

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        p = self.p_ignore if split == "train" else self.eval_p_ignore
        return self.assemble(*self.instructions(rng, n, length, p), length)

    def test_batch(self, rng: np.random.Generator, n: int, length: int, test: str) -> Batch:
        if test == "sparse":
            return self.assemble(*self.instructions(rng, n, length, self.SPARSE_P_IGNORE), length)
        ops, bits = self.instructions(rng, n, length, self.p_ignore)  # the training distribution
        read = (length + 1) // 2 - 1  # the last instruction whose bit is a target
        bands = [(a, b) for a, b in lookback_bands(length, self.context) if (a + 2) // 2 <= min(read, b // 2)]
        low, high = np.array(bands).T[:, np.arange(n) % len(bands)]  # (N,) each: row r gets band r mod bands
        # lookback 2d - 1 (query: the read at token 2 read; source: the written bit at 2 (read - d) + 1) in [low, high)
        d = rng.integers(np.maximum(1, (low + 2) // 2), np.minimum(read, high // 2) + 1)  # (N,)
        write, columns = read - d, np.arange(ops.shape[1])
        ops[columns >= write[:, None]] = self.IGNORE_OP
        ops[np.arange(n), write], ops[:, read] = self.WRITE, self.READ
        batch = self.assemble(ops, bits, length)
        batch.answers[:] = False
        batch.answers[:, 2 * read] = True  # only the read whose lookback was drawn
        return batch

    def check_length(self, length: int) -> None:
        if length < 4:
            raise PosbenchError(f"task=flipflop needs test lengths of at least 4 tokens, got {length}")

    def lookback(self, batch: Batch, ops_counted: tuple[int, ...]) -> np.ndarray:
        """``(N, L)``: at each read's target, the distance from the read (the query) back to the
        bit of the last instruction among ``ops_counted`` before it (-1 elsewhere)."""
        ops = batch.tokens[:, 0::2]  # (N, k)
        k = ops.shape[1]
        index = np.where(np.isin(ops, ops_counted), np.arange(k), -1)  # (N, k)
        before = np.maximum.accumulate(np.concatenate([np.full((ops.shape[0], 1), -1), index[:, :-1]], axis=1), axis=1)
        distance = np.where(before >= 0, 2 * (np.arange(k) - before) - 1, -1)  # query 2i, source bit 2j + 1
        out = np.full(batch.answers.shape, -1, dtype=np.int64)
        out[:, 0::2] = distance[:, : (batch.answers.shape[1] + 1) // 2]
        return out

    def answer_axes(self, batch: Batch) -> dict[str, np.ndarray]:
        """``lookback``: the distance from the read back to the bit of its last write."""
        return {"lookback": self.lookback(batch, (self.WRITE,))}

    def baselines(self, batch: Batch) -> dict[str, np.ndarray]:
        """``previous_bit``: repeat the bit of the instruction before the read (0.6 at
        p_ignore 0.8, 0.5 when sparse); ``window_C``: a perfect reader of the last C tokens
        (the nearest write or read within them holds the answer, else a guess)."""
        tokens, shape = batch.tokens, batch.answers.shape
        previous = np.zeros(shape)
        previous[:, 2::2] = tokens[:, 1:shape[1] - 1:2] == tokens[:, 3:shape[1] + 1:2]  # bit of op j - 1 == answer
        nearest = self.lookback(batch, (self.WRITE, self.READ))
        window = np.where((nearest >= 0) & (nearest < self.context), 1.0, 0.5)
        return {**super().baselines(batch), "previous_bit": previous, "window_C": window}


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
    TEST_NOTES = {
        STANDARD: "N pairs at every length, queries at power-law gaps, values as labels only; baselines: `chance` "
                  "guesses among all values, `in_context` among the values in the sequence (1/N), `elimination` "
                  "among the values whose pairs have not been queried yet (1/N when answers are labels only): a "
                  "model above them reads the query key",
    }

    def __init__(self, context: int, *, seed: int = 0, num_pairs: int = 8, num_keys: int = 64,
                 num_values: int = 64, power_a: float = 0.01, tests: list[str] | None = None,
                 learnt_at_c: float | None = None) -> None:
        super().__init__(context, seed=seed, tests=tests, learnt_at_c=learnt_at_c)
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

    def baselines(self, batch: Batch) -> dict[str, np.ndarray]:
        """``chance`` (a uniform guess among the values) and the :meth:`guesses` (``in_context``,
        ``elimination``), per answer."""
        return {**super().baselines(batch), **self.guesses(batch)}


@register_task
class Copy(Task):
    """Copy: a random string ``s`` of ``n`` symbols, the separator ``|``, then ``s`` again (the
    answers), padded with ``.`` to the sequence length. Training draws ``n`` uniformly from
    ``min_length .. C/2`` (strings up to the training length) at the start of the sequence.
    Metrics: accuracy on the copied symbols and exact match (every symbol of the copy right).

    Test sets (``tests``): ``standard`` holds the longest string that fits at ``start`` 0,
    ``n = L/2``, so past C it mixes a longer string (and a longer copy distance: the lookback is
    ``n``) with new positions; ``shifted`` draws ``n`` as in training and places string and copy
    at a uniform start within the last C tokens (``.`` before it), so past C only the positions
    are new (at L = C it differs from training by the leading padding alone, and not at all with
    ``shifted_training``: training strings at a uniform start too, ``.`` before them)."""

    name = "copy"
    metrics = ("accuracy", "exact_match")
    TESTS = (STANDARD, "shifted")
    PAIRED_TESTS = TESTS  # shifted: only the positions are new past C
    TEST_NOTES = {
        STANDARD: "the longest string that fits, n = L/2: past C the string is longer than any in training and "
                  "copied from further back, at new positions",
        "shifted": "a training-length string placed within the last C tokens: past C only the positions are new",
    }
    AXES = {"string_length": "string length"}

    def __init__(self, context: int, *, seed: int = 0, num_symbols: int = 16, min_length: int = 1,
                 shifted_training: bool = False, tests: list[str] | None = None,
                 learnt_at_c: float | None = None) -> None:
        super().__init__(context, seed=seed, tests=tests, learnt_at_c=learnt_at_c)
        if not isinstance(shifted_training, bool):
            raise PosbenchError(f"task.shifted_training={shifted_training!r} must be true or false")
        self.shifted_training = shifted_training
        self.num_symbols = positive_int(self.name, "num_symbols", num_symbols, minimum=2)
        self.min_length = positive_int(self.name, "min_length", min_length)
        if min_length > context // 2:
            raise PosbenchError(f"task.min_length={min_length} exceeds the longest training string, "
                                f"trainer.context / 2 = {context // 2}; lower it")
        self.vocab = tuple(f"s{i}" for i in range(num_symbols)) + ("|", ".")
        self.sep, self.pad = num_symbols, num_symbols + 1

    def chance(self) -> float:
        return 1.0 / self.num_symbols

    def place(self, rng: np.random.Generator, sizes: np.ndarray, starts: np.ndarray, length: int) -> Batch:
        """Row ``r``: a string of ``sizes[r]`` symbols at ``starts[r]``, ``|`` and its copy (the answers)."""
        tokens = np.full((len(sizes), length + 1), self.pad, dtype=np.int64)
        answers = np.zeros((len(sizes), length), dtype=bool)
        for row, (size, start) in enumerate(zip(sizes, starts, strict=True)):
            string = rng.integers(0, self.num_symbols, size)
            tokens[row, start:start + size], tokens[row, start + size] = string, self.sep
            tokens[row, start + size + 1 : start + 2 * size + 1] = string
            answers[row, start + size : start + 2 * size] = True  # targets of the copy
        return Batch(tokens, answers)

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        longest = length // 2  # 2n + 1 <= length + 1 tokens
        sizes = (rng.integers(self.min_length, longest + 1, n) if split == "train"
                 else np.full(n, longest))
        starts = np.zeros(n, dtype=np.int64)
        if split == "train" and self.shifted_training:  # a uniform start, "." before: as the shifted test
            starts = rng.integers(0, length - 2 * sizes + 1)
        return self.place(rng, sizes, starts, length)

    def test_batch(self, rng: np.random.Generator, n: int, length: int, test: str) -> Batch:
        sizes = rng.integers(self.min_length, min(self.context, length) // 2 + 1, n)  # the training strings
        starts = rng.integers(max(0, length - self.context), length - 2 * sizes + 1)  # within the last C tokens
        return self.place(rng, sizes, starts, length)

    def check_length(self, length: int) -> None:
        if "shifted" in self.tests and length < 2 * self.min_length:
            raise PosbenchError(f"task=copy's shifted test at length {length} cannot hold a string of "
                                f"task.min_length={self.min_length}; test at lengths >= {2 * self.min_length}")

    def axis_bands(self, axis: str, length: int) -> list[tuple[int, int]]:
        """String lengths: quarters of the training range 1..C/2, then C/2+1..C, C..2C, ..."""
        q = max(1, self.context // 8)
        edges = [1, q + 1, 2 * q + 1, 3 * q + 1, self.context // 2 + 1]
        edges += [b for _, b in lookback_bands(length // 2 + 1, self.context) if b > edges[-1]]
        return [(a, b) for a, b in itertools.pairwise(edges) if a < b]

    def answer_axes(self, batch: Batch) -> dict[str, np.ndarray]:
        """``string_length``: n, which is also each answer's lookback (the copy of symbol j is
        predicted n tokens after the symbol)."""
        sizes = batch.answers.sum(axis=1, keepdims=True)  # (N, 1)
        return {"string_length": np.where(batch.answers, sizes, -1)}

    def baselines(self, batch: Batch) -> dict[str, np.ndarray]:
        """``previous_symbol``: repeat the input; ``most_frequent``: the string's most frequent
        symbol (the lowest on a tie) at every answer; ``window_C``: a perfect reader of the last
        C tokens (right while n < C, else a guess)."""
        tokens, answers = batch.tokens, batch.answers
        previous = (tokens[:, :-1] == tokens[:, 1:]).astype(np.float64)  # (N, L)
        counts = np.stack([((tokens[:, 1:] == s) & answers).sum(axis=1) for s in range(self.num_symbols)], axis=1)
        frequent = (tokens[:, 1:] == counts.argmax(axis=1)[:, None]).astype(np.float64)  # (N, L)
        n = answers.sum(axis=1, keepdims=True)
        window = np.broadcast_to(np.where(n < self.context, 1.0, self.chance()), answers.shape)
        return {**super().baselines(batch), "previous_symbol": previous, "most_frequent": frequent,
                "window_C": window}
