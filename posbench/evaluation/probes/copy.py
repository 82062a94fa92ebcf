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
                                                    key ``sensitivity``; records from before the
                                                    matched control call it ``gain``, and read it
                                                    back as ``sensitivity``:
                                                    :func:`posbench.runs.results.upgrade_results`)

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

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from posbench.config.settings import require_positive
from posbench.core.errors import PosbenchError
from posbench.evaluation.loss import score_rows
from posbench.evaluation.probes import Probe, ProbeRun, register_probe
from posbench.evaluation.probes.copy_windows import KINDS, REGIONS, Cell, make_windows, probe_cells
from posbench.evaluation.probes.merge import merge_probe_entries
from posbench.evaluation.stats import bootstrap_interval
from posbench.model.extension import NONE, evaluation_order, extended, extension_options

DEFAULT_DISTANCES = (32, 64, 128, 192, 256, 320, 384, 512, 768)
# Below this retrieval gain (nats) at the reference cell the model barely copies even inside C: reach 0. A
# model that copies random spans gains nats (their matched control's loss is ln V or more).
REACH_MIN_GAIN = 0.5
REACH_DEFINITION = ("reach: the largest distance d such that the retrieval gain of a repeat placed past the "
                    "training context stays at least half of the reference gain, at d and at every smaller "
                    "distance of the grid. The reference is the retrieval gain inside the context at the smallest "
                    "distance d >= 2k (at least k other tokens between the two copies: never the adjacent copy "
                    "at d = k, whose repeat follows its first occurrence at once). 0 when it never does, or when "
                    f"the reference is below {REACH_MIN_GAIN} nats; none when no distance >= 2k fits inside the "
                    "context, or for an entry without the matched control")
NO_MATCHED = "no matched control (an entry written before it existed: sensitivity only)"


@dataclass(frozen=True)
class CopySettings:
    """The copy probe's settings (eval.copy.*; docs/probes.md)."""

    distances: list[int] = field(default_factory=lambda: [32, 64, 128, 192, 256, 320, 384, 512, 768])
    """Distances d between the two occurrences of the span (each >= span)."""
    span: int = 32
    """k: tokens in the repeated span; k - 1 of them are scored."""
    num_windows: int = 64
    """Windows per (kind, distance, region), the same windows for every cell and every method;
    at least 2 (for an interval)."""
    kinds: list[str] = field(default_factory=lambda: ["random", "text"])
    """random (ids uniform over the vocabulary: pure retrieval) and/or text (a held-out passage)."""
    seed: int = 0
    """Seeds the choice of passages and the random spans (never the model's seed)."""
    split: str = "validation"
    """validation or test: held-out text only."""

    def validate(self) -> None:
        s = "eval.copy"
        require_positive(s, span=self.span, num_windows=self.num_windows)
        if self.span < 2:
            raise PosbenchError(f"eval.copy.span must be at least 2 (one token is not scored), got {self.span}")
        if self.num_windows < 2:
            raise PosbenchError(f"eval.copy.num_windows must be at least 2 (for an interval), got {self.num_windows}")
        if not self.distances or any(isinstance(d, bool) or not isinstance(d, int) or d < self.span
                                     for d in self.distances):
            raise PosbenchError(f"eval.copy.distances must be integers >= eval.copy.span={self.span}, "
                                f"got {self.distances}")
        if not self.kinds or any(k not in KINDS for k in self.kinds):
            raise PosbenchError(f"eval.copy.kinds must be a non-empty list of {', '.join(KINDS)}, got {self.kinds}")
        if self.split not in ("validation", "test"):
            raise PosbenchError(f"eval.copy.split must be validation or test (held-out text), got {self.split!r}")


def cell_losses(model: nn.Module, windows: torch.Tensor, cell: Cell, batch_size: int, device: torch.device,
                autocast_dtype: torch.dtype | None) -> np.ndarray:
    """Per-window mean loss ``(N,)`` of targets ``t + 1 .. t + k - 1`` of ``windows`` ``(N, L)``."""
    inputs = windows[:, : cell.length - 1]  # (N, t + k - 1): the last k - 1 inputs are t .. t + k - 2
    targets = windows[:, cell.t + 1 : cell.length]  # (N, k - 1)
    return score_rows(model, inputs, targets, batch_size, device, autocast_dtype, None).mean(dim=1).numpy()


def reference_distance(gains: dict[tuple[int, str], float], span: int) -> int | None:
    """The distance of the reach's reference cell: the smallest inside C with ``d >= 2 * span``
    (not the adjacent copy at ``d = span``, which a model can copy as a continuation), or None."""
    return min((d for d, r in gains if r == "inside" and d >= 2 * span), default=None)


