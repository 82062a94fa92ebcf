"""The passkey (needle) evaluation: can the model answer a key it read earlier in held-out text?

Zero-shot on any text run; ``eval.probes=[passkey]`` (docs/retrieval.md). A window of ``L``
tokens is held-out text (the haystack, validation or test split) with two sentences written
over it, the same sentences ``data.retrieval`` puts into training windows
(:mod:`posbench.data.retrieval`):

    window:   haystack ... The pass key is 58213. Remember it. ... haystack ... What is the pass key? The pass key is 58213
    control:  haystack ... haystack (its own text, no key) ...    ... haystack ... What is the pass key? The pass key is 58213

The window ends with the answer: its last ``k`` tokens (the key's digits) are the scored
targets. The needle starts at ``p = round(depth * (L - needle - question))``: depth 0 puts it at
the start of the window, farthest from the question, depth 1 right before it; the key is
``distance`` tokens before its answer. The control differs from the window only where the needle
was (it keeps the haystack's own tokens there), so ``gain = logprob(window) - logprob(control)``
is what reading the key is worth, paired per window.

Per cell (length, depth): ``accuracy`` (exact match: every answer token is the model's argmax,
i.e. greedy decoding writes the key), ``logprob`` (the answer's total log-probability in nats;
guessing: ``ln 1e-5 = -11.51``), ``token_logprob`` (per answer token), the control's accuracy
and log-probability (the best a model does without the key: its digit prior, the shortcut), and
the gain with 95 % bootstrap intervals over windows. Keys are 5 digits uniform over 0-9: chance
accuracy 1e-5.

Windows depend only on the seed and the data, never on the model (``windows_sha256``).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from posbench.core.errors import PosbenchError
from posbench.data.retrieval import KEY_DIGITS, PasskeyText
from posbench.evaluation.loss import inference
from posbench.evaluation.probes import Probe, ProbeRun, register_probe
from posbench.evaluation.stats import bootstrap_interval
from posbench.model.extension import NONE, evaluation_order, extended, extension_options

DEFAULT_LENGTHS = (256, 512, 1024, 2048)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
CHANCE = 10.0 ** -KEY_DIGITS  # guessing a key of uniform digits
CHANCE_LOGPROB = math.log(CHANCE)


@dataclass(frozen=True)
class PasskeySettings:
    """The passkey evaluation's settings (eval.passkey.*; docs/retrieval.md)."""

    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048])
    """Window lengths L of the passkey evaluation (``eval.probes=[passkey]``, docs/retrieval.md);
    the question and its answer end the window."""
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Where the key sentence starts, as a fraction of the room before the question (0: the
    window's start, farthest from the question; 1: right before it)."""
    num_windows: int = 32
    """Windows per (length, depth): the same haystacks and keys in every cell and for every method."""
    seed: int = 0
    """Seeds the haystacks and the keys (never the model's seed)."""
    split: str = "validation"
    """validation or test: held-out text only."""

    def validate(self) -> None:
        s = "eval.passkey"
        if self.num_windows < 2:
            raise PosbenchError(f"{s}.num_windows must be at least 2 (for an interval), got {self.num_windows}")
        if not self.lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 64 for n in self.lengths):
            raise PosbenchError(f"{s}.lengths must be integers >= 64 (room for the key and the question), "
                                f"got {self.lengths}")
        if not self.depths or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1
                                  for d in self.depths):
            raise PosbenchError(f"{s}.depths must be numbers in [0, 1], got {self.depths}")
        if self.split not in ("validation", "test"):
            raise PosbenchError(f"{s}.split must be validation or test (held-out text), got {self.split!r}")


@dataclass
class PasskeyWindows:
    """The windows of one length: ``window`` and ``control`` ``(N, L)`` per depth, the answer's
    token count ``answer`` ``(N,)`` (the last tokens of every row) and the key's distance from
    its answer ``distance`` ``(N,)``."""

    windows: dict[float, np.ndarray]
    distances: dict[float, np.ndarray]
    control: np.ndarray
    answer: np.ndarray


