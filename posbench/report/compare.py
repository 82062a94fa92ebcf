"""Comparison tables across runs: per-group means with 95 % intervals, paired differences.

Groups (:mod:`posbench.report.groups`) hold the runs that differ only by seed; a table never
averages two different experiments into one row.

Every number is taken per run and then summarised with :mod:`posbench.evaluation.stats`: a t-interval across
seeds (>= 2 runs); a group of one seed gets its bootstrap over sequences widened by the
between-seed sd pooled over the groups of the same table that have >= 2 seeds (kind ``1 seed``;
the bootstrap alone when no group has). Differences are paired by seed; a pair with one common
seed gets that seed's difference, marked ``1 seed``, with an interval widened by the between-seed
sd of the paired differences pooled over the pairs of the same table with >= 2 common seeds
(none when no pair has), and never a verdict: one seed orders nothing. Bands come from the run's own
entries (not those `posbench eval` added later), from the shortest evaluated length that holds them
(like the band figure); the scalars of the longest length (cumulative perplexity, effective
length) are named after it.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Sequence

import numpy as np

from posbench.evaluation.stats import (
    ONE_SEED,
    Interval,
    SeedSpread,
    across_runs,
    bootstrap_interval,
    one_seed_interval,
    paired_difference,
    pooled_seed_sd,
)
from posbench.report.groups import Group, group_runs, grouping_notes, run_facets
from posbench.report.listing import method_order
from posbench.runs.entries import headline_entries
from posbench.runs.results_types import CostCurve, CurveSummary, LossEntry
from posbench.runs.run_record import RunRecord

# Also read from here by the plot, probe, task, sweep and viz modules.
__all__ = ["Comparison", "Group", "Pair", "Row", "Value", "band_key", "compare_runs", "group_runs", "grouping_notes",
           "method_order", "paired_csv", "paired_markdown", "paired_rows", "run_facets", "run_values", "splits",
           "summary_csv", "summary_markdown", "summary_rows"]

HEADLINE_SPLIT = "validation"


def splits(runs: Sequence[RunRecord]) -> list[str]:
    """Headline split first (validation when present, else the most common), then the others."""
    from collections import Counter

    counts = Counter(e["split"] for r in runs for e in r.results["eval"])
    if not counts:
        return []
    head = HEADLINE_SPLIT if HEADLINE_SPLIT in counts else counts.most_common(1)[0][0]
    return [head] + sorted(s for s in counts if s != head)


def band_key(band: str) -> tuple[float, float]:
    try:
        a, b = band.split("-")
        return int(a), int(b)
    except ValueError:
        return (math.inf, math.inf)


@dataclass(frozen=True)
class Value:
    """One run's value of a metric, with its per-sequence values (None if not stored) and the
    fingerprint of the windows they were scored on."""

    value: float
    sequences: list[float] | None = None
    windows: str | None = None


def run_values(run: RunRecord, split: str) -> dict[str, Value]:
    """Every table metric of one run on ``split``:

    ``band:<b>`` and ``windowed:<b>`` (loss), ``cost:<b>`` (full minus windowed, bands past C),
    ``ppl_ratio:<b>`` (PPL(b) / PPL(0-C)), each from the shortest length holding the band;
    read from the run's own entries (those ``posbench eval`` added later are left out, see
    :func:`posbench.runs.entries.headline_entries`);
    ``cum_ppl@<L>``, ``effective_length@<L>``, ``effective_length_windowed@<L>`` of the longest
    length ``L``.
    """
    # The run's own entries only: one ``posbench eval`` added at a new length (``added``) never
    # replaces a band of the training-time evaluation (like the headline, see headline_entries).
    own = headline_entries(e for e in run.results["eval"] if e["split"] == split)
    entries = sorted(own, key=lambda e: e["length"])
    values: dict[str, Value] = {}

    def put(name: str, block: LossEntry | CurveSummary | CostCurve | None, band: str, sha: str | None, ratio: bool = False) -> None:
        if name in values or not block:
            return
        table = block.get("perplexity_ratio" if ratio else "bands") or {}
        if table.get(band) is not None:
            sequences = None if ratio else (block.get("sequence_bands") or {}).get(band)
            values[name] = Value(float(table[band]), sequences, sha)

    for entry in entries:
        sha = entry.get("sequences_sha256")
        for band in entry["bands"]:
            put(f"band:{band}", entry, band, sha)
            put(f"ppl_ratio:{band}", entry, band, sha, ratio=True)
            if not band.startswith("0-"):
                put(f"windowed:{band}", entry.get("windowed"), band, sha)
                put(f"cost:{band}", entry.get("cost"), band, sha)
    if entries:
        last = entries[-1]
        length = last["length"]
        if last.get("cumulative_perplexity"):
            values[f"cum_ppl@{length}"] = Value(float(last["cumulative_perplexity"][-1]))
        effective = last.get("effective_length") or {}
        for key, name in (("in_context", "effective_length"), ("windowed", "effective_length_windowed")):
            if effective.get(key) is not None:
                values[f"{name}@{length}"] = Value(float(effective[key]))
    return values


def _metric_key(name: str) -> tuple:
    kind, _, rest = name.partition(":") if ":" in name else name.partition("@")
    order = ["band", "windowed", "cost", "ppl_ratio", "cum_ppl", "effective_length", "effective_length_windowed"]
    return (order.index(kind) if kind in order else len(order), band_key(rest) if "-" in rest else (int(rest or 0), 0))


@dataclass
class Row:
    label: str
    method: str
    seeds: int
    intervals: dict[str, Interval]
    std: dict[str, float | None]
    """Sample standard deviation (n - 1) of each metric across the group's runs (None below 2)."""
    spreads: dict[str, SeedSpread] = field(default_factory=dict)
    """The pooled between-seed sd a one-seed group's ``1 seed`` intervals are widened by, per metric."""


