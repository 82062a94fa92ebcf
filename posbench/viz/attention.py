"""Recording the attention of a trained model, through the model's own eager backend.

While the model runs, :func:`recording_attention` installs a
:func:`posbench.model.attention.attention_hook` that computes each layer's attention with
:func:`posbench.model.attention.eager_probabilities` and
:func:`posbench.model.attention.eager_output`: the eager backend the model trains and is tested
with, from the very q, k, score term, window, value term and normaliser the model hands to its
backend. The recorded weights are therefore the model's own, and the forward pass under the
recording equals the model's eager forward. :func:`record_attention` runs one window at a time,
so memory is one (H, T, T) matrix per layer even at 4C.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from posbench.core.errors import PosbenchError
from posbench.data.loader import eval_sequences
from posbench.methods.base import Normalizer, ScoreFn, ValueTerm
from posbench.model.attention import attention_hook, eager_output, eager_probabilities
from posbench.runs.load import run_data
from posbench.viz.grid_measures import grid_attended_distance
from posbench.viz.measures import attention_entropy, mean_attended_distance, score_curves
from posbench.viz.settings import AttentionSettings

Log = Callable[[str], None]


@dataclass
class LayerStats:
    """What one layer's attention did over the recorded windows (numpy, ready to draw)."""

    entropy: np.ndarray  # (H, T) mean over windows
    distance: np.ndarray  # (H, T) mean attended distance (tokens; grid: cells), mean over windows
    score: np.ndarray | None  # (H, T) score term by distance, mean over queries and windows
    maps: np.ndarray | None  # (H, T, T) attention of the first window, for layers drawn


@dataclass
class AttentionRecord:
    layers: list[LayerStats] = field(default_factory=list)


def layer_stats(probs: Tensor, score: ScoreFn | None, keep_maps: bool, causal: bool = True) -> LayerStats:
    """One layer's attention probabilities (B, H, T, T) -> its statistics, mean over the B windows.

    Bidirectional attention (``causal=False``: the grid encoder, cells in row-major order): the
    distance is Euclidean in cells (:func:`posbench.viz.grid_measures.grid_attended_distance`)
    and no score curve by 1D distance is kept."""
    B, H, T, _ = probs.shape
    score_curve = None
    if score is not None and causal:  # (H, T) per window, one (T, T) term grid at a time
        score_curve = torch.stack([score_curves(score, range(H), T, probs.device, batch=b) for b in range(B)]).mean(0)
    distance = mean_attended_distance(probs) if causal else grid_attended_distance(probs)  # (B, H, T)
    return LayerStats(
        entropy=attention_entropy(probs).mean(0).cpu().numpy(),  # (H, T)
        distance=distance.mean(0).cpu().numpy(),  # (H, T)
        score=None if score_curve is None else score_curve.cpu().numpy(),
        maps=probs[0].cpu().numpy() if keep_maps else None,  # (H, T, T)
    )


@contextlib.contextmanager
def recording_attention(n_layers: int, map_layers: Sequence[int]) -> Iterator[AttentionRecord]:
    """Within the block, every attention call of posbench models is computed by the eager
    backend and recorded (through :func:`posbench.model.attention.attention_hook`).

    Layers run in order 0..n_layers-1 in each forward; only one forward may run inside the block.
    """
    record = AttentionRecord()

    def attend(q: Tensor, k: Tensor, v: Tensor, score: ScoreFn | None, window: int | None,
               value: ValueTerm | None, normalize: Normalizer | None, causal: bool = True) -> Tensor:
        layer = len(record.layers)
        if layer >= n_layers:
            raise RuntimeError("recording_attention records one forward pass only")
        probs = eager_probabilities(q, k, score, window, normalize, causal=causal)  # (B, H, T, T)
        record.layers.append(layer_stats(probs, score, keep_maps=layer in map_layers, causal=causal))
        return eager_output(probs, v, value)

    with attention_hook(attend):
        yield record


def record_attention(model: Any, tokens: Tensor, map_layers: Sequence[int]) -> AttentionRecord:
    """Run ``model`` on (N, L) tokens, one window at a time, and average the attention statistics."""
    n_layers = model.cfg.n_layers
    map_layers = sorted({layer % n_layers for layer in map_layers})
    records = []
    with torch.no_grad():
        for i, window in enumerate(tokens):
            with recording_attention(n_layers, map_layers if i == 0 else ()) as record:
                model(window[None].to(next(model.parameters()).device))
            records.append(record)
    merged = AttentionRecord()
    for layer in range(n_layers):
        per = [r.layers[layer] for r in records]
        merged.layers.append(LayerStats(
            entropy=np.mean([p.entropy for p in per], axis=0),
            distance=np.mean([p.distance for p in per], axis=0),
            score=None if per[0].score is None else np.mean([p.score for p in per], axis=0),
            maps=per[0].maps,
        ))
    return merged


def held_out_windows(run: Any, length: int, settings: AttentionSettings, log: Log) -> tuple[Tensor, str]:
    """(N, L) held-out inputs and what they are: a text run's windows of its own validation (or
    test) text; a task run's (``task=flipflop``) held-out sequences of its task, which has no text."""
    task_section = run.config.get("task")
    if task_section is not None:
        from posbench.tasks.base import TEST, VALID, make_task

        if settings.split not in ("validation", "test"):
            raise PosbenchError(f"attention.split={settings.split} is not held out; a task run's held-out sequences are "
                                "attention.split=validation or attention.split=test")
        task = make_task(task_section, int(run.config.trainer.context))
        task.check_length(length)
        inputs, _ = task.sequences(VALID if settings.split == "validation" else TEST, length, settings.num_sequences).inputs_targets()
        return inputs, f"{len(inputs)} held-out {task.name} sequences ({settings.split}) of {length} tokens"
    prepared = run_data(run, log)  # the run's own tokens and tokenizer (checksum verified), as posbench eval
    windows = eval_sequences(prepared.tokens(settings.split), length, settings.num_sequences, split=settings.split)
    return windows[:, :length], f"{len(windows)} held-out windows of {length} tokens"  # (N, L): no target token


__all__ = ["AttentionRecord", "LayerStats", "held_out_windows", "record_attention", "recording_attention"]
