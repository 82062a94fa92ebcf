"""The copy probe: can the model still retrieve a span it saw ``d`` tokens earlier?

Zero-shot, on any trained run (docs/probes.md). Every probe window is built from held-out text
(the validation or test split, never training text):

    repeat:   filler ... S (at p) ... filler ... S (at t = p + d)
    matched:  filler ... D (at p) ... filler ... S (at t)          (D: another span, drawn like S)
    control:  filler ... filler     ... filler ... S (at t)          (S appears once)

The three windows differ only in positions ``p .. p + k - 1``. The scored targets are the tokens
of the second occurrence after its first one (positions ``t + 1 .. t + k - 1``, predicted from
inputs ``t .. t + k - 2``): nothing in the window predicts the first token of the repeat, the rest
can be copied. Per window, on those ``k - 1`` targets:

    retrieval gain = loss(matched) - loss(repeat)   the headline: the two differ only in whether
                                                    the span at p is an exact earlier copy of S
    sensitivity    = loss(control) - loss(repeat)   how much putting S at p (instead of the
                                                    filler's text) moves the loss: copying plus the
                                                    disturbance of an out-of-place span (results.json
                                                    key ``gain``, the probe's number before the
                                                    matched control existed)

A cell ``(kind, d, region)`` reports each one's mean over windows with a 95 % bootstrap interval
and its standard error. ``sensitivity - retrieval gain = loss(control) - loss(matched)`` is the
disturbance alone.

Where the repeat sits (``C`` = training context, ``k`` = span):

    region "inside": t = C - k          (the repeat ends at the last position of the context; d <= C - k)
    region "past":   t = max(C, d + k)  (the repeat starts at or after C; at least k filler tokens before p)

and the window has ``L = t + k`` tokens (the model reads ``L - 1``). Span kinds: ``text`` (a
held-out passage from elsewhere in the split) and ``random`` (``k`` ids uniform over the
vocabulary, end-of-text excluded: the model's prior cannot predict them). The matched control's
span D is drawn by the same rule as S (the next unused held-out piece, or ``k`` more uniform ids)
and shares no ``k // 2`` consecutive tokens with S (text spans: nor with the window's filler).

Windows depend only on the probe's seed and the data, never on the model: every method of a
sweep is scored on the same windows (``windows_sha256`` in results.json says so; the matched
spans are drawn after everything else, so ``windows_sha256`` of the repeat and control windows is
that of entries written before the matched control existed, and ``matched_sha256`` fingerprints D).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from posbench.core.errors import PosbenchError
from posbench.evaluation.loss import score_rows
from posbench.evaluation.settings import KINDS, PROBES  # noqa: F401  (names owned by the settings)
from posbench.evaluation.stats import bootstrap_interval
from posbench.model.extension import NONE, evaluation_order, extended, extension_options
from posbench.runs.results import shown_setting

REGIONS = ("inside", "past")
DEFAULT_DISTANCES = (32, 64, 128, 192, 256, 320, 384, 512, 768)
# Below this retrieval gain (nats) at the reference cell the model barely copies even inside C: reach 0. A
# model that copies random spans gains nats (their matched control's loss is ln V or more).
REACH_MIN_GAIN = 0.5
REACH_DEFINITION = ("reach: the largest distance d such that the retrieval gain of a repeat placed past the "
                    "training context stays at least half of the retrieval gain at the smallest distance inside "
                    "the context, at d and at every smaller distance of the grid (0 when it never does, or when "
                    f"that in-context gain is below {REACH_MIN_GAIN} nats; none for an entry without the "
                    "matched control)")
NO_MATCHED = "no matched control (an entry written before it existed: sensitivity only)"


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


def cell_losses(model: nn.Module, windows: torch.Tensor, cell: Cell, batch_size: int, device: torch.device,
                autocast_dtype: torch.dtype | None) -> np.ndarray:
    """Per-window mean loss ``(N,)`` of targets ``t + 1 .. t + k - 1`` of ``windows`` ``(N, L)``."""
    inputs = windows[:, : cell.length - 1]  # (N, t + k - 1): the last k - 1 inputs are t .. t + k - 2
    targets = windows[:, cell.t + 1 : cell.length]  # (N, k - 1)
    return score_rows(model, inputs, targets, batch_size, device, autocast_dtype, None).mean(dim=1).numpy()


def reach(gains: dict[tuple[int, str], float], distances: Sequence[int]) -> int:
    """:data:`REACH_DEFINITION` of one kind's mean retrieval gains ``{(distance, region): gain}``."""
    inside = sorted(d for d, r in gains if r == "inside")
    if not inside or not gains[(inside[0], "inside")] >= REACH_MIN_GAIN:
        return 0
    half = gains[(inside[0], "inside")] / 2
    best = 0
    for d in sorted(set(distances)):
        if (d, "past") not in gains:
            continue
        if not gains[(d, "past")] >= half:
            break
        best = d
    return best