def summary_rows(groups: dict[str, Group], split: str, headline: str) -> tuple[list[str], list[Row]]:
    """(metric names, one row per group): each metric's mean and interval over the group's runs,
    rows sorted by the headline band. A group of one seed gets its bootstrap over sequences
    widened by the between-seed sd pooled over the groups with >= 2 seeds (:func:`one_seed_interval`)."""
    per_group = {label: [run_values(r, split) for r in g.runs] for label, g in groups.items()}
    metrics = sorted({m for runs in per_group.values() for v in runs for m in v}, key=_metric_key)
    spreads = {metric: pooled_seed_sd([v[metric].value for v in runs if metric in v] for runs in per_group.values())
               for metric in metrics}
    rows = []
    for label, runs in per_group.items():
        intervals, std, widened = {}, {}, {}
        for metric in metrics:
            present = [v[metric].value for v in runs if metric in v]
            if not present:
                continue
            first = next(v[metric] for v in runs if metric in v)
            spread = spreads[metric]
            if len(present) == 1 and spread is not None:
                sequences = bootstrap_interval(first.sequences) if first.sequences else None
                intervals[metric] = one_seed_interval(present[0], sequences, spread)
                widened[metric] = spread
            else:  # seeds; or one seed with no group to estimate the seed spread from: sequences only
                intervals[metric] = across_runs(present, first.sequences)
            std[metric] = float(np.std(present, ddof=1)) if len(present) >= 2 else None
        rows.append(Row(label, groups[label].method, len(runs), intervals, std, widened))
    rows.sort(key=lambda r: r.intervals[f"band:{headline}"].mean if f"band:{headline}" in r.intervals else math.inf)
    return metrics, rows


@dataclass
class Pair:
    metric: str
    a: str
    b: str
    difference: Interval
    seeds: list[str] = field(default_factory=list)
    """The seeds both groups have, which the difference is paired over."""
    spread: SeedSpread | None = None
    """With one common seed: the pooled between-seed sd of paired differences its interval is
    widened by (None: no pair of the table has >= 2 common seeds, so no interval)."""


