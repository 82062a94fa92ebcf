"""Per-position evaluation: how does the next-token loss change along the sequence?

The benchmark's measurement. A held-out token stream is cut into the first ``N`` non-overlapping
windows of ``L + 1`` tokens; the model reads ``window[:-1]`` teacher-forced (positions 0..L-1)
and is scored on ``window[1:]``. The result is the mean loss at every position, plus band means
(:mod:`posbench.evaluation.curves`):

    "0-C"     inside the training context C (C = 256 by default)
    "C-2C"    the headline extrapolation band ("256-512")
    "2C-4C", "4C-8C", ...   one band per doubling, only when fully inside the evaluated length

Band ``"a-b"`` is the mean over positions ``a .. b-1``. With a training context other than 256
the band edges move with it (e.g. C = 128 gives "0-128", "128-256", "256-512", ...).
"""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posbench.core.errors import PosbenchError
from posbench.data.loader import eval_sequences, spread_sequences
from posbench.evaluation.curves import (
    EFFECTIVE_LENGTH_WINDOW,
    band_means,
    curve_summary,
    effective_length,
    sequence_band_means,
)
from posbench.evaluation.settings import EvalConfig
from posbench.model.extension import NONE, evaluation_order, extended, record_extension
from posbench.model.transformer import CPU_LOGITS_CHUNK_BYTES
from posbench.runs.entries import headline_entries
from posbench.runs.results import build_results
from posbench.runs.results_types import EvaluatedRun, LossEntry

# Upper bound for one chunk of float32 logits; log-softmax/cross-entropy needs about one more
# buffer of the same size, so peak extra memory stays well under 1 GB even for 50k vocabularies.
_LOGITS_CHUNK_BYTES = 256 * 2**20


def _positions_per_chunk(batch: int, length: int, vocab: int, vocab_chunk: int | None,
                         device: torch.device | None = None) -> int:
    if vocab_chunk is not None:
        if vocab_chunk <= 0:
            raise PosbenchError(f"vocab_chunk must be a positive number of positions, got {vocab_chunk}")
        return min(vocab_chunk, length)
    budget = _LOGITS_CHUNK_BYTES
    if device is not None and device.type != "cuda":  # CPU: chunks the heap reuses (see posbench.model.transformer)
        budget = CPU_LOGITS_CHUNK_BYTES
    fit = budget // max(1, batch * vocab * 4)
    return int(max(1, min(length, fit)))


def _last_position_losses(model: nn.Module, inputs: Tensor, targets: Tensor, autocast_dtype: torch.dtype | None,
                          vocab_chunk: int | None) -> Tensor:
    """Cross-entropy of the last ``K = targets.shape[1]`` positions of each row of ``inputs``.

    ``inputs`` ``(B, T)`` and ``targets`` ``(B, K)`` on the model's device, ``K <= T``. Returns
    float32 ``(B, K)``. Only the scored positions go through the LM head, in chunks of positions
    (see :func:`per_position_loss`), in float32 outside autocast.
    """
    device = inputs.device
    has_head = hasattr(model, "hidden_states") and hasattr(model, "lm_head")
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        h = model.hidden_states(inputs) if has_head else model(inputs)  # (B, T, D) or (B, T, V)
    keep = targets.shape[1]
    h = h[:, h.shape[1] - keep :]  # (B, K, .)
    # Outside autocast on purpose: the head and the softmax run in float32.
    if has_head:
        weight = model.lm_head.weight.float()
        bias = None if model.lm_head.bias is None else model.lm_head.bias.float()
        vocab = weight.shape[0]
    else:
        vocab = h.shape[-1]
    step = _positions_per_chunk(inputs.shape[0], keep, vocab, vocab_chunk, device)
    losses = []
    for s in range(0, keep, step):
        e = min(s + step, keep)
        logits = F.linear(h[:, s:e].float(), weight, bias) if has_head else h[:, s:e].float()  # (B, k, V)
        losses.append(F.cross_entropy(logits.reshape(-1, vocab), targets[:, s:e].reshape(-1),
                                      reduction="none").view(inputs.shape[0], e - s))
    return torch.cat(losses, dim=1)


