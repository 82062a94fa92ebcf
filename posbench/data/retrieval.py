"""Retrievable content in training windows: text where reading far back pays.

TinyStories stories are about 200 tokens long, so nothing in plain training text rewards
attending further back than the current story. With ``data.retrieval.rate > 0`` that fraction
of training windows gets one insertion, written over the window's own tokens (the window keeps
its ``C + 1`` tokens):

    repeat_text:    ... S (at p) ... S (at p + d) ...   S = the window's own k tokens at p
    repeat_random:  ... S (at p) ... S (at p + d) ...   S = k ids uniform over the vocabulary
    passkey:        ... The pass key is 58213. Remember it. ... What is the pass key? The pass key is 58213. ...

``d`` is the distance between the first tokens of the two copies of the retrievable content
(the span, or the key's digits), drawn uniformly from ``min_distance .. max_distance`` and
capped at what fits in the window. The passkey sentences are tokenized with the run's tokenizer
(:data:`NEEDLE` and :data:`QUESTION`, each piece encoded on its own; a byte-level BPE splits
words, digits and punctuation into separate pre-tokens, so the pieces concatenate to the
encoding of the whole sentence). The key is :data:`KEY_DIGITS` digits, each uniform over 0-9.

What is inserted is a pure function of ``(run seed, global sample index)``: a resumed run and
N processes see the same insertions as one process, and ``rate=0`` leaves every batch untouched.
Only training windows are touched; evaluation text stays plain. ``posbench/evaluation/probes/passkey.py`` scores
a trained model on the same passkey sentences placed in held-out text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from posbench.core.errors import PosbenchError

KINDS = ("passkey", "repeat_random", "repeat_text")
KEY_DIGITS = 5
# (before the key, after the key): " The pass key is" + " 58213" + ". Remember it."
NEEDLE = (" The pass key is", ". Remember it.")
QUESTION = (" What is the pass key? The pass key is", ".")
STREAM = 0x52455452  # tags this module's random stream apart from the window order's


@dataclass
class RetrievalConfig:
    """Retrievable content inserted into training windows (``data.retrieval.*``; docs/retrieval.md)."""

    rate: float = 0.0
    """Fraction of training windows that get one insertion (0 = off: batches are untouched)."""
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    """What is inserted, one kind drawn uniformly per chosen window: passkey (a 5-digit key
    stated, then asked for and answered), repeat_random (k random ids, repeated) and/or
    repeat_text (k tokens of the window's own text, repeated)."""
    min_distance: int = 1
    """Smallest distance d between the two copies (raised to the smallest that fits: the
    second copy starts after the first ends)."""
    max_distance: int = 256
    """Largest distance d (capped at what fits in the training window)."""
    span: int = 16
    """k: tokens of a repeated span (repeat kinds)."""

    def validate(self) -> RetrievalConfig:
        """Raise :class:`PosbenchError` naming the fix for any bad value; return self."""
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not 0 <= self.rate <= 1:
            raise PosbenchError(f"data.retrieval.rate must be in [0, 1] (0 = off), got {self.rate!r}")
        kinds = [self.kinds] if isinstance(self.kinds, str) else list(self.kinds or [])
        if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds):
            raise PosbenchError(f"data.retrieval.kinds must be a non-empty list of distinct {', '.join(KINDS)}, "
                                f"got {self.kinds}")
        self.kinds = kinds
        for name in ("min_distance", "max_distance", "span"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PosbenchError(f"data.retrieval.{name} must be a positive integer, got {value!r}")
        if self.min_distance > self.max_distance:
            raise PosbenchError(f"data.retrieval.min_distance={self.min_distance} is above "
                                f"max_distance={self.max_distance}; lower it")
        return self

    @property
    def active(self) -> bool:
        return self.rate > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def retrieval_config(values: Any) -> RetrievalConfig:
    """``data.retrieval`` (a mapping or a :class:`RetrievalConfig`) -> a validated one."""
    if isinstance(values, RetrievalConfig):
        return values.validate()
    if not isinstance(values, dict):
        raise PosbenchError(f"data.retrieval must be a mapping of settings (rate, kinds, ...), got {values!r}")
    known = set(RetrievalConfig.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise PosbenchError(f"unknown option(s) {', '.join(f'data.retrieval.{k}' for k in unknown)}; "
                            f"known: {', '.join(sorted(known))}")
    return RetrievalConfig(**values).validate()


class PasskeyText:
    """The passkey sentences as token ids of one tokenizer (``encode``: texts -> id lists)."""

    def __init__(self, encode: Callable[[list[str]], list[list[int]]]):
        self.encode = encode
        pieces = [np.asarray(ids, dtype=np.int64) for ids in encode([*NEEDLE, *QUESTION])]
        self.needle_prefix, self.needle_suffix, self.question_prefix, self.question_suffix = pieces
        self.digit_ids = sorted({int(i) for ids in encode([f" {d}" for d in range(10)] + [str(d) for d in range(10)])
                                 for i in ids})

    @staticmethod
    def draw_key(rng: np.random.Generator) -> str:
        """A key of :data:`KEY_DIGITS` digits, each uniform over 0-9 (chance of guessing: 1e-5)."""
        return "".join(str(d) for d in rng.integers(0, 10, size=KEY_DIGITS))

    def key_ids(self, key: str) -> np.ndarray:
        """Token ids of the key as it follows "... key is" (``" 58213"``)."""
        return np.asarray(self.encode([f" {key}"])[0], dtype=np.int64)

    def needle(self, key_ids: np.ndarray) -> tuple[np.ndarray, int]:
        """(tokens of "The pass key is <key>. Remember it.", offset of the key in them)."""
        return np.concatenate([self.needle_prefix, key_ids, self.needle_suffix]), len(self.needle_prefix)

    def question(self, key_ids: np.ndarray, answered: bool = True) -> tuple[np.ndarray, int]:
        """(tokens of "What is the pass key? The pass key is <key>." — without the key and the
        full stop when not ``answered`` — and the offset where the key starts)."""
        parts = [self.question_prefix, key_ids, self.question_suffix] if answered else [self.question_prefix]
        return np.concatenate(parts), len(self.question_prefix)


@dataclass(frozen=True)
class Insertion:
    """One insertion into a window: ``first`` tokens written at ``p``, ``second`` at ``q``; the
    retrievable content starts at ``p + first_offset`` and at ``q + second_offset``, ``distance``
    apart."""

    kind: str
    p: int
    q: int
    first: np.ndarray
    second: np.ndarray
    first_offset: int
    second_offset: int

    @property
    def distance(self) -> int:
        return (self.q + self.second_offset) - (self.p + self.first_offset)


def placement(n: int, first: int, first_offset: int, second: int, second_offset: int, min_distance: int,
              max_distance: int, rng: np.random.Generator) -> tuple[int, int] | None:
    """``(p, q)`` of two pieces of ``first`` and ``second`` tokens in a window of ``n``: the
    distance ``d = (q + second_offset) - (p + first_offset)`` uniform over the range that fits
    (the second starts after the first ends, both inside the window), then ``p`` uniform over
    the starts that fit; None when no distance fits."""
    low = max(min_distance, first - first_offset + second_offset)  # q >= p + first
    high = min(max_distance, n - second - first_offset + second_offset)  # p = 0, q + second <= n
    if low > high:
        return None
    d = int(rng.integers(low, high + 1))
    p = int(rng.integers(0, n - second - first_offset + second_offset - d + 1))
    return p, p + first_offset + d - second_offset


class Inserter:
    """Writes :class:`RetrievalConfig`'s insertions into training rows; the ``insert`` hook of
    :class:`posbench.data.loader.TrainBatches`."""

    def __init__(self, cfg: RetrievalConfig, context: int, vocab_size: int, special_ids: Sequence[int],
                 encode: Callable[[list[str]], list[list[int]]], seed: int):
        self.cfg, self.n, self.seed = cfg.validate(), context + 1, seed
        self.passkey = PasskeyText(encode) if "passkey" in cfg.kinds else None
        self.allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(special_ids), dtype=np.int64))
        for kind in cfg.kinds:  # refuse a window too short for a kind before any training
            first, first_offset, second, second_offset = self.lengths(kind, np.zeros(KEY_DIGITS, dtype=np.int64))
            if placement(self.n, first, first_offset, second, second_offset, cfg.min_distance, cfg.max_distance,
                         np.random.default_rng(0)) is None:
                raise PosbenchError(
                    f"data.retrieval kind {kind} does not fit a training window of {self.n} tokens at distances "
                    f"{cfg.min_distance}..{cfg.max_distance}; "
                    + self.fit_hint(kind, first, first_offset, second, second_offset))

    def fit_hint(self, kind: str, first: int, first_offset: int, second: int, second_offset: int) -> str:
        """The fix that makes ``kind`` fit (see :func:`placement`: the distance must lie in
        ``shortest .. longest``, which the window allows, and in min_distance .. max_distance)."""
        cfg, n = self.cfg, self.n
        shortest = first - first_offset + second_offset  # the second piece starts after the first ends
        longest = n - second - first_offset + second_offset  # both pieces inside the window
        if shortest > longest:  # the two pieces alone overflow the window
            context = first + second - 1  # a window of context + 1 tokens holds both
            if kind == "passkey":
                return (f"its needle and question take {first + second} tokens with this tokenizer; "
                        f"raise trainer.context to at least {context}")
            return (f"two spans of {cfg.span} tokens need a window of {2 * cfg.span}; lower data.retrieval.span "
                    f"to at most {n // 2}, or raise trainer.context to at least {context}")
        if cfg.min_distance > longest:
            return (f"the longest distance that fits is {longest}; lower data.retrieval.min_distance to at most "
                    f"{longest}, or raise trainer.context to at least {self.n - 1 + cfg.min_distance - longest}")
        return f"the shortest distance that fits is {shortest}; raise data.retrieval.max_distance to at least {shortest}"

    def lengths(self, kind: str, key_ids: np.ndarray) -> tuple[int, int, int, int]:
        """(first length, its content offset, second length, its content offset) of ``kind``."""
        if kind == "passkey":
            needle, offset = self.passkey.needle(key_ids)
            question, q_offset = self.passkey.question(key_ids)
            return len(needle), offset, len(question), q_offset
        return self.cfg.span, 0, self.cfg.span, 0

    def plan(self, sample: int) -> Insertion | None:
        """The insertion of global sample ``sample`` (None: this window stays plain). Repeated
        text spans carry no tokens yet (they are the window's own, read by :meth:`insert`)."""
        rng = np.random.default_rng([STREAM, self.seed, sample])
        if not rng.random() < self.cfg.rate:
            return None
        kind = self.cfg.kinds[int(rng.integers(len(self.cfg.kinds)))]
        if kind == "passkey":
            key_ids = self.passkey.key_ids(self.passkey.draw_key(rng))
            first, first_offset = self.passkey.needle(key_ids)
            second, second_offset = self.passkey.question(key_ids)
        else:  # repeat_text's span is the window's own text: known once the row is read
            first = second = (self.allowed[rng.integers(0, self.allowed.size, size=self.cfg.span)]
                              if kind == "repeat_random" else np.empty(0, dtype=np.int64))
            first_offset = second_offset = 0
        sizes = (len(first), len(second)) if kind == "passkey" else (self.cfg.span, self.cfg.span)
        where = placement(self.n, sizes[0], first_offset, sizes[1], second_offset, self.cfg.min_distance,
                          self.cfg.max_distance, rng)
        if where is None:  # a key that tokenizes unusually long; never with a byte-level BPE
            return None
        return Insertion(kind, where[0], where[1], first, second, first_offset, second_offset)

    def insert(self, row: np.ndarray, sample: int) -> Insertion | None:
        """Write the insertion of ``sample`` into ``row`` ``(C + 1,)`` in place; return it."""
        plan = self.plan(sample)
        if plan is None:
            return None
        if plan.kind == "repeat_text":
            span = row[plan.p : plan.p + self.cfg.span].copy()
            plan = Insertion(plan.kind, plan.p, plan.q, span, span, 0, 0)
        row[plan.p : plan.p + len(plan.first)] = plan.first
        row[plan.q : plan.q + len(plan.second)] = plan.second
        return plan

    def __call__(self, rows: np.ndarray, samples: np.ndarray) -> None:
        """Insert into every row of ``rows`` ``(B, C + 1)`` (global sample indices ``samples``)."""
        for row, sample in zip(rows, samples):
            self.insert(row, int(sample))


def make_inserter(cfg: RetrievalConfig, context: int, prepared: Any, seed: int) -> Inserter | None:
    """The training-window hook for ``cfg`` on ``prepared`` (a :class:`posbench.data.PreparedData`:
    its tokenizer and vocabulary), or None when ``cfg.rate`` is 0."""
    if not cfg.active:
        return None
    return Inserter(cfg, context, prepared.vocab_size, [prepared.eot_id], prepared.encode, seed)


__all__ = ["KEY_DIGITS", "KINDS", "NEEDLE", "QUESTION", "Inserter", "Insertion", "PasskeyText", "RetrievalConfig",
           "make_inserter", "placement", "retrieval_config"]