def _pair_spread(seeds_of: dict[tuple[str, str], dict[str, float]]) -> SeedSpread | None:
    """The between-seed sd of paired differences, pooled over the pairs with >= 2 common seeds.
    The pairs share groups, so their degrees of freedom are capped at what the groups hold:
    sum over groups of (n_g - 1) minus (max n_g - 1), i.e. (k - 1)(n - 1) for k groups of n seeds."""
    multi = {pair: diffs for pair, diffs in seeds_of.items() if len(diffs) >= 2}
    seeds_per_group: dict[str, set[str]] = {}
    for (a, b), diffs in multi.items():
        seeds_per_group.setdefault(a, set()).update(diffs)
        seeds_per_group.setdefault(b, set()).update(diffs)
    counts = [len(seeds) for seeds in seeds_per_group.values()]
    cap = sum(n - 1 for n in counts) - (max(counts) - 1) if counts else None
    return pooled_seed_sd((list(diffs.values()) for diffs in multi.values()), max_df=cap)


def paired_rows(groups: dict[str, Group], split: str, metrics: Sequence[str]) -> list[Pair]:
    """A minus B for every pair of groups and each of ``metrics``, paired by seed: a t-interval
    over >= 2 common seeds; with one common seed that seed's difference, its interval (the
    bootstrap over the paired sequences when both scored the same windows) widened by the
    pooled between-seed sd of the metric's other pairs (:func:`_pair_spread`), and no verdict."""
    per_group = {label: {str(r.seed): run_values(r, split) for r in g.runs} for label, g in groups.items()}
    pairs = []
    for metric in metrics:
        values = {label: {s: v[metric] for s, v in runs.items() if metric in v} for label, runs in per_group.items()}
        common = {(a, b): [s for s in values[a] if s in values[b]] for a, b in combinations(per_group, 2)}
        spread = _pair_spread({(a, b): {s: values[a][s].value - values[b][s].value for s in seeds}
                               for (a, b), seeds in common.items()})
        for (a, b), seeds in common.items():
            va, vb = values[a], values[b]
            same_windows = {s for s in seeds if va[s].windows is not None and va[s].windows == vb[s].windows}
            diff = paired_difference({s: v.value for s, v in va.items()}, {s: v.value for s, v in vb.items()},
                                     {s: va[s].sequences for s in same_windows},
                                     {s: vb[s].sequences for s in same_windows}, spread=spread)
            if diff is not None:
                pairs.append(Pair(metric, a, b, diff, seeds, spread if len(seeds) == 1 else None))
    return pairs


# --------------------------------------------------------------------------- rendering


def _cell(interval: Interval | None, digits: int = 4, signed: bool = False) -> str:
    if interval is None:
        return "-"
    text = f"{interval.mean:+.{digits}f}" if signed else f"{interval.mean:.{digits}f}"
    return text if interval.half_width is None else f"{text} ± {interval.half_width:.{digits}f}"


def _how(row: Row) -> str:
    kinds = {i.kind for i in row.intervals.values()}
    if "t" in kinds:
        return f"t, {row.seeds} seeds"
    if ONE_SEED in kinds:
        groups = max(spread.samples for spread in row.spreads.values())
        return f"1 seed: sequences + seed sd of {groups} groups"
    if "bootstrap" in kinds:
        n = max(i.n for i in row.intervals.values() if i.kind == "bootstrap")
        return f"bootstrap, {n} seqs"
    return "none"


