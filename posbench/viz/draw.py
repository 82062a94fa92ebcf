"""What one method or one trained run shows: ``posbench viz method=<name>`` and ``run=<run dir>``.

A method's own signals (input position table, long-term decay of q.k, content-free score terms)
are drawn from its definition at span x C; a run adds its attention on held-out windows of
length_factor x C (:mod:`posbench.viz.attention`) and the content-dependent score terms averaged
over its real queries.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import DictConfig

from posbench.core.errors import PosbenchError
from posbench.methods import InputTable, ModelDims, PositionMethod, Rotary, build_method, method_class
from posbench.report.figures import save
from posbench.runs.load import load_run
from posbench.runs.spec import MethodSpec, model_config
from posbench.viz.attention import AttentionRecord, held_out_windows, record_attention
from posbench.viz.figures import (
    attention_maps_figure,
    attention_stats_figure,
    position_similarity_figure,
    position_table_figure,
    qk_decay_figure,
    score_terms_figure,
)
from posbench.viz.measures import (
    cosine_similarity_matrix,
    decay_rule_method,
    decay_rules,
    has_qk_transform,
    is_content_dependent,
    qk_decay,
    score_curves,
)
from posbench.viz.settings import VizSettings

logger = logging.getLogger("posbench")
Log = Callable[[str], None]


def signal_figures(method: PositionMethod, dims: ModelDims, method_name: str, options: dict[str, Any],
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
            written += save(qk_decay_figure(decay_curves(method, dims, method_name, options, s, log), s.context, title),
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


def decay_curves(method: PositionMethod, dims: ModelDims, method_name: str, options: dict[str, Any],
                 s: VizSettings, log: Log = logger.info) -> dict[str, np.ndarray]:
    """The curves of the ``qk_decay`` figure, by label: the method's own (one per distinct layer
    of a per-layer schedule); for a rotary method also each other base of ``decay.bases`` and
    each extension of ``decay.rules`` that applies to it, at span x C."""
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
        for base in s.decay.bases:
            if float(base) != float(own_base):
                variant = build_method(method_name, dims, **{**options, "base": float(base)})
                curves[f"{method_name} base={float(base):g}"] = qk_decay(variant, end, dims.head_dim).numpy()
        for rule in s.decay.rules:
            if rule not in decay_rules(method):
                log(f"decay rule {rule} does not apply to {method_name}; not drawn")
                continue
            variant = decay_rule_method(method, rule, s.context, end)
            curves[f"{rule} (base={own_base:g}, to {end})"] = qk_decay(variant, end, dims.head_dim).numpy()
    return curves


def check_sequence_method(name: str) -> None:
    """One line for a grid method: every picture here reads sequence positions (T,), not cells."""
    if "sequence" not in method_class(name).layouts:
        raise PosbenchError(f"posbench viz draws sequence positions, and method={name} is a grid method "
                            "(docs/grid.md): it has no pictures here")


def viz_method(cfg: DictConfig, s: VizSettings, log: Log) -> list[Path]:
    """``posbench viz method=<name>``: the method's signals, untrained."""
    spec = MethodSpec.from_config(cfg.method).in_context(s.context)
    check_sequence_method(spec.name)
    name, options = spec.name, spec.options
    model = model_config(cfg.model)
    dims = model.dims
    torch.manual_seed(0)
    method = spec.build(dims)
    out = Path(cfg.out or Path("viz") / name)
    state = "at its initialisation" if any(True for _ in method.parameters()) else "fixed"
    written = signal_figures(method, dims, name, options, s, out, f"{name} ({state}, model={model.flavour})", log)
    if not written and not method.has_score_term:
        log(f"{name} has no position signal of its own to draw; pass run=<a trained {name} run> for its attention")
    for path in written:
        log(f"wrote {path}")
    return written


def viz_run(run_dir: Path, s: VizSettings, out: Path, device: str, log: Log,
            ) -> tuple[list[Path], AttentionRecord, dict[str, Any]]:
    """A trained run's signals and its attention on held-out text at length_factor x C."""
    run = load_run(run_dir, device=device, log=log)
    model, method = run.model, run.model.position
    check_sequence_method(method.name)
    context = int(run.config.trainer.context)
    s = s.in_context(context)
    name = method.name
    dims = model.cfg.dims
    options = MethodSpec.from_saved(run.config.method).in_context(context).options
    suffix = "" if run_dir.name.startswith(name) else f" ({run_dir.name})"
    label = f"{name}, step {run.step}{suffix}"
    # Content-free score terms are drawn from the method at span x C; run-dependent ones come
    # from the recorded attention below.
    written = signal_figures(method.cpu(), dims, name, options, s, out, label, log=lambda _: None,
                             analytic_label=f"{name}{suffix}")
    model.to(device)
    length = s.attention.length_factor * context
    if method.max_positions is not None and length > method.max_positions:
        raise PosbenchError(f"{name} has positions up to {method.max_positions}; lower attention.length_factor")
    tokens, where = held_out_windows(run, length, s.attention, log)
    record = record_attention(model, tokens, s.attention.layers)
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


__all__ = ["decay_curves", "viz_method", "viz_run"]