def draw_haystacks(tokens: np.ndarray, num_windows: int, length: int, seed: int) -> np.ndarray:
    """``num_windows`` non-overlapping held-out passages of ``length`` tokens ``(N, length)``,
    chosen by ``numpy.random.default_rng(seed)`` among the stream's slots of that length."""
    tokens = np.asarray(tokens)
    slots = len(tokens) // length
    if slots < num_windows:
        raise PosbenchError(f"the passkey evaluation needs {num_windows} held-out passages of {length} tokens but "
                            f"the split holds {len(tokens)} tokens ({slots}); lower eval.passkey.num_windows or the "
                            "largest of eval.passkey.lengths")
    chosen = np.sort(np.random.default_rng(seed).permutation(slots)[:num_windows])
    return np.stack([tokens[s * length : (s + 1) * length] for s in chosen]).astype(np.int64)


def build_windows(haystacks: np.ndarray, keys: Sequence[str], text: PasskeyText, length: int,
                  depths: Sequence[float]) -> PasskeyWindows:
    """The windows of ``length`` from the first ``length`` tokens of each haystack (rule in the
    module docstring)."""
    n = len(haystacks)
    control = haystacks[:, :length].copy()  # (N, L)
    windows = {d: np.empty_like(control) for d in depths}
    distances = {d: np.empty(n, dtype=np.int64) for d in depths}
    answer = np.empty(n, dtype=np.int64)
    for i, key in enumerate(keys):
        key_ids = text.key_ids(key)
        needle, offset = text.needle(key_ids)
        question, _ = text.question(key_ids, answered=False)
        block = np.concatenate([question, key_ids])  # ends the window with the answer
        room = length - len(block) - len(needle)
        if room < 0:
            raise PosbenchError(f"eval.passkey.lengths has {length}, too short for the passkey sentences "
                                f"({len(block) + len(needle)} tokens); use lengths of at least 64")
        control[i, length - len(block) :] = block
        answer[i] = len(key_ids)
        for depth in depths:
            p = round(depth * room)
            windows[depth][i] = control[i]
            windows[depth][i, p : p + len(needle)] = needle
            distances[depth][i] = (length - len(key_ids)) - (p + offset)
    return PasskeyWindows(windows, distances, control, answer)


def answer_scores(model: nn.Module, rows: np.ndarray, answer: np.ndarray, batch_size: int, device: torch.device,
                  autocast_dtype: torch.dtype | None) -> tuple[np.ndarray, np.ndarray]:
    """(total log-probability ``(N,)`` of each row's last ``answer[i]`` tokens, whether every one
    of them is the argmax ``(N,)``), reading ``rows[:, :-1]``. The head and the softmax run in
    float32."""
    k = int(answer.max())
    logprob, correct = np.empty(len(rows)), np.empty(len(rows), dtype=bool)
    keep = torch.from_numpy(np.arange(k)[None, :] >= (k - answer)[:, None])  # (N, k): the answer's positions
    with inference(model):
        for s in range(0, len(rows), batch_size):
            x = torch.from_numpy(rows[s : s + batch_size, :-1]).to(device)  # (B, L - 1)
            y = torch.from_numpy(rows[s : s + batch_size, -k:]).to(device)  # (B, k)
            has_head = hasattr(model, "hidden_states") and hasattr(model, "lm_head")
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                h = model.hidden_states(x) if has_head else model(x)  # (B, L - 1, D) or (B, L - 1, V)
            h = h[:, -k:].float()  # (B, k, .)
            logits = F.linear(h, model.lm_head.weight.float(), None if model.lm_head.bias is None
                              else model.lm_head.bias.float()) if has_head else h  # (B, k, V)
            lp = logits.log_softmax(-1).gather(-1, y[..., None])[..., 0].cpu().double()  # (B, k)
            hit = (logits.argmax(-1) == y).cpu()
            mask = keep[s : s + batch_size]
            logprob[s : s + len(x)] = (lp * mask).sum(1).numpy()
            correct[s : s + len(x)] = (hit | ~mask).all(1).numpy()
    return logprob, correct