def summary_markdown(metrics: Sequence[str], rows: Sequence[Row], split: str, headline: str) -> str:
    """Two markdown tables: loss per band (with the cost past the context), and the scalars."""
    bands = [m.split(":", 1)[1] for m in metrics if m.startswith("band:")]
    costs = [m.split(":", 1)[1] for m in metrics if m.startswith("cost:")]
    scalars = [m for m in metrics if m.startswith(("cum_ppl@", "effective_length"))]
    ratio = f"ppl_ratio:{headline}"
    lines = [
        f"Mean next-token loss (nats) on the `{split}` split, mean ± half-width of the 95 % interval "
        "(t across seeds with >= 2 seeds; with one seed a bootstrap over the evaluated sequences, "
        "widened by the between-seed sd pooled over the groups with >= 2 seeds when there are any: "
        "one seed's interval over sequences alone is several times too narrow). "
        "Band `a-b` = positions a..b-1, from the shortest evaluated length containing it. "
        "**cost** = full-context loss minus the loss of the same targets seen through windows of "
        f"the training context (positive: the long context hurts). Sorted by `{headline}`.",
        "",
        "| method | seeds | interval | " + " | ".join(bands) + " | " + " | ".join(f"cost {b}" for b in costs) + " |",
        "|---|---:|---|" + "---:|" * (len(bands) + len(costs)),
    ]
    for row in rows:
        cells = [_cell(row.intervals.get(f"band:{b}")) for b in bands]
        cells += [_cell(row.intervals.get(f"cost:{b}"), signed=True) for b in costs]
        lines.append(f"| {row.label} | {row.seeds} | {_how(row)} | " + " | ".join(cells) + " |")
    if scalars or any(ratio in r.intervals for r in rows):
        names = {"cum_ppl": "cumulative PPL", "effective_length": "effective length vs 0-C",
                 "effective_length_windowed": "effective length vs windowed"}
        heads = [f"PPL({headline}) / PPL(0-C)"] + [f"{names[m.split('@')[0]]} @{m.split('@')[1]}" for m in scalars]
        lines += ["", "| method | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
        for row in rows:
            cells = [_cell(row.intervals.get(ratio), 3)]
            cells += [_cell(row.intervals.get(m), 1 if m.startswith("effective") else 2) for m in scalars]
            lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
        lines += ["", "Effective length: the first position past the training context where the smoothed "
                  "loss exceeds its 0-C level (or the windowed loss) by more than eps; the evaluated length "
                  "means it never did."]
    return "\n".join(lines) + "\n"


def summary_csv(metrics: Sequence[str], rows: Sequence[Row], groups: dict[str, Group]) -> str:
    """One row per group: ``<metric>_mean``, ``_low``, ``_high``, ``_std`` (across seeds) for
    every metric; band metrics are named by the band alone (``256-512_mean``)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    names = [m.removeprefix("band:").replace(":", "_").replace("@", "_") for m in metrics]
    writer.writerow(["method", "label", "facets", "seeds", "interval"]
                    + [f"{n}_{s}" for n in names for s in ("mean", "low", "high", "std")])
    for row in rows:
        group = groups[row.label]
        cells: list[Any] = [row.method, row.label, json.dumps(group.facets, default=str), row.seeds, _how(row)]
        for metric in metrics:
            interval = row.intervals.get(metric)
            if interval is None:
                cells += ["", "", "", ""]
                continue
            std = row.std.get(metric)
            cells += [repr(interval.mean), "" if interval.low is None else repr(interval.low),
                      "" if interval.high is None else repr(interval.high), "" if std is None else repr(std)]
        writer.writerow(cells)
    return buffer.getvalue()


def _verdict(pair: Pair) -> str:
    d = pair.difference
    if d.kind == ONE_SEED:  # one seed orders nothing, with or without an interval
        return "one seed: no interval" if d.low is None else "none: 1 seed"
    if d.distinguishable is None:
        return "no interval"
    return "yes" if d.distinguishable else "not distinguishable"


def _how_pair(pair: Pair) -> str:
    d = pair.difference
    if d.kind == ONE_SEED:
        seed = f"1 seed (seed {pair.seeds[0]})" if pair.seeds else "1 seed"
        if pair.spread is None:
            return f"{seed}; no pair with 2 seeds to estimate the seed spread from"
        return f"{seed}; seed sd {pair.spread.sd:.4f} of {pair.spread.samples} pairs, df {pair.spread.df}"
    return {"t": f"t, {d.n} seeds paired", "bootstrap": f"bootstrap, {d.n} paired seqs"}.get(d.kind, "one value")


def paired_markdown(pairs: Sequence[Pair]) -> str:
    """A table of differences ``A - B`` with their 95 % interval and, over >= 2 seeds, whether
    it excludes 0; a one-seed difference gets no verdict."""
    lines = [
        "Differences A - B in nats (negative: A is better), 95 % interval of the paired difference "
        "across seeds, paired by seed (t). **not distinguishable** = the interval contains 0. "
        "A pair with one common seed orders nothing: its difference is that seed's, marked "
        "**1 seed**, its interval the bootstrap over the paired sequences widened by the "
        "between-seed sd of the paired differences pooled over the pairs with >= 2 common seeds "
        "(none when no pair has them), and it gets no verdict.",
        "",
        "| metric | A | B | A - B | 95 % interval | paired over | distinguishable |",
        "|---|---|---|---:|---|---|---|",
    ]
    for p in pairs:
        d = p.difference
        shown = "-" if d.low is None else f"[{d.low:+.4f}, {d.high:+.4f}]"
        mean = f"{d.mean:+.4f} (1 seed)" if d.kind == ONE_SEED else f"{d.mean:+.4f}"
        lines.append(f"| {p.metric} | {p.a} | {p.b} | {mean} | {shown} | {_how_pair(p)} | {_verdict(p)} |")
    if not pairs:
        lines.append("| - | - | - | - | - | - | fewer than two groups share a seed |")
    return "\n".join(lines) + "\n"


def paired_csv(pairs: Sequence[Pair]) -> str:
    """One row per pair and metric; ``distinguishable`` is empty for a ``1 seed`` difference
    (no verdict), ``seeds`` the common seeds, ``seed_sd``/``seed_df`` its widening spread."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["metric", "a", "b", "difference", "low", "high", "n", "kind", "distinguishable", "seeds",
                     "seed_sd", "seed_df"])
    for p in pairs:
        d = p.difference
        writer.writerow([p.metric, p.a, p.b, repr(d.mean), "" if d.low is None else repr(d.low),
                         "" if d.high is None else repr(d.high), d.n, d.kind,
                         "" if d.distinguishable is None else str(d.distinguishable).lower(), " ".join(p.seeds),
                         "" if p.spread is None else repr(p.spread.sd), "" if p.spread is None else p.spread.df])
    return buffer.getvalue()