def has_matched(entry: dict[str, Any]) -> bool:
    """Whether a results.json probe entry measured the matched control (and so the retrieval gain);
    entries written before it existed hold the sensitivity only."""
    return bool(entry.get("cells")) and all("retrieval_gain" in c for c in entry["cells"])


def entry_reach(entry: dict[str, Any], kind: str) -> int | None:
    """The reach of ``kind`` recomputed from a results.json entry's retrieval gains with today's
    :data:`REACH_DEFINITION` (an older entry's stored ``reach`` may follow an older one); None
    when the entry has no cell of that kind or no matched control (no retrieval gain)."""
    if not has_matched(entry):
        return None
    gains = {(int(c["distance"]), c["region"]): float(c["retrieval_gain"]) for c in entry["cells"]
             if c["kind"] == kind}
    return reach(gains, entry.get("distances") or sorted({d for d, _ in gains})) if gains else None


def standard_error(values: np.ndarray) -> float:
    """Standard error of the mean of ``values`` over windows (sample standard deviation / sqrt(n))."""
    return float(np.std(values, ddof=1) / math.sqrt(len(values)))


def paired_cell(kind: str, cell: Cell, repeat: np.ndarray, control: np.ndarray, matched: np.ndarray) -> dict[str, Any]:
    """A results.json cell from the per-window losses ``(N,)`` of the three windows of ``cell``:
    the retrieval gain and the sensitivity (key ``gain``), each paired per window."""
    sensitivity = control - repeat  # (N,)
    retrieval = matched - repeat  # (N,)
    s, r = bootstrap_interval(sensitivity), bootstrap_interval(retrieval)
    return {
        "kind": kind, "distance": cell.distance, "region": cell.region, "p": cell.p, "t": cell.t,
        "length": cell.length, "loss_repeat": float(repeat.mean()), "loss_control": float(control.mean()),
        "loss_matched": float(matched.mean()),
        "retrieval_gain": r.mean, "retrieval_interval": [r.low, r.high], "retrieval_se": standard_error(retrieval),
        "gain": s.mean, "interval": [s.low, s.high], "gain_se": standard_error(sensitivity), "count": s.n,
        "window_retrieval_gains": retrieval.tolist(), "window_gains": sensitivity.tolist(),
    }