def interval_fields(name: str, values: np.ndarray) -> dict[str, Any]:
    """``{name: mean, name_interval: [low, high]}`` over windows (95 % bootstrap)."""
    interval = bootstrap_interval(np.asarray(values, dtype=float))
    return {name: interval.mean, f"{name}_interval": [interval.low, interval.high]}


def passkey_eval(model: nn.Module, tokens: np.ndarray, encode: Callable[[list[str]], list[list[int]]],
                 settings: PasskeySettings, run: ProbeRun) -> list[dict[str, Any]]:
    """Run the passkey evaluation on ``model``; one results.json ``passkey`` entry per extension of ``run``.

    ``tokens``: the held-out stream of ``settings.split`` (the haystack); ``encode``: the run's
    tokenizer (texts -> id lists). Each entry holds the settings, ``chance`` / ``chance_logprob``,
    ``windows_sha256``, ``seconds`` and ``cells``: per (length, depth) the mean ``distance``,
    ``accuracy``, ``logprob``, ``token_logprob``, ``control_accuracy``, ``control_logprob`` and
    ``gain`` (with ``*_interval``), ``count`` and the per-window ``window_gains``. Lengths past
    the model's learned positions are left out (logged).
    """
    num_windows, seed, split = settings.num_windows, settings.seed, settings.split
    train_context, batch_size, autocast_dtype, log = run.train_context, run.batch_size, run.autocast_dtype, run.log
    extension_factor, extension_settings = run.extension_factor, run.extension_settings
    if split == "train":
        raise PosbenchError("the passkey evaluation reads held-out text only; use eval.passkey.split=validation or test")
    device = torch.device(run.device)
    lengths, depths = sorted(set(settings.lengths)), sorted({float(d) for d in settings.depths})
    text = PasskeyText(encode)
    rng = np.random.default_rng([seed, 1])  # the keys; the haystacks use default_rng(seed)
    keys = [text.draw_key(rng) for _ in range(num_windows)]
    haystacks = draw_haystacks(tokens, num_windows, max(lengths), seed)  # sized by the whole grid: same windows
    limit = getattr(getattr(model, "position", None), "max_positions", None)
    if limit is not None:
        check_lengths_fit(lengths, limit)
    if limit is not None and max(lengths) - 1 > limit:
        log(f"passkey: leaving out lengths past the model's {limit} learned positions "
            f"({', '.join(str(n) for n in lengths if n - 1 > limit)})")
        lengths = [n for n in lengths if n - 1 <= limit]
    built = {n: build_windows(haystacks, keys, text, n, depths) for n in lengths}
    digest = hashlib.sha256(np.ascontiguousarray(haystacks).tobytes() + "".join(keys).encode()).hexdigest()
    entries = []
    for extension in evaluation_order(run.extensions):
        started, cells, factors = time.perf_counter(), [], {}
        for n, w in built.items():
            with extended(model, extension, train_context, n - 1, extension_factor, extension_settings) as factor:
                factors[n - 1] = factor
                control_lp, control_hit = answer_scores(model, w.control, w.answer, batch_size, device, autocast_dtype)
                for depth in depths:
                    lp, hit = answer_scores(model, w.windows[depth], w.answer, batch_size, device, autocast_dtype)
                    gains = lp - control_lp  # (N,) paired per window
                    cells.append({
                        "length": n, "depth": depth, "distance": float(w.distances[depth].mean()),
                        "past_context": bool(n > train_context), **interval_fields("accuracy", hit),
                        **interval_fields("logprob", lp), "token_logprob": float((lp / w.answer).mean()),
                        **interval_fields("control_accuracy", control_hit), "control_logprob": float(control_lp.mean()),
                        **interval_fields("gain", gains), "count": len(gains), "window_gains": gains.tolist(),
                    })
        entry = {
            "probe": "passkey", "split": split, "extension": extension,
            "extension_factor": {str(k): v for k, v in factors.items()} if extension != NONE else None,
            "seed": seed, "num_windows": num_windows, "lengths": lengths, "depths": depths,
            "key_digits": KEY_DIGITS, "chance": CHANCE, "chance_logprob": CHANCE_LOGPROB,
            "train_context": train_context, "windows_sha256": digest,
            "seconds": time.perf_counter() - started, "cells": cells,
        }
        used = extension_options(extension, train_context, max(lengths), extension_settings)
        if used is not None:
            entry["extension_options"] = used
        entries.append(entry)
        log(f"passkey{'' if extension == NONE else ' ' + extension} ({num_windows} windows, "
            f"{entry['seconds']:.1f}s): {format_accuracy(entry)}")
    return entries


