"""Pictures of what a position method does and of what a trained run learned: ``posbench viz``.

Three sources, one set of figures (every figure marks the training context C):

- ``method=<name>``: the method's own signals, untrained, on a model of shape ``model``;
- ``run=<run dir>``: the trained model's signals plus its attention on held-out text;
- ``run=<sweep dir>``: every run of the sweep in its own sub-folder plus ``overview.<fmt>``.

Figures (each only for methods that have the signal):

- ``position_table``: the input-embedding table, position x dimension (sinusoidal, learned);
- ``position_similarity``: cosine similarity of the input embeddings of every position pair; a
  trained learned table shows noise past C, where rows never got a gradient;
- ``qk_decay``: ``E[q.k] / D`` against distance for q, k with iid entries of mean 1 (RoFormer's
  long-term decay), i.e. ``q = k = 1`` through the method's ``rotate_qk``; one curve per RoPE
  base in ``decay.bases`` and per evaluation-time extension in ``decay.rules`` (any of
  :data:`posbench.model.extension.EXTENSIONS` that applies to the method, at factor span; see
  :func:`decay_rules`);
- ``score_terms``: the score term against distance d = i - j, per head, 0 to span x C, trained
  range and extrapolated range shaded differently. It is the mean over queries i of the term at
  (i, i - d), computed from the method's ``score_term`` on a dense index grid, so any score method
  draws without code here; content-dependent terms (relative, and anything gating on q or on the
  layer input) are averaged over the real queries of a run;
- ``attention_maps_layer<l>``: per-head attention of one held-out window at length_factor x C;
- ``attention_entropy_distance``: attention entropy and mean attended distance against query
  position, mean over heads and windows, one line per layer;
- ``overview`` (sweeps): per method, the loss by position next to the mean attended distance.

Attention weights are recomputed eagerly: while the model runs, :func:`recording_attention`
installs a :func:`posbench.model.attention.attention_hook` that computes ``softmax(q.k / sqrt(D) +
score)`` (or the method's own normaliser in place of the softmax) from the very q, k and score
function the model hands to its backend, one (window, head) at a time, so the memory is one
(T, T) matrix per step even at 4C.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from posbench.core.errors import PosbenchError
from posbench.data.loader import eval_sequences
from posbench.evaluation.stats import moving_average
from posbench.methods import InputTable, ModelDims, PositionMethod, Rotary, build_method
from posbench.methods.base import Normalizer, ScoreFn, ValueTerm
from posbench.model.attention import attention_hook, causal_mask
from posbench.model.extension import EXTENSIONS, Setting, extension_factor
from posbench.report.compare import method_order
from posbench.report.figures import check_formats, colour_of, new_figure, no_data, save
from posbench.runs.load import load_run, run_data
from posbench.runs.results import discover_runs
from posbench.runs.rundir import RunDir
from posbench.runs.spec import MethodSpec, model_config
from posbench.runtime.device import resolve_device
from posbench.train.loggers import upload_figures

logger = logging.getLogger("posbench")
Log = Callable[[str], None]

TRAINED_SHADE = "#d9ead3"  # light green behind 0..C: distances/positions seen in training
EXTRAPOLATED_SHADE = "#f4cccc"  # light red behind C..span x C: never seen in training


# --------------------------------------------------------------------------- numbers (tested)


def attention_entropy(weights: Tensor) -> Tensor:
    """(..., Tq, Tk) attention rows -> (..., Tq) entropy in nats (0 log 0 = 0)."""
    return -(weights * weights.clamp_min(torch.finfo(weights.dtype).tiny).log()).sum(-1)


def _causal_distance(tq: int, tk: int, device: torch.device) -> Tensor:
    """(Tq, Tk) distance i - j between query i and key j, with the query window at the end."""
    offset = tk - tq
    return torch.arange(tq, device=device)[:, None] + offset - torch.arange(tk, device=device)[None, :]


def mean_attended_distance(weights: Tensor) -> Tensor:
    """(..., Tq, Tk) causal attention rows -> (..., Tq) expected distance sum_j p_ij (i - j)."""
    distance = _causal_distance(weights.shape[-2], weights.shape[-1], weights.device).clamp_min(0)
    return (weights * distance.to(weights.dtype)).sum(-1)


def mean_by_distance(term: Tensor) -> Tensor:
    """(..., T, T) term over (query i, key j) -> (..., T): mean over i of term[i, i - d], d = 0..T-1.

    Only the causal half (j <= i) counts; distance d is averaged over the T - d queries that have it.
    """
    T = term.shape[-1]
    distance = _causal_distance(T, T, term.device)
    causal = distance >= 0
    d = distance[causal]  # (n,) flattened causal distances
    values = term.expand(*term.shape[:-2], T, T)[..., causal].float()  # (..., n)
    sums = torch.zeros(*values.shape[:-1], T, device=term.device).index_add_(-1, d, values)
    return sums / torch.bincount(d, minlength=T).to(sums.dtype)


def cosine_similarity_matrix(table: Tensor) -> Tensor:
    """(T, d) embeddings -> (T, T) cosine similarity of every pair of positions."""
    unit = torch.nn.functional.normalize(table.float(), dim=-1)
    return unit @ unit.T


def qk_decay(method: PositionMethod, length: int, head_dim: int, layer: int = 0) -> Tensor:
    """(length,) ``E[q.k] / D`` at distance d for q, k with iid entries of mean 1 (variance
    irrelevant: the mean part is what survives the expectation), through the method's q-k
    transform of ``layer``: query at position d, key at position 0. For RoPE it is
    (2/D) sum_i cos(d theta_i)."""
    positions = torch.arange(length)
    ones = torch.ones(1, 1, length, head_dim)
    q, k = method.rotate_qk(ones, ones, positions, layer)  # (1, 1, T, D)
    return (q[0, 0] @ k[0, 0, 0]).float() / head_dim


def score_curves(fn: ScoreFn, heads: Sequence[int], length: int, device: torch.device | str = "cpu",
                 batch: int = 0) -> Tensor:
    """(len(heads), length) mean over queries of the score term at distance d, for sequence ``batch``.

    The term is evaluated on a (1, H, T, T) index grid exactly as the attention backends do; one
    head at a time keeps the memory at one (T, T) matrix.
    """
    return torch.stack([mean_by_distance(_term_grid(fn, batch, head, length, device)) for head in heads])


def _term_grid(fn: ScoreFn, batch: int, head: int, length: int, device: torch.device | str) -> Tensor:
    """(T, T) score term of one sequence and head, from (1, 1, 1, 1) / (1, 1, T, 1) / (1, 1, 1, T)
    index tensors: the same broadcasting grid the attention backends use."""
    idx = torch.arange(length, device=device)
    b = torch.full((1, 1, 1, 1), batch, device=device)
    h = torch.full((1, 1, 1, 1), head, device=device)
    term = fn(b, h, idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1)).float()
    return term.expand(1, 1, length, length)[0, 0]


def is_content_dependent(method: PositionMethod, dims: ModelDims, length: int = 16) -> bool:
    """True when the method's score term changes with the queries, or cannot be evaluated from
    queries alone (a term gating on the layer input): then it needs a run's real attention."""
    positions = torch.arange(length)
    generator = torch.Generator().manual_seed(0)
    q_random = torch.randn(1, dims.n_heads, length, dims.head_dim, generator=generator)
    heads = list(range(dims.n_heads))
    try:
        with torch.no_grad():
            for layer in range(dims.n_layers):  # a per-layer schedule may gate on content in one layer only
                zero_fn = method.score_term(torch.zeros_like(q_random), positions, layer)
                if zero_fn is None:  # no score term in this layer
                    continue
                zero = score_curves(zero_fn, heads, length)
                rand = score_curves(method.score_term(q_random, positions, layer), heads, length)
                if not torch.allclose(zero, rand):
                    return True
    except (TypeError, ValueError, RuntimeError, IndexError):  # needs k or x (cope, fox)
        return True
    return False