@dataclass
class Comparison:
    """Everything the tables need, computed once for a set of runs."""

    groups: dict[str, Group]
    split: str
    context: int
    headline: str
    metrics: list[str]
    rows: list[Row]
    pairs: list[Pair]

    @property
    def headline_pairs(self) -> list[Pair]:
        return [p for p in self.pairs if p.metric in (f"band:{self.headline}", f"cost:{self.headline}")]


def compare_runs(runs: Sequence[RunRecord]) -> Comparison:
    """Group ``runs``, summarise every metric per group and pair the groups on every band past
    the training context (loss and cost), on the headline split."""
    from collections import Counter

    runs = [r.plain() for r in runs]  # context-extension entries are compared in plot_extension
    groups = group_runs(runs)
    context = Counter(r.train_context for r in runs).most_common(1)[0][0] if runs else 256
    headline = f"{context}-{2 * context}"
    split = (splits(runs) or [HEADLINE_SPLIT])[0]
    metrics, rows = summary_rows(groups, split, headline)
    past = [m for m in metrics if m.startswith(("band:", "cost:")) and not m.split(":", 1)[1].startswith("0-")]
    past.sort(key=lambda m: (band_key(m.split(":", 1)[1]) != band_key(headline), m.startswith("cost:"), _metric_key(m)))
    by_rank = {row.label: groups[row.label] for row in rows}  # pairs read best first: A - B < 0 mostly
    return Comparison(groups, split, context, headline, metrics, rows, paired_rows(by_rank, split, past))