def check_lengths_fit(lengths: Sequence[int], limit: int) -> None:
    """Refuse passkey lengths that all lie past a model's ``limit`` learned positions (a window of
    n tokens reads positions 0..n-2): nothing would be left to measure."""
    if lengths and min(lengths) - 1 > limit:
        raise PosbenchError(
            f"every eval.passkey.lengths {sorted(lengths)} lies past the model's {limit} learned positions, so the "
            f"passkey evaluation would measure nothing; add a length up to {limit + 1}, e.g. "
            f"eval.passkey.lengths=[{limit + 1}], or raise method.max_positions before training"
        )


def format_accuracy(entry: dict[str, Any]) -> str:
    """One line: accuracy and gain by length (mean over depths), with chance and the control."""
    parts = []
    for n in entry["lengths"]:
        cells = [c for c in entry["cells"] if c["length"] == n]
        parts.append(f"L={n} acc {np.mean([c['accuracy'] for c in cells]):.2f} (control "
                     f"{np.mean([c['control_accuracy'] for c in cells]):.2f}) gain {np.mean([c['gain'] for c in cells]):+.2f}")
    return "; ".join(parts) + f" (chance {entry['chance']:g})"


def passkey_summary(entries: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Flat scalars for a tracker: ``passkey[/<ext>]/accuracy_L<n>`` and ``.../gain_L<n>`` (mean over depths)."""
    out: dict[str, float] = {}
    for entry in entries:
        if "variant" in entry:
            continue
        prefix = "passkey" + ("" if entry.get("extension", NONE) == NONE else f"/{entry['extension']}")
        for n in entry["lengths"]:
            cells = [c for c in entry["cells"] if c["length"] == n]
            out[f"{prefix}/accuracy_L{n}"] = float(np.mean([c["accuracy"] for c in cells]))
            out[f"{prefix}/gain_L{n}"] = float(np.mean([c["gain"] for c in cells]))
    return out


@register_probe
class PasskeyProbe(Probe):
    """``eval.probes=[passkey]``: entries under results.json ``passkey``."""

    name = "passkey"
    description = "a key asked for at the window's end, by depth x length; docs/retrieval.md"
    settings = PasskeySettings
    results_key = "passkey"
    report = "posbench.report.passkey"

    def check_positions(self, settings: PasskeySettings, max_positions: int) -> None:
        check_lengths_fit(settings.lengths, max_positions)

    def run(self, model: nn.Module, data: Any, settings: PasskeySettings, run: ProbeRun) -> list[dict[str, Any]]:
        """On the held-out split ``settings.split`` of ``data`` (a :class:`posbench.data.PreparedData`)."""
        return passkey_eval(model, data.tokens(settings.split), data.encode, settings, run)

    def summary(self, entries: Sequence[dict[str, Any]]) -> dict[str, float]:
        return passkey_summary(entries)


__all__ = ["CHANCE", "CHANCE_LOGPROB", "DEFAULT_DEPTHS", "DEFAULT_LENGTHS", "PasskeyProbe", "PasskeySettings",
           "PasskeyWindows", "answer_scores", "build_windows", "check_lengths_fit", "draw_haystacks", "format_accuracy", "passkey_eval",
           "passkey_summary"]