def has_qk_transform(method: PositionMethod) -> bool:
    return type(method).rotate_qk is not PositionMethod.rotate_qk


# --------------------------------------------------------------------------- extension rules


def decay_rules(method: PositionMethod) -> list[str]:
    """The ``decay.rules`` that can be drawn for ``method``: every evaluation-time extension
    that applies to it (:data:`posbench.model.extension.EXTENSIONS`, by capability)."""
    return [name for name, ext in EXTENSIONS.items() if ext.applies(method)]


def _check_rule(name: str) -> None:
    if name not in EXTENSIONS:
        raise PosbenchError(
            f"unknown decay rule {name!r}; choose from the extensions {', '.join(EXTENSIONS)} (decay.rules=[...])"
        )


def decay_rule_method(method: PositionMethod, rule: str, context: int, end: int) -> PositionMethod:
    """``method`` under extension ``rule`` evaluated at length ``end`` (its default factor, L / C),
    or the method itself where the rule is the identity."""
    factor = extension_factor(rule, end, context, None)
    return EXTENSIONS[rule].install(method, Setting(context, end, factor)) or method


# --------------------------------------------------------------------------- attention recording


@dataclass
class LayerStats:
    """What one layer's attention did over the recorded windows (numpy, ready to draw)."""

    entropy: np.ndarray  # (H, T) mean over windows
    distance: np.ndarray  # (H, T) mean attended distance, mean over windows
    score: np.ndarray | None  # (H, T) score term by distance, mean over queries and windows
    maps: np.ndarray | None  # (H, T, T) attention of the first window, for layers drawn


