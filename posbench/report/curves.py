"""The figures of text runs' curves: training loss, loss by position, the in-training C-2C band,
the band bars; and the position figures of a set of run groups (:func:`position_figures`). How each
figure is drawn is described in :mod:`posbench.report.plot`."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from posbench.evaluation.stats import moving_average, pointwise_t_band
from posbench.report.compare import Row, splits
from posbench.report.figures import LEGEND_ONE_COLUMN, legend_outside, line_styles, new_figure, no_data, save
from posbench.runs.results_types import LossEntry
from posbench.runs.run_record import RunRecord

TRAIN_EMA = 0.8
HEADLINE_SPLIT = "validation"


# --------------------------------------------------------------------------- helpers


def _seeds_note(counts: Sequence[int]) -> str:
    """What a curve of the figure is: one run, or a mean over seeds with its band."""
    if not counts or max(counts) <= 1:
        return "one run per curve"
    if min(counts) > 1:
        return "mean over seeds (band: 95% t-interval)"
    return "mean over seeds where a curve has several (band: 95% t-interval), else one run"


def _ema(values: np.ndarray, weight: float = TRAIN_EMA) -> np.ndarray:
    """Bias-corrected exponential moving average (as TensorBoard's smoothing).

    The weight is lowered for short runs so the time constant 1 / (1 - weight) never exceeds 5%
    of the logged points (no smoothing below 20 points): a few points should not lag visibly.
    """
    weight = min(weight, max(0.0, 1.0 - 20.0 / max(len(values), 1)))
    out, acc, norm = np.empty(len(values)), 0.0, 0.0
    for i, v in enumerate(values):
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out[i] = acc / norm
    return out


# --------------------------------------------------------------------------- data selection


def _entry(run: RunRecord, split: str, length: int) -> LossEntry | None:
    return next((e for e in run.results["eval"] if e["split"] == split and e["length"] == length), None)


def _common_context(runs: Sequence[RunRecord]) -> int:
    return Counter(r.train_context for r in runs).most_common(1)[0][0]


# --------------------------------------------------------------------------- figures


def train_loss_figure(series: Sequence[tuple[str, str, list[dict[str, Any]]]], title: str):
    """``series``: (group label, run name, metrics records) per run."""
    fig = new_figure()
    ax = fig.add_subplot()
    seeds_per_method = Counter(method for method, _, _ in series)
    styles = line_styles([method for method, _, _ in series])
    labelled: set[str] = set()
    floor_candidates, values_all = [], []
    for method, _label, metrics in series:
        train = [(r["tokens"], r["loss"]) for r in metrics if _is_num(r.get("tokens")) and _is_num(r.get("loss"))]
        val = [(r["tokens"], r["val_loss"]) for r in metrics if _is_num(r.get("tokens")) and _is_num(r.get("val_loss"))]
        colour, marker, linestyle = styles[method]["color"], styles[method]["marker"], styles[method]["linestyle"]
        many = seeds_per_method[method] > 1
        if train:
            x, y = np.array(train, dtype=np.float64).T
            smooth = _ema(y)
            ax.plot(x, y, color=colour, alpha=0.15, linewidth=0.6)
            label = None
            if method not in labelled:
                label = f"{method} ({seeds_per_method[method]} seeds)" if many else method
                labelled.add(method)
            ax.plot(x, smooth, color=colour, alpha=0.7 if many else 1.0, linewidth=1.0 if many else 1.6, label=label,
                    marker=marker, markevery=max(1, len(x) // 8), markersize=4, linestyle=linestyle)
            # Everything after the first 10% of logged steps stays visible (late divergence too).
            floor_candidates.append(float(np.nanmax(smooth[len(smooth) // 10 :])))
            values_all.extend(smooth[np.isfinite(smooth)])
        if val:
            vx, vy = np.array(val, dtype=np.float64).T
            ax.plot(vx, vy, "o", color=colour, markersize=3, alpha=0.8)
            values_all.extend(vy[np.isfinite(vy)])
    if not values_all:
        no_data(fig, ax, "no training metrics found (metrics.jsonl)")
        ax.set_title(title)
        return fig
    lo, top = float(np.min(values_all)), float(np.max(values_all))
    cap = max(floor_candidates) if floor_candidates else top
    hi = min(top, lo + 1.1 * (cap - lo)) if cap > lo else top
    margin = 0.03 * max(hi - lo, 1e-6)
    ax.set_ylim(lo - margin, hi + margin)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats)")
    ax.set_title(f"{title}\nEMA {TRAIN_EMA} of logged loss (faint: raw); dots: validation loss", fontsize=10)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return fig


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mean_with_band(ax, x: np.ndarray, arrays: Sequence[np.ndarray], colour: Any, label: str | None,
                    window: int = 1, linestyle: str = "-", marker: str | None = None) -> np.ndarray:
    """Plot the mean of ``arrays`` (one per seed) with its pointwise 95 % t-interval as a band
    (>= 2 seeds), both smoothed by a ``window``-point moving average; returns the smoothed mean."""
    mean, low, high = pointwise_t_band(np.vstack(arrays))
    mean = moving_average(mean, window)
    ax.plot(x, mean, color=colour, linewidth=1.5, linestyle=linestyle, label=label, marker=marker,
            markevery=max(1, len(x) // 10), markersize=4)
    if len(arrays) > 1:
        ax.fill_between(x, moving_average(low, window), moving_average(high, window), color=colour, alpha=0.2,
                        linewidth=0)
    return mean


def _seeds_label(label: str, n: int) -> str:
    return f"{label} ({n} seeds)" if n > 1 else label


def _seed_names(seeds: Sequence[str]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(seeds)


def _partial_label(label: str, seeds: Sequence[str], of: int) -> str:
    """``label`` for a curve over ``seeds`` of a group of ``of`` seeds: the seeds are named when
    they are not all of them (``rope (seed 0 of 2)``), never passed off as the group's mean."""
    return _seeds_label(label, len(seeds)) if len(seeds) >= of else f"{label} ({_seed_names(seeds)} of {of})"


def position_figure(curves: dict[str, list[np.ndarray]], contexts: Sequence[int], length: int, title: str,
                     windowed: dict[str, list[np.ndarray]] | None = None, ylabel: str = "next-token loss (nats)",
                     clip: bool = True, legend: dict[str, str] | None = None, missing: Sequence[str] = ()):
    """``curves``: group label -> per-seed curves of ``length`` positions; ``windowed`` (same
    keys) adds the like-for-like curves, dashed, past the training context. ``legend``: label ->
    legend text (default: the label and its number of seeds); ``missing``: groups without a curve
    at this length, named in the title."""
    fig = new_figure(9.0 if len(curves) < LEGEND_ONE_COLUMN else 13.0, 5.0)  # room for a 2-column legend
    ax = fig.add_subplot()
    window = max(1, length // 64)
    x = np.arange(length)
    context = min(contexts) if contexts else length
    means: dict[str, np.ndarray] = {}
    styles = line_styles(list(curves))
    for label, arrays in curves.items():
        shown = (legend or {}).get(label) or _seeds_label(label, len(arrays))
        means[label] = _mean_with_band(ax, x, arrays, styles[label]["color"], shown, window,
                                       linestyle=styles[label]["linestyle"], marker=styles[label]["marker"])
        if windowed and windowed.get(label):
            past = x >= context
            smooth = moving_average(np.vstack(windowed[label]).mean(axis=0), window)
            ax.plot(x[past], smooth[past], color=styles[label]["color"], linewidth=1.0, linestyle="--")
    for i, c in enumerate(sorted(set(contexts))):
        if c < length:
            ax.axvline(c, color="black", linestyle=":", linewidth=1, label="training context" if i == 0 else None)
    note = ""
    if clip:
        lo, hi, clipped = _y_limits(means, context)
        if hi > lo:
            ax.set_ylim(lo, hi)
        note = f"\ny-axis clipped at {hi:.2f}; above it past the context: {', '.join(clipped)}" if clipped else ""
    dashed = "\ndashed: the same targets through windows of the training context" if windowed else ""
    seeds = _seeds_note([len(arrays) for arrays in curves.values()])
    absent = f"\nno curve at length {length}: {', '.join(missing)}" if missing else ""
    ax.set_title(f"{title}\n{seeds}, moving average of {window} positions{dashed}{note}{absent}", fontsize=9)
    ax.set_xlabel("position")
    ax.set_ylabel(ylabel)
    ax.set_xlim(0, length)
    ax.grid(alpha=0.3)
    legend_outside(ax)
    return fig


def validation_subset(runs: list[RunRecord], key: str) -> str:
    """How many held-out windows the runs' in-training ``key`` was measured on: a seeded subset
    spread over the validation text (see train.validation_sets), not the final evaluation's."""
    counts = sorted({int(n) for r in runs if (n := (r.results["train"].get("validation_windows") or {}).get(key))})
    if not counts:  # runs from before the subset was recorded: their first held-out windows
        return "a validation subset"
    return f"subset of {'/'.join(map(str, counts))} held-out windows"


def training_extrapolation_figure(series: dict[str, list[list[dict[str, Any]]]], key: str, title: str):
    """``series``: group label -> per-seed metrics records; plots ``key`` (``val_loss_<C>_<2C>``)
    against training tokens, mean over seeds at the token counts all of them logged, with a 95 %
    t-interval band. Seed 003's figure: the extrapolation band during training."""
    fig = new_figure()
    ax = fig.add_subplot()
    drawn, counts = False, []
    styles = line_styles(list(series))
    for label, runs in series.items():
        points = [{r["tokens"]: r[key] for r in m if _is_num(r.get("tokens")) and _is_num(r.get(key))} for m in runs]
        points = [p for p in points if p]
        if not points:
            continue
        tokens = sorted(set.intersection(*(set(p) for p in points)))
        if not tokens:  # seeds logged at different token counts: plot each alone
            tokens, points = sorted(points[0]), points[:1]
        arrays = [np.array([p[t] for t in tokens]) for p in points]
        _mean_with_band(ax, np.array(tokens, dtype=np.float64), arrays, styles[label]["color"],
                        _seeds_label(label, len(arrays)), linestyle=styles[label]["linestyle"])
        ax.plot(tokens, np.vstack(arrays).mean(axis=0), styles[label]["marker"] or "o", color=styles[label]["color"],
                markersize=3)
        drawn, counts = True, counts + [len(arrays)]
    if not drawn:
        no_data(fig, ax, f"no {key} in metrics.jsonl")
    else:
        ax.set_xlabel("training tokens")
        ax.set_ylabel("loss (nats)")
        ax.grid(alpha=0.3)
        legend_outside(ax)
    ax.set_title(f"{title}\n{_seeds_note(counts)}", fontsize=10)
    return fig


def _y_limits(means: dict[str, np.ndarray], context: int) -> tuple[float, float, list[str]]:
    """(bottom, top, clipped methods): top = a little above the highest in-context loss."""
    finite = [m[np.isfinite(m)] for m in means.values()]
    finite = [f for f in finite if f.size]
    if not finite:
        return 0.0, 1.0, []
    values = np.concatenate(finite)
    lo, top = float(values.min()), float(values.max())
    in_context = [m[:context][np.isfinite(m[:context])] for m in means.values()]
    refs = [float(np.percentile(v, 95)) for v in in_context if v.size]
    # Clip only real blow-ups: noise of a short run past the context must not trigger it.
    cap = lo + 1.5 * ((max(refs) if refs else top) - lo)
    margin = 0.03 * max(top - lo, 1e-6)
    if top <= cap or cap <= lo:
        return lo - margin, top + margin, []
    # Early positions (little context) sit above the cap for every method; name only the methods
    # that leave the axis past the training context, which is what the reader needs to know.
    clipped = [m for m, v in means.items() if v[context:].size and
               np.nanmax(np.where(np.isfinite(v[context:]), v[context:], np.inf)) > cap]
    return lo - margin, cap, clipped


def band_figure(rows: Sequence[Row], inner: str, headline: str, title: str):
    """Grouped bars of the ``inner`` and ``headline`` bands per row, 95 % error bars. The y-axis
    starts near the lowest bar when starting at 0 would squash the differences (the title says
    where it starts)."""
    fig = new_figure(max(7.0, 1.1 * len(rows) + 2), 4.5)
    ax = fig.add_subplot()
    width = 0.38
    colours = line_styles([row.label for row in rows])
    ends: list[float] = []
    for i, row in enumerate(rows):
        colour = colours[row.label]["color"]
        for offset, band, alpha, hatch in ((-width / 2, inner, 0.45, "//"), (width / 2, headline, 1.0, None)):
            interval = row.intervals.get(f"band:{band}")
            if interval is None:
                continue
            half = interval.half_width
            ax.bar(i + offset, interval.mean, width, color=colour, alpha=alpha, hatch=hatch, edgecolor="black",
                   linewidth=0.5, yerr=half, capsize=3 if half is not None else 0)
            ax.annotate(f"{interval.mean:.3f}", (i + offset, interval.mean + (half or 0)), ha="center",
                        va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
            ends += [interval.mean - (half or 0), interval.mean + (half or 0)]
    ax.set_xticks(range(len(rows)), [f"{r.label}\n(n={r.seeds})" for r in rows], fontsize=8)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(facecolor="lightgrey", hatch="//", edgecolor="black", label=f"{inner} (in context)"),
                        Patch(facecolor="grey", edgecolor="black", label=f"{headline} (extrapolation)")],
               loc="outside lower center", ncols=2, fontsize=8)  # below the bars, never over them
    ax.set_ylabel("mean loss (nats)")
    finite = [e for e in ends if math.isfinite(e)]
    start = ""
    if finite and min(finite) > 0 and max(finite) - min(finite) < 0.5 * max(finite):  # 0 would squash them
        low, high = min(finite), max(finite)
        pad = 0.15 * max(high - low, 0.02 * high)
        ax.set_ylim(low - pad, high + 2 * pad)  # room above for the value labels
        start = f"\ny-axis starts at {low - pad:.2f}, not 0"
    kinds = {i.kind for row in rows for i in row.intervals.values()}
    one_seed = ("bootstrap over sequences widened by the pooled seed sd" if "1 seed" in kinds
                else "bootstrap over sequences, no seed noise")
    ax.set_title(f"{title}\nerror bars: 95% interval (t across seeds; one seed: {one_seed}){start}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return fig


# --------------------------------------------------------------------------- curves of saved runs


@dataclass
class _Curves:
    """Per-seed curves of one (split, length) for the groups that have them."""

    curves: dict[str, list[np.ndarray]]
    contexts: list[int]
    seeds: dict[str, list[str]]
    """label -> the seeds its curves come from."""

    def legend(self, groups: dict[str, list[RunRecord]]) -> dict[str, str]:
        """label -> legend text naming the seeds of a curve that lacks some of its group's."""
        return {label: _partial_label(label, seeds, len(groups[label])) for label, seeds in self.seeds.items()}

    def missing(self, groups: dict[str, list[RunRecord]]) -> list[str]:
        """The groups without any curve, with their number of seeds."""
        return [_seeds_label(label, len(runs)) for label, runs in groups.items() if label not in self.curves]


def _curves(groups: dict[str, list[RunRecord]], split: str, length: int, pick: Callable[[LossEntry], Any]
            ) -> _Curves:
    """label -> per-seed arrays ``pick(entry)`` of the (split, length) entries that have one."""
    found = _Curves({}, [], {})
    for label, runs in groups.items():
        for run in runs:
            entry = _entry(run, split, length)
            values = None if entry is None else pick(entry)
            if values is not None:
                found.curves.setdefault(label, []).append(np.asarray(values, dtype=np.float64))
                found.seeds.setdefault(label, []).append(str(run.seed))
                found.contexts.append(run.train_context)
    return found


def position_figures(groups: dict[str, list[RunRecord]], out_dir: Path, formats: Sequence[str],
                      title_prefix: str = "") -> list[Path]:
    """``loss_by_position[_<split>][_<L>]`` for every length (dashed: windowed), and at the
    longest length ``cost_by_position`` and ``cumulative_perplexity``. A length some seeds of a
    group lack (``posbench eval eval.lengths=[1024]`` on seed 0) draws that group's curve over
    the seeds that have it, named in the legend (``rope (seed 0 of 2)``); groups without it are
    named in the title."""
    runs = [r for rs in groups.values() for r in rs]
    written: list[Path] = []
    if not runs:
        return written
    context = _common_context(runs)

    def figure(found: _Curves, length: int, title: str, **kwargs: Any):
        return position_figure(found.curves, found.contexts, length, title, legend=found.legend(groups),
                               missing=found.missing(groups), **kwargs)

    for split_index, split in enumerate(splits(runs)):
        lengths = sorted({e["length"] for r in runs for e in r.results["eval"] if e["split"] == split})
        headline_length = 2 * context if 2 * context in lengths else lengths[0]
        suffix = "" if split_index == 0 else f"_{split}"
        for length in lengths:
            found = _curves(groups, split, length, lambda e: e["loss_by_position"])
            windowed = _curves(groups, split, length, lambda e: (e.get("windowed") or {}).get("loss_by_position"))
            stem = "loss_by_position" + suffix + ("" if length == headline_length else f"_{length}")
            fig = figure(found, length, f"{title_prefix}Loss by position ({split}, length {length})",
                         windowed=windowed.curves)
            written += save(fig, out_dir, stem, formats)
        longest = lengths[-1]
        cost = _curves(groups, split, longest, lambda e: (e.get("cost") or {}).get("loss_by_position"))
        if cost.curves:
            fig = figure(cost, longest, f"{title_prefix}Extrapolation cost ({split}, length "
                         f"{longest}): full context minus windows of the training context",
                         ylabel="cost (nats; > 0: the long context hurts)", clip=False)
            written += save(fig, out_dir, "cost_by_position" + suffix, formats)
        cumulative = _curves(groups, split, longest, lambda e: e.get("cumulative_perplexity"))
        if cumulative.curves:
            fig = figure(cumulative, longest, f"{title_prefix}Cumulative perplexity P(l) of "
                         f"positions 0..l ({split}, length {longest})", ylabel="perplexity")
            written += save(fig, out_dir, "cumulative_perplexity" + suffix, formats)
    return written


__all__ = ["HEADLINE_SPLIT", "TRAIN_EMA", "band_figure", "position_figure", "position_figures", "train_loss_figure",
           "training_extrapolation_figure", "validation_subset"]
