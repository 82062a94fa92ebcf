"""The copy probe's windows (:mod:`posbench.evaluation.probes.copy`): where a cell puts the two
occurrences of a span, and the fillers, spans and matched spans drawn from held-out text.

Windows depend only on the probe's seed and the data, never on the model: every method of a sweep
is scored on the same windows.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from posbench.core.errors import PosbenchError

REGIONS = ("inside", "past")
KINDS = ("random", "text")  # the span kinds: uniform random ids, a held-out text passage


@dataclass(frozen=True)
class Cell:
    """Where one (distance, region) puts the two occurrences: first at ``p``, repeat at ``t``."""

    distance: int
    region: str
    p: int
    t: int
    span: int

    @property
    def length(self) -> int:
        """Tokens in the window: the repeat's last token is the last target."""
        return self.t + self.span


def cell_for(distance: int, region: str, train_context: int, span: int) -> Cell | None:
    """The cell of ``distance`` in ``region`` (rule in the module docstring), or None when the
    distance does not fit the region (inside C: ``d > C - k``) or the two copies would overlap
    (``d < k``)."""
    if region == "inside":
        t = train_context - span
        p = t - distance
        return Cell(distance, region, p, t, span) if p >= 0 and distance >= span else None
    if region == "past":
        t = max(train_context, distance + span)
        return Cell(distance, region, t - distance, t, span) if distance >= span else None
    raise PosbenchError(f"unknown copy probe region {region!r}; choose from {', '.join(REGIONS)}")


def probe_cells(distances: Sequence[int], train_context: int, span: int) -> list[Cell]:
    """Every (distance, region) cell that fits, inside C first, by distance."""
    cells = [cell_for(d, r, train_context, span) for r in REGIONS for d in sorted(set(distances))]
    return [c for c in cells if c is not None]