def copy_probe(
    model: nn.Module,
    tokens: np.ndarray,
    train_context: int,
    *,
    vocab_size: int,
    special_ids: Sequence[int],
    distances: Sequence[int] = DEFAULT_DISTANCES,
    span: int = 32,
    num_windows: int = 64,
    kinds: Sequence[str] = KINDS,
    seed: int = 0,
    split: str = "validation",
    batch_size: int = 16,
    device: str | torch.device = "cpu",
    autocast_dtype: torch.dtype | None = None,
    extensions: Sequence[str] = ("none",),
    extension_factor: float | None = None,
    log: Callable[[str], Any] = print,
    extension_settings: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run the copy probe on ``model``; one results.json ``probes`` entry per extension.

    ``tokens`` is the held-out stream of ``split`` (validation or test: the probe refuses
    training text). Each entry holds the settings, ``windows_sha256``, ``matched_sha256``,
    ``seconds``, ``reach`` (per kind, :data:`REACH_DEFINITION`) and ``cells`` (:func:`paired_cell`):
    per (kind, distance, region) the positions ``p, t, length``, the three mean losses, the
    ``retrieval_gain`` and the sensitivity ``gain``, each with its bootstrap interval over windows,
    its standard error and its per-window values (for pairing), and ``count``.
    Cells longer than the model's learned positions are left out (logged).
    """
    if split == "train":
        raise PosbenchError("the copy probe reads held-out text only; use eval.copy.split=validation or test")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise PosbenchError(f"unknown eval.copy.kinds {unknown or list(kinds)}; choose from {', '.join(KINDS)}")
    if not 2 <= span < train_context:
        raise PosbenchError(f"eval.copy.span must be in 2 .. {train_context - 1}, got {span}")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < span for d in distances) or not distances:
        raise PosbenchError(f"eval.copy.distances must be integers >= eval.copy.span={span}, got {list(distances)}")
    device = torch.device(device)
    cells = probe_cells(distances, train_context, span)
    # Sized by the whole grid before any cell is left out, so every model gets the same windows.
    longest = max(c.length for c in cells)
    limit = getattr(getattr(model, "position", None), "max_positions", None)
    if limit is not None:
        dropped = [c for c in cells if c.length - 1 > limit]
        if dropped:
            log(f"copy probe: leaving out {len(dropped)} cells longer than the model's {limit} learned positions "
                f"({', '.join(f'd={c.distance} {c.region}' for c in dropped)})")
        cells = [c for c in cells if c.length - 1 <= limit]
    if not cells:
        raise PosbenchError("no copy probe cell fits; check eval.copy.distances and eval.copy.span")
    windows = make_windows(tokens, num_windows, longest, span, vocab_size, special_ids, seed, kinds)
    entries = []
    for extension in evaluation_order(extensions):
        started = time.perf_counter()
        out_cells, factors = [], {}
        # The control does not depend on p: cells with the same repeat position t share it.
        controls: dict[tuple[str, int], np.ndarray] = {}
        for kind in kinds:
            for cell in cells:
                repeat, control, matched = windows.build(cell, kind)
                with extended(model, extension, train_context, cell.length - 1, extension_factor,
                              extension_settings) as factor:
                    with_copy = cell_losses(model, repeat, cell, batch_size, device, autocast_dtype)
                    without_copy = cell_losses(model, matched, cell, batch_size, device, autocast_dtype)
                    if (kind, cell.t) not in controls:
                        controls[(kind, cell.t)] = cell_losses(model, control, cell, batch_size, device, autocast_dtype)
                factors[cell.length - 1] = factor
                out_cells.append(paired_cell(kind, cell, with_copy, controls[(kind, cell.t)], without_copy))
        seconds = time.perf_counter() - started
        entry = {
            "probe": "copy", "split": split, "extension": extension,
            "extension_factor": {str(k): v for k, v in factors.items()} if extension != NONE else None,
            "seed": seed, "span": span, "num_windows": num_windows, "distances": sorted(set(distances)),
            "kinds": list(kinds), "train_context": train_context, "windows_sha256": windows.sha256(),
            "matched_sha256": windows.matched_sha256(), "seconds": seconds, "reach_definition": REACH_DEFINITION,
            "cells": out_cells,
        }
        entry["reach"] = {kind: entry_reach(entry, kind) for kind in kinds}
        used = extension_options(extension, train_context, longest, extension_settings)
        if used is not None:  # the extension's own settings (rerope, self_extend)
            entry["extension_options"] = used
        entries.append(entry)
        label = "" if extension == NONE else f" {extension}"
        shown = ", ".join(f"{k} {v}" for k, v in entry["reach"].items())
        log(f"copy probe{label} ({num_windows} windows, {seconds:.1f}s): reach {shown}; "
            + format_gains(entry))
    return entries


def format_gains(entry: dict[str, Any], kind: str | None = None) -> str:
    """One line of a probe entry's cells of ``kind`` (None: every kind of the entry),
    ``distance:retrieval gain/sensitivity`` per region (``random inside 32:+0.01/+0.14 ... | past
    ...``); an entry without the matched control shows its sensitivity alone and says so."""
    matched = has_matched(entry)
    kinds = [kind] if kind is not None else list(dict.fromkeys(c["kind"] for c in entry["cells"]))
    parts = []
    for k in kinds:
        for region in REGIONS:
            cells = [c for c in entry["cells"] if c["kind"] == k and c["region"] == region]
            if cells:
                shown = (f"{c['distance']}:{c['retrieval_gain']:+.2f}/{c['gain']:+.2f}" if matched
                         else f"{c['distance']}:{c['gain']:+.2f}" for c in cells)
                parts.append(f"{k} {region} " + " ".join(shown))
    what = "retrieval gain/sensitivity" if matched else f"sensitivity only, {NO_MATCHED.split(' (')[0]}"
    return f"{what}: " + " | ".join(parts)


def probe_key(entry: dict[str, Any]) -> tuple[str, str, str]:
    """What identifies a probe entry in results.json: (probe, split, extension)."""
    return str(entry.get("probe")), str(entry.get("split")), str(entry.get("extension", "none"))


# The settings a probe entry was measured under, beyond its key: two entries of one key that
# differ in any of them measured something else (other windows, cells, precision or checkpoint).
# An entry without ``matched_sha256`` (written before the matched control existed) differs in none
# of it: a new entry of the same windows and settings replaces it.
PROBE_MEASUREMENT_FIELDS = ("num_windows", "span", "seed", "kinds", "distances", "windows_sha256", "matched_sha256",
                            "extension_options", "precision", "checkpoint_step")


def probe_variant_label(new: dict[str, Any], reference: dict[str, Any],
                        recorded: dict[str, Any] | None = None) -> str | None:
    """``name=value,...`` for the settings (``PROBE_MEASUREMENT_FIELDS``) where ``new`` differs
    from ``reference``, None when it differs in none. A setting the reference does not record
    (``recorded`` fills in the run's own, e.g. its precision) is no difference; other windows
    that follow from another count, span, seed or kinds are not named twice."""
    theirs = {name: reference.get(name, (recorded or {}).get(name)) for name in PROBE_MEASUREMENT_FIELDS}
    differs = [name for name in PROBE_MEASUREMENT_FIELDS
               if theirs[name] is not None and new.get(name) != theirs[name]]
    if "windows_sha256" in differs and set(differs) & {"num_windows", "span", "seed", "kinds"}:
        differs.remove("windows_sha256")
    if "matched_sha256" in differs and set(differs) & {"num_windows", "span", "seed", "kinds", "windows_sha256"}:
        differs.remove("matched_sha256")  # other windows draw other matched spans
    return ",".join(f"windows={str(new.get(name))[:12]}" if name == "windows_sha256"
                    else f"matched={str(new.get(name))[:12]}" if name == "matched_sha256"
                    else f"{name}={shown_setting(new.get(name))}" for name in differs) or None


def merge_probe_entries(old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]], replace: bool = False,
                        log: Callable[[str], Any] = lambda _: None,
                        recorded: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``posbench eval``'s probe entries ``new`` merged into a run's ``old`` ones, like
    :func:`posbench.runs.results.merge_eval_entries`: each new entry is compared with the run's own
    entry of its :func:`probe_key` (the one without ``variant``):
    - none (another split or extension): added;
    - measured the same way (same windows, cells, precision...): the new one replaces it (the
      same measurement at the run's checkpoint: nothing the run reported changes);
    - measured otherwise (:func:`probe_variant_label`, e.g. ``num_windows=8``): kept beside it
      with ``variant`` = that label, replacing only a variant of the same key and label
      (``replace``: it becomes the run's entry, the old one is kept as variant ``replaced``).
    ``recorded``: settings the run's own entries do not carry (its precision)."""
    current = list(old)
    for entry in new:
        key = probe_key(entry)
        own = next((e for e in current if probe_key(e) == key and "variant" not in e), None)
        label = None if own is None else probe_variant_label(entry, own, recorded)
        described = f"copy probe {key[1]} extension {key[2]}"
        if own is None:
            current.append(entry)
        elif label is None:
            current = [e for e in current if e is not own] + [entry]
            added = " (and adds the matched control it lacked)" if has_matched(entry) and not has_matched(own) else ""
            log(f"the {described} replaces the run's entry: measured the same way{added}")
        elif replace:
            current = [e for e in current if e is not own and (probe_key(e), e.get("variant")) != (key, "replaced")]
            current += [{**own, "variant": "replaced"}, entry]
            log(f"eval.replace=true: the {described} replaces the run's entry (kept as variant 'replaced')")
        else:
            current = [e for e in current if (probe_key(e), e.get("variant")) != (key, label)]
            current.append({**entry, "variant": label})
            log(f"kept the run's {described}; the new one ({label}) is stored beside it under that variant "
                "(eval.replace=true makes it the run's entry instead)")
    return current


def probe_summary(entries: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Flat scalars for a tracker's run summary: ``probe/copy[/<ext>]/reach_<kind>`` and
    ``probe/copy[/<ext>]/<kind>/<region>/retrieval_gain_d<d>`` (entries with the matched control),
    ``.../sensitivity_d<d>`` (every entry)."""
    out: dict[str, float] = {}
    for entry in entries:
        if "variant" in entry:  # the run's own entries only
            continue
        prefix = f"probe/{entry['probe']}" + ("" if entry.get("extension", "none") == "none" else f"/{entry['extension']}")
        for kind in entry.get("kinds") or sorted({c["kind"] for c in entry["cells"]}):
            value = entry_reach(entry, kind)
            if value is not None:
                out[f"{prefix}/reach_{kind}"] = value
        for c in entry["cells"]:
            cell = f"{prefix}/{c['kind']}/{c['region']}"
            if "retrieval_gain" in c:
                out[f"{cell}/retrieval_gain_d{c['distance']}"] = c["retrieval_gain"]
            out[f"{cell}/sensitivity_d{c['distance']}"] = c["gain"]
    return out


def run_probes(model: nn.Module, prepared: Any, evaluation: Any, train_context: int, device: torch.device,
               autocast_dtype: torch.dtype | None, log: Callable[[str], Any]) -> list[dict[str, Any]]:
    """The probes ``evaluation.probes`` asks for (an :class:`posbench.evaluation.settings.EvalConfig`), on
    the held-out split of ``prepared`` (a :class:`posbench.data.PreparedData`), under every
    extension of ``evaluation.extension``. Empty when no probe is asked for."""
    if "copy" not in evaluation.probes:
        return []
    c = evaluation.copy
    return copy_probe(model, prepared.tokens(c.split), train_context, vocab_size=prepared.vocab_size,
                      special_ids=[prepared.eot_id], distances=c.distances, span=c.span,
                      num_windows=c.num_windows, kinds=c.kinds, seed=c.seed, split=c.split,
                      batch_size=evaluation.batch_size, device=device, autocast_dtype=autocast_dtype,
                      extensions=evaluation.extension, extension_factor=evaluation.extension_factor, log=log,
                      extension_settings=evaluation.extension_options())


__all__ = ["Cell", "DEFAULT_DISTANCES", "KINDS", "PROBES", "PROBE_MEASUREMENT_FIELDS", "ProbeWindows", "REACH_DEFINITION", "REACH_MIN_GAIN", "REGIONS", "cell_for",
           "cell_losses", "copy_probe", "entry_reach", "format_gains", "has_matched", "make_windows", "merge_probe_entries", "NO_MATCHED", "paired_cell", "probe_cells",
           "probe_key", "probe_summary", "probe_variant_label", "reach", "run_probes", "shares_ngram",
           "standard_error"]