@dataclass
class AttentionRecord:
    layers: list[LayerStats] = field(default_factory=list)


def _layer_attention(q: Tensor, k: Tensor, v: Tensor, score: ScoreFn | None, keep_maps: bool,
                     window: int | None = None, value: ValueTerm | None = None,
                     normalize: Normalizer | None = None) -> tuple[Tensor, LayerStats]:
    """Eager causal attention, one (window, head) at a time, with its statistics. (B, H, T, D of v).

    Same masks (:func:`posbench.model.attention.causal_mask`, the window baseline included), value
    term and normaliser (softmax, or the method's own) as the eager backend, so the recorded
    weights are the ones the model uses.
    """
    B, H, T, D = q.shape
    device = q.device
    causal = causal_mask(T, device, window)  # (T, T)
    out = torch.empty(B, H, T, v.shape[-1], dtype=torch.float32, device=device)  # v's width: pope widens q, k only
    entropy = torch.zeros(H, T, device=device)
    distance = torch.zeros(H, T, device=device)
    score_sum = torch.zeros(H, T, device=device) if score is not None else None
    maps = torch.empty(H, T, T) if keep_maps else None
    for b in range(B):
        for h in range(H):
            logits = (q[b, h].float() @ k[b, h].float().T) * D**-0.5  # (T, T)
            if score is not None:
                term = _term_grid(score, b, h, T, device)  # (T, T)
                logits = logits + term
                score_sum[h] += mean_by_distance(term)
            logits = logits.masked_fill(~causal, float("-inf"))
            weights = logits.softmax(-1) if normalize is None else normalize(logits)  # (T, T)
            out[b, h] = weights @ v[b, h].float()
            if value is not None:  # Shaw et al.'s value-side term: sum_j p_ij table[bucket_ij]
                bucket = _term_grid(value.bucket, b, h, T, device).long()  # (T, T)
                mass = weights.new_zeros(T, value.table.shape[0]).scatter_add(-1, bucket, weights)  # (T, n)
                out[b, h] += mass @ value.table.float()
            entropy[h] += attention_entropy(weights)
            distance[h] += mean_attended_distance(weights)
            if maps is not None and b == 0:
                maps[h] = weights.cpu()
    stats = LayerStats(
        entropy=(entropy / B).cpu().numpy(), distance=(distance / B).cpu().numpy(),
        score=None if score_sum is None else (score_sum / B).cpu().numpy(),
        maps=None if maps is None else maps.numpy(),
    )
    return out.to(v.dtype), stats


@contextlib.contextmanager
def recording_attention(n_layers: int, map_layers: Sequence[int]) -> Iterator[AttentionRecord]:
    """Within the block, every attention call of posbench models is computed eagerly and recorded
    (through :func:`posbench.model.attention.attention_hook`).

    Layers run in order 0..n_layers-1 in each forward; only one forward may run inside the block.
    """
    record = AttentionRecord()

    def attend(q: Tensor, k: Tensor, v: Tensor, score: ScoreFn | None, window: int | None,
               value: ValueTerm | None, normalize: Normalizer | None) -> Tensor:
        layer = len(record.layers)
        if layer >= n_layers:
            raise RuntimeError("recording_attention records one forward pass only")
        y, stats = _layer_attention(q, k, v, score, keep_maps=layer in map_layers, window=window, value=value,
                                    normalize=normalize)
        record.layers.append(stats)
        return y

    with attention_hook(attend):
        yield record


# --------------------------------------------------------------------------- figures


def _mark_context(ax: Any, context: int, axis: str = "x", label: bool = True) -> None:
    kwargs = dict(color="black", linestyle="--", linewidth=1)
    if axis in ("x", "xy"):
        ax.axvline(context, label=f"training context C = {context}" if label else None, **kwargs)
    if axis in ("y", "xy"):
        ax.axhline(context, **kwargs)