def reach(gains: dict[tuple[int, str], float], distances: Sequence[int], span: int) -> int | None:
    """:data:`REACH_DEFINITION` of one kind's mean retrieval gains ``{(distance, region): gain}``
    with spans of ``span`` tokens; None without a reference cell."""
    ref = reference_distance(gains, span)
    if ref is None:
        return None
    if not gains[(ref, "inside")] >= REACH_MIN_GAIN:
        return 0
    half = gains[(ref, "inside")] / 2
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
    when the entry has no cell of that kind, no matched control (no retrieval gain), no span
    (``span``, else a cell's ``length - t``) or no reference cell."""
    if not has_matched(entry):
        return None
    cells = [c for c in entry["cells"] if c["kind"] == kind]
    span = entry.get("span") or next((c["length"] - c["t"] for c in cells if "length" in c and "t" in c), None)
    if not cells or span is None:
        return None
    gains = {(int(c["distance"]), c["region"]): float(c["retrieval_gain"]) for c in cells}
    return reach(gains, entry.get("distances") or sorted({d for d, _ in gains}), int(span))


def standard_error(values: np.ndarray) -> float:
    """Standard error of the mean of ``values`` over windows (sample standard deviation / sqrt(n))."""
    return float(np.std(values, ddof=1) / math.sqrt(len(values)))


def paired_cell(kind: str, cell: Cell, repeat: np.ndarray, control: np.ndarray, matched: np.ndarray) -> dict[str, Any]:
    """A results.json cell from the per-window losses ``(N,)`` of the three windows of ``cell``:
    the retrieval gain and the sensitivity, each paired per window."""
    sensitivity = control - repeat  # (N,)
    retrieval = matched - repeat  # (N,)
    s, r = bootstrap_interval(sensitivity), bootstrap_interval(retrieval)
    return {
        "kind": kind, "distance": cell.distance, "region": cell.region, "p": cell.p, "t": cell.t,
        "length": cell.length, "loss_repeat": float(repeat.mean()), "loss_control": float(control.mean()),
        "loss_matched": float(matched.mean()),
        "retrieval_gain": r.mean, "retrieval_interval": [r.low, r.high], "retrieval_se": standard_error(retrieval),
        "sensitivity": s.mean, "sensitivity_interval": [s.low, s.high], "sensitivity_se": standard_error(sensitivity),
        "count": s.n, "window_retrieval_gains": retrieval.tolist(), "window_sensitivities": sensitivity.tolist(),
    }


def copy_probe(model: nn.Module, tokens: np.ndarray, vocab_size: int, special_ids: Sequence[int],
               settings: CopySettings, run: ProbeRun) -> list[dict[str, Any]]:
    """Run the copy probe on ``model``; one results.json ``probes`` entry per extension of ``run``.

    ``tokens`` is the held-out stream of ``settings.split`` (validation or test: the probe refuses
    training text). Each entry holds the settings, ``windows_sha256``, ``matched_sha256``,
    ``seconds``, ``reach`` (per kind, :data:`REACH_DEFINITION`) and ``cells`` (:func:`paired_cell`):
    per (kind, distance, region) the positions ``p, t, length``, the three mean losses, the
    ``retrieval_gain`` and the ``sensitivity``, each with its bootstrap interval over windows,
    its standard error and its per-window values (for pairing), and ``count``.
    Cells longer than the model's learned positions are left out (logged).
    """
    distances, span, num_windows, kinds, seed, split = (settings.distances, settings.span, settings.num_windows,
                                                        settings.kinds, settings.seed, settings.split)
    train_context, batch_size, autocast_dtype, log = run.train_context, run.batch_size, run.autocast_dtype, run.log
    extension_factor, extension_settings = run.extension_factor, run.extension_settings
    if split == "train":
        raise PosbenchError("the copy probe reads held-out text only; use eval.copy.split=validation or test")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise PosbenchError(f"unknown eval.copy.kinds {unknown or list(kinds)}; choose from {', '.join(KINDS)}")
    if not 2 <= span < train_context:
        raise PosbenchError(f"eval.copy.span must be in 2 .. {train_context - 1}, got {span}")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < span for d in distances) or not distances:
        raise PosbenchError(f"eval.copy.distances must be integers >= eval.copy.span={span}, got {list(distances)}")
    device = torch.device(run.device)
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
    for extension in evaluation_order(run.extensions):
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
                shown = (f"{c['distance']}:{c['retrieval_gain']:+.2f}/{c['sensitivity']:+.2f}" if matched
                         else f"{c['distance']}:{c['sensitivity']:+.2f}" for c in cells)
                parts.append(f"{k} {region} " + " ".join(shown))
    what = "retrieval gain/sensitivity" if matched else f"sensitivity only, {NO_MATCHED.split(' (')[0]}"
    return f"{what}: " + " | ".join(parts)


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
            out[f"{cell}/sensitivity_d{c['distance']}"] = c["sensitivity"]
    return out


@register_probe
class CopyProbe(Probe):
    """``eval.probes=[copy]``: entries under results.json ``probes``."""

    name = "copy"
    description = "a span repeated at distance d, scored against a matched control; docs/probes.md"
    settings = CopySettings
    results_key = "probes"
    report = "posbench.report.probes"

    def check(self, settings: CopySettings, train_context: int) -> None:
        if not settings.span < train_context:
            raise PosbenchError(f"eval.copy.span={settings.span} must be below the training context {train_context}")

    def run(self, model: nn.Module, data: Any, settings: CopySettings, run: ProbeRun) -> list[dict[str, Any]]:
        """On the held-out split ``settings.split`` of ``data`` (a :class:`posbench.data.PreparedData`)."""
        return copy_probe(model, data.tokens(settings.split), data.vocab_size, [data.eot_id], settings, run)

    def merge(self, old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]], replace: bool,
              log: Callable[[str], Any], recorded: dict[str, Any] | None) -> list[dict[str, Any]]:
        return merge_probe_entries(old, new, replace, log, recorded, note=lambda entry, own: (
            " (and adds the matched control it lacked)" if has_matched(entry) and not has_matched(own) else ""))

    def summary(self, entries: Sequence[dict[str, Any]]) -> dict[str, float]:
        return probe_summary(entries)


__all__ = ["CopyProbe", "CopySettings", "DEFAULT_DISTANCES", "NO_MATCHED", "REACH_DEFINITION", "REACH_MIN_GAIN",
           "cell_losses", "copy_probe", "entry_reach", "format_gains", "has_matched", "paired_cell", "probe_summary",
           "reach", "reference_distance", "standard_error"]