def _check_sequences(sequences: Tensor, batch_size: int) -> None:
    if sequences.ndim != 2 or sequences.shape[1] < 2:
        raise PosbenchError(f"sequences must have shape [N, L+1] with L >= 1, got {tuple(sequences.shape)}")
    if batch_size <= 0:
        raise PosbenchError(f"eval batch size must be positive, got {batch_size}")


def score_rows(model: nn.Module, inputs: Tensor, targets: Tensor, batch_size: int, device: torch.device,
                autocast_dtype: torch.dtype | None, vocab_chunk: int | None) -> Tensor:
    """:func:`_last_position_losses` over all rows of CPU tensors, ``batch_size`` rows per
    forward, in inference mode; returns float64 ``(rows, K)`` on the CPU."""
    out = torch.empty(targets.shape, dtype=torch.float64)
    with inference(model):
        for start in range(0, inputs.shape[0], batch_size):
            x = inputs[start : start + batch_size].to(device, dtype=torch.long, non_blocking=True)
            y = targets[start : start + batch_size].to(device, dtype=torch.long, non_blocking=True)
            out[start : start + x.shape[0]] = _last_position_losses(model, x, y, autocast_dtype, vocab_chunk).double().cpu()
    return out


@contextmanager
def inference(model: nn.Module) -> Iterator[None]:
    """Eval mode and inference mode inside the block; the model's train/eval mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def per_sequence_loss(
    model: nn.Module,
    sequences: Tensor,
    batch_size: int,
    device: str | torch.device,
    autocast_dtype: torch.dtype | None = None,
    vocab_chunk: int | None = None,
) -> Tensor:
    """Next-token cross-entropy of every sequence at every position, full context.

    Args:
        model: a :class:`posbench.model.transformer.Transformer` (anything with ``hidden_states(ids)`` and
            ``lm_head``; a plain ``ids -> logits`` module also works, unchunked).
        sequences: LongTensor ``[N, L + 1]``; inputs are ``seq[:, :-1]``, targets ``seq[:, 1:]``.
        batch_size: sequences per forward pass (the last batch may be smaller).
        device: where the model lives; batches are moved there one at a time.
        autocast_dtype: e.g. ``torch.bfloat16`` to run the transformer body under autocast. The
            LM head, log-softmax and loss always run in float32.
        vocab_chunk: number of sequence positions whose ``[B, chunk, vocab]`` logits are
            materialised at once. ``None`` picks the largest chunk whose float32 logits stay
            under 256 MB, so long lengths and large vocabularies fit in memory.

    Returns:
        float64 ``[N, L]`` on the CPU (the float32 losses, widened).
    """
    _check_sequences(sequences, batch_size)
    return score_rows(model, sequences[:, :-1], sequences[:, 1:], batch_size, torch.device(device),
                       autocast_dtype, vocab_chunk)


def per_position_loss(model: nn.Module, sequences: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """Mean next-token cross-entropy at each position: :func:`per_sequence_loss` (same
    arguments) averaged over the ``N`` sequences in float64; returns ``[L]`` on the CPU."""
    return per_sequence_loss(model, sequences, *args, **kwargs).mean(dim=0)


def sliding_windows(length: int, context: int, stride: int) -> tuple[Tensor, Tensor, Tensor]:
    """How the targets at positions ``context .. length - 1`` are cut into windows.

    Window ``j`` is the ``context`` inputs ending at ``end_j`` (``end_j = context + (j+1) *
    stride``, the last one ``length``) and scores its last ``stride`` positions; in the last
    window only positions no earlier window scored count (``fresh``). Every target ``t >= C`` is
    scored exactly once, seeing ``C - stride + 1 .. C`` inputs (the current one included).

    Returns ``(inputs, scored, fresh)``: input positions ``(W, C)``, scored target positions
    ``(W, S)`` and a bool mask ``(W, S)`` of those that count.
    """
    if not 0 < context < length:
        raise PosbenchError(f"sliding windows need 0 < context < length, got context={context}, length={length}")
    stride = min(stride, context)
    ends = torch.tensor(list(range(context + stride, length, stride)) + [length])  # (W,)
    previous_ends = torch.cat([torch.tensor([context]), ends[:-1]])  # first position a window may score
    inputs = (ends - context)[:, None] + torch.arange(context)  # (W, C)
    scored = (ends - stride)[:, None] + torch.arange(stride)  # (W, S)
    return inputs, scored, scored >= previous_ends[:, None]


def windowed_loss(
    model: nn.Module,
    sequences: Tensor,
    context: int,
    stride: int,
    batch_size: int,
    device: str | torch.device,
    autocast_dtype: torch.dtype | None = None,
    vocab_chunk: int | None = None,
) -> Tensor:
    """Loss of every target past the training context with the context truncated to ``context``.

    The same targets as :func:`per_sequence_loss` at positions ``C .. L-1``, each predicted by a
    window of the last ``C`` tokens (at most), see :func:`sliding_windows`: the ALiBi paper's
    sliding evaluation restricted to the training context. Windows of all sequences are batched
    together, ``batch_size * L // C`` windows per forward (the tokens of ``batch_size`` full
    sequences), and only each window's scored positions reach the LM head.

    Returns float64 ``[N, L - C]`` on the CPU; column ``i`` is position ``C + i``.
    """
    _check_sequences(sequences, batch_size)
    n, length = sequences.shape[0], sequences.shape[1] - 1
    positions, scored, fresh = sliding_windows(length, context, stride)
    x, y = sequences[:, :-1], sequences[:, 1:]
    window_inputs = x[:, positions].reshape(-1, positions.shape[1])  # (N * W, C)
    window_targets = y[:, scored].reshape(-1, scored.shape[1])  # (N * W, S)
    losses = score_rows(model, window_inputs, window_targets, max(1, batch_size * length // context),
                         torch.device(device), autocast_dtype, vocab_chunk).view(n, *scored.shape)  # (N, W, S)
    out = torch.empty(n, length - context, dtype=torch.float64)
    out[:, scored[fresh] - context] = losses[:, fresh]
    return out


def sequences_fingerprint(sequences: Tensor) -> str:
    """SHA-256 of the evaluated token ids: equal fingerprints = the same windows (pairable)."""
    return hashlib.sha256(sequences.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise PosbenchError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def evaluate_model(model: nn.Module, tokens: np.ndarray, evaluation: EvalConfig, train_context: int,
                   device: str | torch.device, log: Callable[[str], Any] = print,
                   autocast_dtype: torch.dtype | None = None,
                   effective_length_window: int = EFFECTIVE_LENGTH_WINDOW) -> list[LossEntry]:
    """Evaluate ``model`` on ``tokens`` (the ``evaluation.split`` text) at every length of
    ``evaluation`` (its ``lengths``, ``num_sequences``, ``batch_size``, ``window_stride``,
    ``effective_length_eps``, ``extension`` (resolved names), ``extension_factor`` and the
    extensions' settings); returns results.json ``eval`` entries.

    Every (length, extension) pair (see :mod:`posbench.model.extension`; ``none`` = the plain
    model) is its own entry, with ``extension`` and ``extension_factor`` (the factor used, None
    for ``none``) keys, and ``extension_options`` for an extension with settings of its own
    (rerope, self_extend).

    For each length ``L`` (sorted, deduplicated) the first ``num_sequences`` non-overlapping
    windows of ``L + 1`` tokens of ``tokens`` are scored (deterministic: same tokens, same
    windows). When fewer windows fit, all that fit are used and a line is logged; when not even
    one fits, :class:`PosbenchError` is raised. Lengths below ``2 * train_context`` are allowed
    but lack the headline band.

    Each entry holds ``split, length, num_sequences, sequences_sha256``, the full-context
    :func:`curve_summary` (``loss_by_position, bands, sequence_bands, cumulative_perplexity,
    perplexity_ratio``), ``tokens_per_second, seconds`` and ``effective_length``. For ``L > C``
    it also holds ``windowed`` (the same summary for :func:`windowed_loss` with stride
    ``window_stride``, plus ``stride`` and ``seconds``) and ``cost`` (full minus windowed:
    ``loss_by_position``, ``bands``, ``sequence_bands``; positive when the long context hurts).
    """
    lengths = sorted({_positive_int("eval length", L) for L in evaluation.lengths})
    if not lengths:
        raise PosbenchError("no eval lengths given; set eval.lengths=[512]")
    num_sequences = _positive_int("eval num_sequences", evaluation.num_sequences)
    batch_size = _positive_int("eval batch_size", evaluation.batch_size)
    train_context = _positive_int("train_context", train_context)
    window_stride = _positive_int("eval window_stride", evaluation.window_stride)
    split, extension_factor = evaluation.split, evaluation.extension_factor
    extension_settings = evaluation.extension_options()
    if window_stride > train_context:
        log(f"eval.window_stride={window_stride} is above the training context {train_context}; "
            f"using {train_context} (non-overlapping windows)")
        window_stride = train_context
    entries = []
    for length in lengths:
        sequences = eval_sequences(tokens, length, num_sequences, split=split)
        count = int(sequences.shape[0])
        if count < num_sequences:
            log(
                f"eval {split} length {length}: only {count} of {num_sequences} requested windows of "
                f"{length + 1} tokens fit in the {len(tokens)} {split} tokens; using {count} "
                f"(more text: data.valid_fraction or data.path; or ask for eval.num_sequences={count})"
            )
        if length < 2 * train_context:
            log(f"eval {split} length {length} < 2 x train context {train_context}: no extrapolation band")
        # The like-for-like reference: the plain model reading at most C tokens. It is the same
        # for every extension (an extension changes how the model reads long contexts, not the
        # in-context truth it is compared with), so it runs once per length.
        windowed = window_seconds = None
        if length > train_context:
            started = time.perf_counter()
            past = windowed_loss(model, sequences, train_context, window_stride, batch_size, device,
                                 autocast_dtype=autocast_dtype).numpy()
            window_seconds = time.perf_counter() - started
            windowed = past  # (N, L - C); targets inside the context are prepended per extension below
        plain_inside = None  # (N, C): the plain model's losses inside the context, from the none pass
        for extension in evaluation_order(evaluation.extension):  # none first: it is the reference
            started = time.perf_counter()
            with extended(model, extension, train_context, length, extension_factor, extension_settings) as factor:
                full = per_sequence_loss(model, sequences, batch_size, device, autocast_dtype=autocast_dtype).numpy()
            seconds = time.perf_counter() - started
            if extension == NONE:
                plain_inside = full[:, :train_context]
            entry = _entry(full, windowed, plain_inside, split=split, length=length, count=count, train_context=train_context,
                           sequences=sequences, seconds=seconds, window_stride=window_stride,
                           window_seconds=window_seconds, eps=evaluation.effective_length_eps,
                           smooth=effective_length_window)
            record_extension(entry, extension, factor, train_context, length, extension_settings)
            entries.append(entry)
            label = "" if extension == NONE else f" {extension}" + ("" if factor is None else f" (factor {factor:g})")
            shown = ", ".join(f"{k}: {v:.4f}" for k, v in entry["bands"].items())
            if "cost" in entry:
                shown += "; cost " + ", ".join(f"{k}: {v:+.4f}" for k, v in entry["cost"]["bands"].items()
                                               if not k.startswith("0-"))
            timing = f"{seconds:.1f}s" + ("" if window_seconds is None or extension != NONE
                                          else f" + windowed {window_seconds:.1f}s")
            log(f"eval {split} length {length}{label} ({count} seqs, {timing}): {shown}")
    return entries


def _entry(full: np.ndarray, past: np.ndarray | None, plain_inside: np.ndarray, *, split: str, length: int, count: int, train_context: int,
           sequences: Tensor, seconds: float, window_stride: int, window_seconds: float | None, eps: float,
           smooth: int) -> LossEntry:
    """One results.json ``eval`` entry from the full-context losses ``full`` (N, L) and the
    windowed losses of the targets past the context ``past`` (N, L - C), or None when L <= C.

    The windowed curve is the plain model's, also inside the context (``plain_inside``, (N, C)):
    for a context extension, ``cost`` then includes what the extension costs inside C too."""
    summary = curve_summary(full, train_context)
    entry: LossEntry = {
        "split": split,
        "length": length,
        "num_sequences": count,
        "sequences_sha256": sequences_fingerprint(sequences),
        **summary,
        "tokens_per_second": count * length / max(seconds, 1e-9),
        "seconds": seconds,
    }
    inner = summary["bands"].get(f"0-{train_context}")
    entry["effective_length"] = {
        "eps": eps,
        "window": smooth,
        "in_context": None if inner is None else effective_length(full.mean(axis=0), inner, train_context, eps, smooth),
        "windowed": None,
    }
    if past is not None:
        # Targets inside the training context already see at most C tokens: the plain scores.
        windowed = np.concatenate([plain_inside, past], axis=1)  # (N, L)
        entry["windowed"] = {"stride": window_stride, "seconds": window_seconds, **curve_summary(windowed, train_context)}
        cost = full - windowed  # (N, L), zero inside the context for the plain model
        entry["cost"] = {"loss_by_position": cost.mean(axis=0).tolist(),
                         "bands": band_means(cost.mean(axis=0), train_context),
                         "sequence_bands": sequence_band_means(cost, train_context)}
        entry["effective_length"]["windowed"] = effective_length(full.mean(axis=0), windowed.mean(axis=0),
                                                                 train_context, eps, smooth)
    return entry


# ----------------------------------------------------------------------------- a run's evaluation


def evaluate_run(model: nn.Module, prepared: Any, spec: Any, device: torch.device,
                 amp_dtype: torch.dtype | None, log: Callable[[str], None]) -> EvaluatedRun:
    """A run's final evaluation (``spec``: its :class:`posbench.runs.spec.RunSpec`) as results.json's
    top part: schema, method, seed, training context and the eval entries."""
    e = spec.eval
    tokens = prepared.tokens(e.split)
    entries = evaluate_model(model, tokens, e, spec.trainer.context, device, log=log, autocast_dtype=amp_dtype)
    return build_results(kind=spec.kind, method=spec.method, seed=spec.seed, train_context=spec.trainer.context,
                         eval=entries)


def headline(results: EvaluatedRun, band: str = "256-512") -> float:
    """The plain model's loss in ``band`` (nan when not evaluated)."""
    for entry in headline_entries(results.get("eval", [])):
        if band in entry.get("bands", {}):
            return float(entry["bands"][band])
    return float("nan")


def validation_sets(prepared: Any, model: nn.Module, t: Any,
                    log: Callable[[str], None]) -> dict[str, Tensor]:
    """Fixed validation windows, by metrics.jsonl key: ``val_loss`` (``trainer.val_sequences``
    windows of the training context C) and ``val_loss_<C>_<2C>`` (the C-2C band of
    ``trainer.val_extrapolation_sequences`` windows of 2C: extrapolation during training).

    Each is a seeded subset spread over the whole validation text (``spread_sequences``): the
    same windows for every method and seed of a data setting, an estimate of the full set's
    mean (not the first windows, which read easier). The final evaluation uses its own windows."""
    valid, context = prepared.valid_tokens(), t.context
    sets = {"val_loss": spread_sequences(valid, context, t.val_sequences)}
    key = f"val_loss_{context}_{2 * context}"
    limit = model.position.max_positions
    if t.val_extrapolation_sequences and limit is not None and 2 * context > limit:
        log(f"note: no {key} during training: the method's positions stop at {limit} "
            f"(raise method.max_positions to {2 * context})")
    elif t.val_extrapolation_sequences:
        try:
            sets[key] = spread_sequences(valid, 2 * context, t.val_extrapolation_sequences)
        except PosbenchError as err:
            log(f"note: no {key} during training: {err}")
    return sets