def _shade_ranges(ax: Any, context: int, end: int) -> None:
    ax.axvspan(0, context, color=TRAINED_SHADE, alpha=0.6, linewidth=0, label="trained range")
    ax.axvspan(context, end, color=EXTRAPOLATED_SHADE, alpha=0.5, linewidth=0, label="extrapolated")
    _mark_context(ax, context)


def _heads_legend(ax: Any, n_heads: int) -> None:
    ax.legend(fontsize=7, ncol=2 if n_heads > 6 else 1, loc="best")


def _heatmap_figure(values: np.ndarray, context: int, title: str, *, size: tuple[float, float], marks: str,
                    colour_label: str, xlabel: str, ylabel: str, legend_loc: str, **imshow: Any):
    """A diverging-colour heatmap with the training context marked on ``marks`` ("x" or "xy")."""

    fig = new_figure(*size)
    ax = fig.add_subplot()
    image = ax.imshow(values, cmap="RdBu_r", interpolation="nearest", **imshow)
    _mark_context(ax, context, marks)
    fig.colorbar(image, ax=ax, label=colour_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.suptitle(title, fontsize=10)  # over the figure: a long title must not run into the colour bar
    ax.legend(fontsize=8, loc=legend_loc)
    return fig


def position_table_figure(table: np.ndarray, context: int, title: str):
    """(T, d) input-embedding table as a heatmap: position on x, dimension on y."""
    limit = float(np.abs(table).max()) or 1.0
    return _heatmap_figure(table.T, context, title, size=(9.0, 4.5), marks="x",
                           colour_label="value added to the token embedding", xlabel="position",
                           ylabel="dimension", legend_loc="upper right", aspect="auto", origin="lower",
                           vmin=-limit, vmax=limit, extent=(0, table.shape[0], 0, table.shape[1]))


def position_similarity_figure(similarity: np.ndarray, context: int, title: str):
    """(T, T) cosine similarity of position embeddings; the context marked on both axes."""
    n = similarity.shape[0]
    return _heatmap_figure(similarity, context, title, size=(6.5, 5.5), marks="xy",
                           colour_label="cosine similarity", xlabel="position j", ylabel="position i",
                           legend_loc="lower left", vmin=-1, vmax=1, origin="upper", extent=(0, n, n, 0))


def qk_decay_figure(curves: dict[str, np.ndarray], context: int, title: str):

    fig = new_figure(8.0, 4.5)
    ax = fig.add_subplot()
    end = max(len(c) for c in curves.values())
    _shade_ranges(ax, context, end)
    for label, curve in curves.items():
        ax.plot(np.arange(len(curve)), curve, linewidth=1.2, label=label)
    ax.set_xlim(0, end)
    ax.set_xlabel("distance i - j")
    ax.set_ylabel("E[q.k] / D  (q, k iid, mean 1)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def score_terms_figure(per_layer: list[np.ndarray], context: int, title: str):
    """``per_layer``: (H, T) curves per layer; layers whose curves are all equal share a panel."""

    panels: list[tuple[str, np.ndarray]] = []
    if all(np.allclose(c, per_layer[0], equal_nan=True) for c in per_layer[1:]):
        panels.append(("all layers" if len(per_layer) > 1 else "layer 0", per_layer[0]))
    else:
        panels += [(f"layer {i}", c) for i, c in enumerate(per_layer)]
    cols = min(len(panels), 2)
    rows = math.ceil(len(panels) / cols)
    fig = new_figure(6.0 * cols, 3.8 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (name, curves) in zip(axes, panels):
        end = curves.shape[1]
        _shade_ranges(ax, context, end)
        for head, curve in enumerate(curves):
            ax.plot(np.arange(end), curve, linewidth=1.1, label=f"head {head}")
        ax.set_xlim(0, end)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("distance i - j")
        ax.set_ylabel("score term (added to the logit)")
        ax.grid(alpha=0.3)
        _heads_legend(ax, curves.shape[0])
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    return fig


def attention_maps_figure(maps: np.ndarray, context: int, title: str):
    """(H, T, T) attention of one window, one panel per head, log colour scale."""
    from matplotlib.colors import LogNorm


    H, T, _ = maps.shape
    cols = min(H, 4)
    rows = math.ceil(H / cols)
    fig = new_figure(3.4 * cols, 3.4 * rows + 0.5)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    floor = 1e-4
    future = np.triu(np.ones((T, T), dtype=bool), 1)  # keys after the query: masked, drawn white
    image = None
    for head, ax in enumerate(axes[:H]):
        shown = np.where(future, np.nan, np.clip(maps[head], floor, 1.0))
        image = ax.imshow(shown, cmap="magma", norm=LogNorm(floor, 1.0),
                          interpolation="antialiased", extent=(0, T, T, 0))
        _mark_context(ax, context, "xy", label=False)
        ax.set_title(f"head {head}", fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
    for ax in axes[H:]:
        ax.set_visible(False)
    fig.colorbar(image, ax=list(axes[:H]), label="attention weight (log)", shrink=0.8)
    fig.suptitle(f"{title}\ndashed: training context C = {context}", fontsize=10)
    return fig


def _position_axis(ax: Any, context: int, length: int, ylabel: str) -> None:
    _mark_context(ax, context)
    ax.set_xlim(0, length)
    ax.set_xlabel("query position")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def attention_stats_figure(record: AttentionRecord, context: int, title: str):
    """Entropy and mean attended distance against query position, one line per layer."""

    fig = new_figure(12.0, 4.5)
    ax_entropy, ax_distance = fig.subplots(1, 2)
    T = record.layers[0].entropy.shape[1]
    x = np.arange(T)
    window = max(1, T // 64)
    for layer, stats in enumerate(record.layers):
        ax_entropy.plot(x, moving_average(stats.entropy.mean(0), window), label=f"layer {layer}")
        ax_distance.plot(x, moving_average(stats.distance.mean(0), window), label=f"layer {layer}")
    ax_entropy.plot(x, np.log(x + 1), color="grey", linestyle=":", label="uniform over keys: log(i+1)")
    ax_distance.plot(x, x / 2, color="grey", linestyle=":", label="uniform over keys: i/2")
    _position_axis(ax_entropy, context, T, "attention entropy (nats)")
    _position_axis(ax_distance, context, T, "mean attended distance (tokens)")
    ax_entropy.legend(fontsize=8)
    ax_distance.legend(fontsize=8)
    fig.suptitle(f"{title}\nmean over heads and windows, moving average of {window} positions", fontsize=10)
    return fig


# --------------------------------------------------------------------------- what a method/run shows


@dataclass
class VizSettings:
    """The ``posbench viz`` options that shape the figures (see configs/viz.yaml)."""

    context: int = 256
    span: int = 4
    length_factor: int = 2
    num_sequences: int = 4
    map_layers: tuple[int, ...] = (0, -1)
    split: str = "validation"
    bases: tuple[float, ...] = (10000.0, 500000.0)
    rules: tuple[str, ...] = ()
    formats: tuple[str, ...] = ("png",)

    def validate(self) -> VizSettings:
        self.formats = tuple(check_formats(self.formats))
        for name in ("context", "span", "length_factor", "num_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PosbenchError(f"viz {name} must be a positive integer, got {value!r}")
        for rule in self.rules:
            _check_rule(rule)
        return self


def _signal_figures(method: PositionMethod, dims: ModelDims, method_name: str, options: dict[str, Any],
                    s: VizSettings, out: Path, label: str, log: Log, analytic_label: str | None = None) -> list[Path]:
    """Figures of the method's own signals (input table, q-k decay, content-free score terms).

    ``analytic_label`` titles the q-k decay of a method without parameters: computed from its
    definition, it is the same at every step of a run, so a title must not name one."""

    written: list[Path] = []
    end = s.span * s.context
    if method.max_positions is not None:
        end = min(end, method.max_positions)
    positions = torch.arange(end)
    with torch.no_grad():
        table = method.input_embedding(positions)
        if table is not None:
            table = table.float().cpu()
            written += save(position_table_figure(table.numpy(), s.context, f"{label}: input position table"),
                             out, "position_table", s.formats)
            title = f"{label}: cosine similarity of position embeddings"
            if isinstance(method, InputTable) and method.table_note:
                title += f"\n({method.table_note})"
            written += save(position_similarity_figure(cosine_similarity_matrix(table).numpy(), s.context, title),
                             out, "position_similarity", s.formats)
        if has_qk_transform(method):
            trained = any(True for _ in method.parameters())
            title = (f"{label}: long-term decay of q.k" if trained or analytic_label is None else
                     f"{analytic_label}: long-term decay of q.k\n(analytic: from the method's definition, "
                     "the same at every training step)")
            written += save(qk_decay_figure(_decay_curves(method, dims, method_name, options, s, log), s.context, title),
                            out, "qk_decay", s.formats)
        if method.has_score_term:
            if is_content_dependent(method, dims):
                log(f"{label}: the score term depends on the queries; pass run=<a trained run> to draw it")
            else:
                q = torch.zeros(1, dims.n_heads, end, dims.head_dim)
                heads = list(range(dims.n_heads))
                terms = [method.score_term(q, positions, layer) for layer in range(dims.n_layers)]
                per_layer = [np.zeros((len(heads), end)) if fn is None else score_curves(fn, heads, end).numpy()
                             for fn in terms]  # a schedule's layers without a score term: zero
                written += save(score_terms_figure(per_layer, s.context, f"{label}: score term against distance, per head"),
                                 out, "score_terms", s.formats)
    return written


def _decay_curves(method: PositionMethod, dims: ModelDims, method_name: str, options: dict[str, Any],
                  s: VizSettings, log: Log = logger.info) -> dict[str, np.ndarray]:
    end = s.span * s.context
    per_layer = [qk_decay(method, end, dims.head_dim, layer).numpy() for layer in range(dims.n_layers)]
    curves = {f"{method_name} (this model)": per_layer[0]}
    if any(not np.allclose(c, per_layer[0]) for c in per_layer[1:]):  # a per-layer schedule
        curves = {}
        for layer, curve in enumerate(per_layer):
            if not any(np.allclose(curve, seen) for seen in curves.values()):
                curves[f"{method_name} layer {layer} (this model)"] = curve
    # The rotary frequency base, from the capability (a wrapper's `base` option names a method).
    own_base = method.base if isinstance(method, Rotary) else None
    if own_base is not None:
        curves = {f"{method_name} base={own_base:g} (this model)": curves.popitem()[1]}
        for base in s.bases:
            if float(base) != float(own_base):
                variant = build_method(method_name, dims, **{**options, "base": float(base)})
                curves[f"{method_name} base={float(base):g}"] = qk_decay(variant, end, dims.head_dim).numpy()
        for rule in s.rules:
            if rule not in decay_rules(method):
                log(f"decay rule {rule} does not apply to {method_name}; not drawn")
                continue
            variant = decay_rule_method(method, rule, s.context, end)
            curves[f"{rule} (base={own_base:g}, to {end})"] = qk_decay(variant, end, dims.head_dim).numpy()
    return curves


def viz_method(cfg: DictConfig, s: VizSettings, log: Log) -> list[Path]:
    """``posbench viz method=<name>``: the method's signals, untrained."""
    spec = MethodSpec.from_config(cfg.method).in_context(s.context)
    name, options = spec.name, spec.options
    model = model_config(cfg.model)
    dims = model.dims
    torch.manual_seed(0)
    method = spec.build(dims)
    out = Path(cfg.out or Path("viz") / name)
    state = "at its initialisation" if any(True for _ in method.parameters()) else "fixed"
    written = _signal_figures(method, dims, name, options, s, out, f"{name} ({state}, model={model.flavour})", log)
    if not written and not method.has_score_term:
        log(f"{name} has no position signal of its own to draw; pass run=<a trained {name} run> for its attention")
    for path in written:
        log(f"wrote {path}")
    return written


def _held_out_windows(run: Any, length: int, s: VizSettings, log: Log) -> tuple[Tensor, str]:
    """(N, L) held-out inputs and what they are: a text run's windows of its own validation (or
    test) text; a task run's (``task=flipflop``) held-out sequences of its task, which has no text."""
    task_section = run.config.get("task")
    if task_section is not None:
        from posbench.tasks.base import TEST, VALID, make_task

        if s.split not in ("validation", "test"):
            raise PosbenchError(f"attention.split={s.split} is not held out; a task run's held-out sequences are "
                                "attention.split=validation or attention.split=test")
        task = make_task(task_section, int(run.config.trainer.context))
        task.check_length(length)
        inputs, _ = task.sequences(VALID if s.split == "validation" else TEST, length, s.num_sequences).inputs_targets()
        return inputs, f"{len(inputs)} held-out {task.name} sequences ({s.split}) of {length} tokens"
    prepared = run_data(run, log)  # the run's own tokens and tokenizer (checksum verified), as posbench eval
    windows = eval_sequences(prepared.tokens(s.split), length, s.num_sequences, split=s.split)
    return windows[:, :length], f"{len(windows)} held-out windows of {length} tokens"  # (N, L): no target token


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


def viz_run(run_dir: Path, s: VizSettings, out: Path, device: str, log: Log,
            ) -> tuple[list[Path], AttentionRecord, dict[str, Any]]:
    """A trained run's signals and its attention on held-out text at length_factor x C."""
    run = load_run(run_dir, device=device, log=log)
    model, method = run.model, run.model.position
    context = int(run.config.trainer.context)
    s = VizSettings(**{**s.__dict__, "context": context})
    name = method.name
    dims = model.cfg.dims
    options = MethodSpec.from_saved(run.config.method).in_context(context).options
    suffix = "" if run_dir.name.startswith(name) else f" ({run_dir.name})"
    label = f"{name}, step {run.step}{suffix}"
    # Content-free score terms are drawn from the method at span x C; run-dependent ones come
    # from the recorded attention below.
    written = _signal_figures(method.cpu(), dims, name, options, s, out, label, log=lambda _: None,
                              analytic_label=f"{name}{suffix}")
    model.to(device)
    length = s.length_factor * context
    if method.max_positions is not None and length > method.max_positions:
        raise PosbenchError(f"{name} has positions up to {method.max_positions}; lower attention.length_factor")
    tokens, where = _held_out_windows(run, length, s, log)
    record = record_attention(model, tokens, s.map_layers)
    for layer, stats in enumerate(record.layers):
        if stats.maps is not None:
            written += save(attention_maps_figure(stats.maps, context, f"{label}: attention, layer {layer}, "
                                                   f"first of {where}"), out, f"attention_maps_layer{layer}", s.formats)
    written += save(attention_stats_figure(record, context, f"{label}: attention on {where}"),
                     out, "attention_entropy_distance", s.formats)
    if method.has_score_term and is_content_dependent(method.cpu(), dims):
        per_layer = [stats.score for stats in record.layers]
        title = f"{label}: score term against distance, per head (mean over real queries, {where})"
        written += save(score_terms_figure(per_layer, context, title), out, "score_terms", s.formats)
    for path in written:
        log(f"wrote {path}")
    return written, record, run.results or {}


# --------------------------------------------------------------------------- sweeps


def overview_figure(rows: list[tuple[str, str, dict[str, Any], AttentionRecord]], title: str):
    """Per run: loss by position (left) next to mean attended distance (right), same x axis."""

    fig = new_figure(12.0, 2.6 * len(rows) + 0.6)
    axes = fig.subplots(len(rows), 2, squeeze=False)
    for (name, method, results, record), (ax_loss, ax_dist) in zip(rows, axes):
        context = int(results.get("train_context", 0)) or None
        length = record.layers[0].distance.shape[1]
        entries = sorted((e for e in results.get("eval", []) if e.get("split") == "validation"),
                         key=lambda e: (e["length"] != length, -e["length"]))
        colour = colour_of(method)
        if entries:
            loss = np.asarray(entries[0]["loss_by_position"], dtype=np.float64)
            ax_loss.plot(np.arange(loss.size), moving_average(loss, max(1, loss.size // 64)), color=colour)
        else:
            no_data(fig, ax_loss, "no results.json eval")
        for layer, stats in enumerate(record.layers):
            ax_dist.plot(np.arange(length), moving_average(stats.distance.mean(0), max(1, length // 64)),
                         color=colour, alpha=0.35 + 0.65 * (layer + 1) / len(record.layers), linewidth=1.0,
                         label=f"layer {layer}")
        ax_dist.plot(np.arange(length), np.arange(length) / 2, color="grey", linestyle=":", label="uniform: i/2")
        for ax, ylabel in ((ax_loss, "loss (nats)"), (ax_dist, "mean attended distance")):
            if context:
                _position_axis(ax, context, length, ylabel)
            ax.set_title(f"{method}: {name}", fontsize=9)
        ax_dist.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{title}\nleft: validation loss by position; right: mean attended distance per layer "
                 "(darker = deeper); dashed: C", fontsize=10)
    return fig


def viz_sweep(sweep_dir: Path, s: VizSettings, out: Path, device: str, log: Log) -> list[Path]:
    """Every finished run of a sweep (sub-folder per run) and ``overview.<fmt>``."""
    runs, problems = discover_runs([sweep_dir])
    for path, reason in problems:
        log(f"skipped {path}: {reason}")
    if not runs:
        raise PosbenchError(f"no finished runs under {sweep_dir}; pass run=<a run or sweep directory>")
    order = {m: i for i, m in enumerate(method_order(r.method for r in runs))}
    runs = sorted(runs, key=lambda r: (order[r.method], str(r.path)))
    written: list[Path] = []
    rows = []
    for run in runs:
        try:
            files, record, results = viz_run(run.path, s, out / run.path.name, device, log)
        except PosbenchError as err:  # e.g. a run without checkpoints: the others still draw
            log(f"skipped {run.path}: {err}")
            continue
        written += files
        rows.append((run.name, run.method, results, record))
    if not rows:
        raise PosbenchError(f"no run under {sweep_dir} could be drawn (see the lines above)")
    written += save(overview_figure(rows, f"Sweep {sweep_dir.name}"), out, "overview", s.formats)
    log(f"wrote {written[-1]}")
    return written


def viz_sweep_default(sweep_dir: Path, out: Path, formats: Sequence[str], log: Log) -> list[Path]:
    """The sweep callback's hook: :func:`viz_sweep` with the default settings, on the best device."""
    settings = VizSettings(formats=tuple(formats)).validate()
    return viz_sweep(Path(sweep_dir), settings, Path(out), str(resolve_device("auto")), log)


# --------------------------------------------------------------------------- W&B


def log_to_wandb(run_dir: Path, run_config: DictConfig, paths: Sequence[Path], log: Log) -> bool:
    """Add the figures to the run's W&B run as ``viz/<name>`` (see :func:`posbench.train.loggers.upload_figures`)."""
    return upload_figures(run_dir, run_config.get("logger") or {}, paths, log, prefix="viz")


# --------------------------------------------------------------------------- command


def settings_from_config(cfg: DictConfig) -> VizSettings:
    """The ``posbench viz`` config -> validated settings; a key it lacks keeps the
    :class:`VizSettings` default (the one place defaults live besides viz.yaml, tested equal)."""
    attention = cfg.get("attention") or {}
    decay = cfg.get("decay") or {}
    d = VizSettings()
    return VizSettings(
        context=cfg.get("context", d.context), span=cfg.get("span", d.span),
        length_factor=attention.get("length_factor", d.length_factor),
        num_sequences=attention.get("num_sequences", d.num_sequences),
        map_layers=tuple(attention.get("layers", d.map_layers)), split=str(attention.get("split", d.split)),
        bases=tuple(float(b) for b in decay.get("bases", d.bases)), rules=tuple(decay.get("rules", d.rules)),
        formats=tuple(cfg.get("formats", d.formats)),
    ).validate()


def run_viz(cfg: DictConfig, log: Log = logger.info) -> list[Path]:
    """``posbench viz``: method=<name>, run=<run dir> or run=<sweep dir>."""
    s = settings_from_config(cfg)
    if cfg.get("method") and cfg.get("run"):
        raise PosbenchError("posbench viz takes method=<name> or run=<dir>, not both")
    if cfg.get("method"):
        return viz_method(cfg, s, log)
    if not cfg.get("run"):
        raise PosbenchError("posbench viz needs method=<name> (no training) or run=<run or sweep directory>")
    path = Path(str(cfg.run)).expanduser()
    if not path.is_dir():
        raise PosbenchError(f"{path} is not a directory; pass run=<a run or sweep directory made by posbench train>")
    device = str(resolve_device(str(cfg.get("device", "cpu"))))
    rundir = RunDir(path)
    if rundir.checkpoint_dir.is_dir() or rundir.results_path.is_file():
        out = Path(cfg.out) if cfg.get("out") else rundir.figures_dir / "viz"
        written, _, _ = viz_run(path, s, out, device, log)
        if cfg.get("wandb", True):
            log_to_wandb(path, load_run_config(path), written, log)
        return written
    out = Path(cfg.out) if cfg.get("out") else path / "comparison" / "viz"
    return viz_sweep(path, s, out, device, log)


def load_run_config(run_dir: Path) -> DictConfig:
    """The run's resolved config.yaml (written by posbench train)."""
    config = RunDir(run_dir).config_path
    return OmegaConf.load(config) if config.is_file() else OmegaConf.create({})


__all__ = [
    "attention_entropy",
    "cosine_similarity_matrix",
    "mean_attended_distance",
    "mean_by_distance",
    "qk_decay",
    "decay_rules",
    "record_attention",
    "run_viz",
    "score_curves",
    "viz_sweep",
]