@dataclass
class ProbeWindows:
    """The raw material of the probe's windows, shared by every cell: ``filler`` ``(N, Lmax)``
    held-out passages, ``spans[kind]`` ``(N, k)`` (S, repeated) and ``matched[kind]`` ``(N, k)``
    (D, the matched control's span); the offsets record where text came from in the stream."""

    filler: np.ndarray
    spans: dict[str, np.ndarray]
    filler_offsets: np.ndarray
    text_offsets: np.ndarray
    matched: dict[str, np.ndarray]
    matched_offsets: np.ndarray

    def build(self, cell: Cell, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(repeat, control, matched)`` LongTensors ``(N, L)`` of ``cell`` with spans of ``kind``:
        the same filler with S at ``t``, and at ``p`` S, the filler's own text, or D."""
        span = self.spans[kind]
        control = self.filler[:, : cell.length].astype(np.int64)  # (N, L)
        control[:, cell.t : cell.t + cell.span] = span
        repeat, matched = control.copy(), control.copy()
        repeat[:, cell.p : cell.p + cell.span] = span
        matched[:, cell.p : cell.p + cell.span] = self.matched[kind]
        return torch.from_numpy(repeat), torch.from_numpy(control), torch.from_numpy(matched)

    def sha256(self) -> str:
        """Fingerprint of every filler and repeated span: equal = the same repeat and control
        windows (pairable; unchanged since before the matched control existed)."""
        h = hashlib.sha256(np.ascontiguousarray(self.filler, dtype=np.int64).tobytes())
        for kind in sorted(self.spans):
            h.update(kind.encode())
            h.update(np.ascontiguousarray(self.spans[kind], dtype=np.int64).tobytes())
        return h.hexdigest()

    def matched_sha256(self) -> str:
        """Fingerprint of the matched control's spans D (with :meth:`sha256`: every token read)."""
        h = hashlib.sha256(self.sha256().encode())
        for kind in sorted(self.matched):
            h.update(kind.encode())
            h.update(np.ascontiguousarray(self.matched[kind], dtype=np.int64).tobytes())
        return h.hexdigest()


def shares_ngram(context: np.ndarray, span: np.ndarray, n: int) -> bool:
    """Whether ``context`` holds any ``n`` consecutive tokens of ``span`` (a leak of the answer)."""
    if n > len(span) or n > len(context):
        return False
    grams = {tuple(span[i : i + n]) for i in range(len(span) - n + 1)}
    windows = np.lib.stride_tricks.sliding_window_view(np.asarray(context), n)
    return any(tuple(w) in grams for w in windows)


def _text_pieces(tokens: np.ndarray, pieces: Sequence[int], cursor: int, span: int, avoid: Sequence[np.ndarray],
                 what: str) -> tuple[np.ndarray, int, int]:
    """The next piece of ``pieces`` (stream offsets) from ``cursor`` on that shares no ``span // 2``
    consecutive tokens with any of ``avoid``: ``(tokens, offset, next cursor)``."""
    while True:
        if cursor >= len(pieces):
            raise PosbenchError(f"too few held-out text spans that do not repeat {what}; "
                                "lower eval.copy.num_windows")
        offset = pieces[cursor]
        cursor += 1
        candidate = np.asarray(tokens[offset : offset + span], dtype=np.int64)
        if not any(shares_ngram(context, candidate, max(1, span // 2)) for context in avoid):
            return candidate, offset, cursor


def make_windows(tokens: np.ndarray, num_windows: int, max_length: int, span: int, vocab_size: int,
                 special_ids: Sequence[int], seed: int, kinds: Sequence[str] = KINDS) -> ProbeWindows:
    """Draw the probe's fillers, spans and matched spans from the held-out stream ``tokens``
    (deterministic in ``seed`` and ``tokens`` alone).

    The stream is cut into non-overlapping slots of ``max_length`` tokens; ``num_windows`` of
    them (chosen by ``numpy.random.default_rng(seed)``) are the fillers, and the text spans are
    consecutive ``span``-token pieces of further slots, so no filler and no span share a token
    of the stream. A text span that shares ``span // 2`` consecutive tokens with its window's
    filler is replaced by the next unused piece (it would leak the answer to the control).
    Random spans are ``span`` ids uniform over ``0 .. vocab_size - 1`` without ``special_ids``.

    The matched spans D are drawn last, by the same rules, so the fillers and spans S are those
    of the same seed before D existed: text D are the next unused pieces (then pieces of further
    slots) sharing ``span // 2`` consecutive tokens neither with the filler nor with S; random D
    are ``span`` more ids of the same generator, redrawn while they share as many with S.
    """
    if num_windows < 2:
        raise PosbenchError(f"eval.copy.num_windows must be at least 2 (for an interval), got {num_windows}")
    tokens = np.asarray(tokens)
    slots = len(tokens) // max_length
    per_slot = max_length // span
    room = math.ceil(2 * num_windows / per_slot)  # slots of text pieces: room for replaced (leaking) spans
    needed = num_windows + room
    if slots < needed:
        raise PosbenchError(
            f"the copy probe needs {needed} held-out passages of {max_length} tokens but the split holds "
            f"{len(tokens)} tokens ({slots}); lower eval.copy.num_windows or the largest of eval.copy.distances"
        )
    rng = np.random.default_rng(seed)
    order = rng.permutation(slots)
    filler_slots, text_slots = np.sort(order[:num_windows]), np.sort(order[num_windows:needed])
    filler_offsets = filler_slots * max_length
    filler = np.stack([tokens[o : o + max_length] for o in filler_offsets]).astype(np.int64)  # (N, Lmax)
    pieces = [int(s) * max_length + j * span for s in text_slots for j in range(per_slot)]
    spans: dict[str, np.ndarray] = {}
    matched: dict[str, np.ndarray] = {}
    text_offsets = np.full(num_windows, -1, dtype=np.int64)
    matched_offsets = np.full(num_windows, -1, dtype=np.int64)
    if "text" in kinds:
        text = np.empty((num_windows, span), dtype=np.int64)
        cursor = 0
        for i in range(num_windows):
            text[i], text_offsets[i], cursor = _text_pieces(tokens, pieces, cursor, span, [filler[i]], "their filler")
        spans["text"] = text
    if "random" in kinds:
        allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(special_ids), dtype=np.int64))
        spans["random"] = allowed[rng.integers(0, allowed.size, size=(num_windows, span))]
    # The matched spans, after everything above (which is therefore unchanged by them).
    if "text" in kinds:
        spare = np.sort(order[needed : needed + room])  # further slots, when the unused pieces run out
        pieces += [int(s) * max_length + j * span for s in spare for j in range(per_slot)]
        matched["text"] = np.empty((num_windows, span), dtype=np.int64)
        for i in range(num_windows):
            matched["text"][i], matched_offsets[i], cursor = _text_pieces(
                tokens, pieces, cursor, span, [filler[i], spans["text"][i]], "their filler or repeated span")
    if "random" in kinds:
        decoys = allowed[rng.integers(0, allowed.size, size=(num_windows, span))]
        for i in range(num_windows):
            while shares_ngram(spans["random"][i], decoys[i], max(1, span // 2)):
                decoys[i] = allowed[rng.integers(0, allowed.size, size=span)]
        matched["random"] = decoys
    return ProbeWindows(filler, spans, filler_offsets, text_offsets, matched, matched_offsets)


__all__ = ["Cell", "KINDS", "ProbeWindows", "REGIONS", "cell_for", "make_windows", "probe_cells", "shares_ngram"]
