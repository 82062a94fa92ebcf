"""The copy probe across runs: figures and a table in ``posbench plot``'s output folder.

Written only when some run has results.json ``probes`` entries (``eval.probes=[copy]``):

- ``copy_retrieval_<kind>.<fmt>``: the retrieval gain (matched control - repeat, the headline)
  against distance, one line per group (method, options, model, context; a context extension is
  its own line, ``<label>+<extension>``, dashed; so is another split, ``variant`` or window set,
  see :func:`probe_groups`), left panel the repeat inside the training context, right panel past
  it; error bars = 95 % interval (t across seeds; one seed: the bootstrap over windows); dotted
  vertical line at the training context. Entries without the matched control have no line here.
- ``copy_sensitivity_<kind>.<fmt>``: the same for the sensitivity (control - repeat), every entry.
- ``copy.md`` / ``copy.csv``: one row per line of the figures, by label (no ranking): the reach per
  kind and both numbers at every (region, distance). The reach is recomputed from the retrieval
  gains with today's definition (``posbench.evaluation.probes.copy.entry_reach``); an entry written before the
  matched control existed shows no retrieval gain and no reach, never its sensitivity instead.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from posbench.core.io import write_text_atomic
from posbench.evaluation.probes.copy import NO_MATCHED, REACH_DEFINITION, entry_reach, has_matched
from posbench.evaluation.stats import Interval, across_runs
from posbench.report.compare import group_runs
from posbench.report.figures import legend_outside, new_figure, save
from posbench.runs.run_record import RunRecord

Key = tuple[str, str, int]  # (kind, region, distance)
# What a figure or table column shows: the cell's mean key, its per-window key, the axis label.
MEASURES = {
    "retrieval": ("retrieval_gain", "window_retrieval_gains", "retrieval gain (nats): matched control - repeat"),
    "sensitivity": ("sensitivity", "window_sensitivities", "sensitivity (nats): control - repeat"),
}


def probe_groups(runs: Sequence[RunRecord]) -> dict[str, list[dict[str, Any]]]:
    """``{label: [copy probe entries, one per run]}``: the groups of :func:`posbench.report.compare.group_runs`,
    split by what the entries measured: extension (``label+extension``), split, ``variant``
    (an entry ``posbench eval`` measured otherwise, see :func:`posbench.evaluation.probes.merge.merge_probe_entries`)
    windows (``windows_sha256``) and the matched control (entries written before it existed are a
    line of their own); only entries of one measurement are pooled. What tells a label's lines
    apart is named in brackets (``rope (num_windows=8)``, ``rope (test)``, ``rope (windows=1a2b3c4d)``,
    ``rope (no matched control)``); entries a later one replaced (``variant: replaced``) are left out."""
    keyed: dict[tuple[str, str, str, str, bool, int], list[dict[str, Any]]] = {}
    for label, group in group_runs(runs).items():
        for run in group.runs:
            seen: dict[tuple[str, str, str, str, bool], int] = {}
            for entry in run.results.get("probes") or []:
                if entry.get("probe") != "copy" or entry.get("variant") == "replaced":
                    continue
                extension = str(entry.get("extension", "none"))
                base = label if extension == "none" else f"{label}+{extension}"
                measured = (base, str(entry.get("split")), str(entry.get("variant") or ""),
                            str(entry.get("windows_sha256")), has_matched(entry))
                repeat = seen[measured] = seen.get(measured, 0) + 1  # one entry per run in a line
                keyed.setdefault((*measured, repeat), []).append(entry)
    out: dict[str, list[dict[str, Any]]] = {}
    for key in keyed:
        base, split, variant, windows, matched, repeat = key
        alike = [k for k in keyed if k[0] == base]
        parts = [split] if len({k[1] for k in alike}) > 1 else []
        parts += [variant] if variant else []
        if len({k[3] for k in alike if k[1:3] == key[1:3]}) > 1:  # same split and variant, other windows
            parts.append(f"windows={windows[:8]}")
        if not matched and any(k[4] for k in alike if k[1:4] == key[1:4]):
            parts.append("no matched control")
        parts += [f"#{repeat}"] if repeat > 1 else []
        out[f"{base} ({', '.join(parts)})" if parts else base] = keyed[key]
    return out


def cell_intervals(entries: Sequence[dict[str, Any]], measure: str = "retrieval") -> dict[Key, Interval]:
    """``measure`` (:data:`MEASURES`) per (kind, region, distance) over the runs' entries that hold
    it: t across runs, or the bootstrap over windows of a single run (:func:`posbench.evaluation.stats.across_runs`).
    No retrieval gain from entries without the matched control."""
    mean_key, windows_key, _ = MEASURES[measure]
    per_run: dict[Key, list[float]] = {}
    windows: dict[Key, list[float]] = {}
    for entry in entries:
        if measure == "retrieval" and not has_matched(entry):
            continue
        for c in entry["cells"]:
            key = (c["kind"], c["region"], int(c["distance"]))
            per_run.setdefault(key, []).append(float(c[mean_key]))
            windows[key] = c.get(windows_key) or []
    return {key: across_runs(values, windows[key] if len(values) == 1 else None) for key, values in per_run.items()}


def reaches(entries: Sequence[dict[str, Any]], kind: str) -> list[int]:
    """Each run's reach of ``kind``, recomputed from its cells (:func:`posbench.evaluation.probes.copy.entry_reach`)."""
    return [r for r in (entry_reach(e, kind) for e in entries) if r is not None]


def mean_reach(entries: Sequence[dict[str, Any]], kind: str) -> float | None:
    values = reaches(entries, kind)
    return float(np.mean(values)) if values else None


def _reach_text(entries: Sequence[dict[str, Any]], kind: str) -> str:
    values = reaches(entries, kind)
    if not values:
        return "-"
    mean = float(np.mean(values))
    return f"{mean:g}" if len(set(values)) == 1 else f"{mean:g} ({', '.join(map(str, values))})"


def _gain_text(interval: Interval | None) -> str:
    if interval is None:
        return "-"
    return f"{interval.mean:+.3f}" + ("" if interval.half_width is None else f" ± {interval.half_width:.3f}")


def _sorted_labels(groups: dict[str, list[dict[str, Any]]]) -> list[str]:
    """By label: the table ranks nothing (one seed's order of small gains is no ranking)."""
    return sorted(groups)


def _columns(groups: dict[str, list[dict[str, Any]]], kind: str) -> list[tuple[str, int]]:
    cells = {(c["region"], int(c["distance"])) for es in groups.values() for e in es for c in e["cells"]
             if c["kind"] == kind}
    return sorted(cells, key=lambda rd: (rd[0] != "inside", rd[1]))


def copy_markdown(groups: dict[str, list[dict[str, Any]]]) -> str:
    """The table of ``copy.md``: reach, retrieval gain and sensitivity per group, by label."""
    first = next(iter(groups.values()))[0]
    kinds = list(dict.fromkeys(k for es in groups.values() for e in es for k in e["kinds"]))
    # Settings that differ between lines get a column of their own, never the first line's value.
    settings = {"span": "k", "num_windows": "windows per cell", "train_context": "training context"}
    varying = [name for name in settings if len({e.get(name) for es in groups.values() for e in es}) > 1]
    span = "k - 1" if "span" in varying else f"k - 1 = {first['span'] - 1}"
    windows = "" if "num_windows" in varying else f", {first['num_windows']} windows per cell"
    context = "" if "train_context" in varying else f", training context {first['train_context']}"
    per_line = f" ({', '.join(settings[n] for n in varying)}: per line in the table)" if varying else ""
    lines = ["# Copy probe", "",
             (f"In nats on the {span} tokens of the repeat after its first{windows}{context}{per_line} "
             "(docs/probes.md), paired per window. **Retrieval gain** = loss(matched control) - loss(repeat): "
             "the matched control puts another span, drawn by the same rule, where the repeat has the first "
             "copy, so the two differ only in whether an exact earlier copy exists. **Sensitivity** = "
             "loss(control) - loss(repeat), the control keeping the filler's own text there: how much the "
             "loss moves when the span is put at distance d (copying plus the disturbance of an out-of-place "
             "span; the probe's only number before the matched control). Mean ± 95 % interval: t across "
             "seeds, or the bootstrap over windows for one seed."), "",
             REACH_DEFINITION[:1].upper() + REACH_DEFINITION[1:] + "; per seed in brackets when the seeds differ.", ""]
    labels = _sorted_labels(groups)
    lines += ["| group | runs | " + "".join(f"{settings[n]} | " for n in varying)
              + " | ".join(f"reach ({k})" for k in kinds) + " |",
              "|---|---|" + "---|" * (len(varying) + len(kinds))]
    for label in labels:
        lines.append(f"| {label} | {len(groups[label])} | " + "".join(f"{groups[label][0][n]} | " for n in varying)
                     + " | ".join(_reach_text(groups[label], k) for k in kinds) + " |")
    for measure, title in (("retrieval", "Retrieval gain"), ("sensitivity", "Sensitivity")):
        for kind in kinds:
            columns = _columns(groups, kind)
            lines += ["", f"## {title}, {kind} spans", "",
                      "| group | " + " | ".join(f"{r} d={d}" for r, d in columns) + " |",
                      "|---|" + "---|" * len(columns)]
            for label in labels:
                if measure == "retrieval" and not any(has_matched(e) for e in groups[label]):
                    lines.append(f"| {label} | {NO_MATCHED} |" + " |" * (len(columns) - 1))
                    continue
                intervals = cell_intervals(groups[label], measure)
                lines.append(f"| {label} | " + " | ".join(_gain_text(intervals.get((kind, r, d))) for r, d in columns)
                             + " |")
    return "\n".join(lines) + "\n"


def copy_csv(groups: dict[str, list[dict[str, Any]]]) -> str:
    """One row per (group, kind, region, distance): per measure its mean, interval, interval kind
    and number of runs (empty retrieval columns for entries without the matched control),
    then the windows and the reach."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["group", "kind", "region", "distance"]
               + [f"{m}{suffix}" for m in ("retrieval_gain", "sensitivity")
                  for suffix in ("", "_low", "_high", "_interval", "_runs")] + ["windows", "reach"])
    for label in _sorted_labels(groups):
        entries = groups[label]
        measured = {m: cell_intervals(entries, m) for m in MEASURES}
        for key in sorted(measured["sensitivity"], key=lambda k: (k[0], k[1] != "inside", k[2])):
            row = [label, *key]
            for m in MEASURES:
                iv = measured[m].get(key)
                runs = sum(1 for e in entries if m == "sensitivity" or has_matched(e))
                row += (["", "", "", "", 0] if iv is None else
                        [f"{iv.mean:.6f}", "" if iv.low is None else f"{iv.low:.6f}",
                         "" if iv.high is None else f"{iv.high:.6f}", iv.kind, runs])
            reach = mean_reach(entries, key[0])
            w.writerow(row + [entries[0]["num_windows"], "" if reach is None else reach])
    return buf.getvalue()


def _gain_figure(groups: dict[str, list[dict[str, Any]]], kind: str, measure: str = "retrieval"):
    from matplotlib import colormaps

    # One colour per line of this figure (method variants and extensions share no colour).
    palette = colormaps["tab10" if len(groups) <= 10 else "tab20"]
    colours = {label: palette(i % palette.N) for i, label in enumerate(_sorted_labels(groups))}
    fig = new_figure(13.0 if len(groups) > 10 else 11.5, 4.5)  # the legend sits right of the panels
    axes = fig.subplots(1, 2, sharey=True)
    context = next(iter(groups.values()))[0]["train_context"]
    for ax, region, title in zip(axes, ("inside", "past"), (f"repeat inside the context (t + k <= {context})",
                                                            f"repeat past the context (t >= {context})")):
        ticks: set[int] = set()
        for label in _sorted_labels(groups):
            intervals = cell_intervals(groups[label], measure)
            points = sorted((d, iv) for (k, r, d), iv in intervals.items() if k == kind and r == region)
            if not points:
                continue
            x = np.array([d for d, _ in points], dtype=float)
            y = np.array([iv.mean for _, iv in points])
            low = np.array([iv.mean if iv.low is None else iv.low for _, iv in points])
            high = np.array([iv.mean if iv.high is None else iv.high for _, iv in points])
            extended = "+" in label  # an extension: its own colour, dashed
            ax.errorbar(x, y, yerr=[y - low, high - y], marker="s" if extended else "o", ms=3, capsize=2,
                        color=colours[label], linestyle="--" if extended else "-",
                        label=f"{label} ({len(groups[label])})")
            ticks.update(int(d) for d in x)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.axvline(context, color="grey", linestyle=":", linewidth=1.0)
        ax.set_xscale("log", base=2)
        if ticks:
            ax.set_xticks(sorted(ticks), [str(d) for d in sorted(ticks)], fontsize=8)
            ax.minorticks_off()
        ax.set_xlabel("distance d between the two copies (tokens)")
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel(MEASURES[measure][2])
    legend_outside(axes[1], fontsize=7)
    what = "retrieval gain" if measure == "retrieval" else "sensitivity to a span at distance d"
    fig.suptitle(f"Copy probe, {kind} spans: {what} (error bars: 95 % interval)")
    return fig


def compare_figures(runs: Sequence[RunRecord], out_dir: Path, formats: Sequence[str],
                    log: Callable[[str], Any] = print) -> list[Path]:
    """The copy probe's figure hook (:class:`posbench.evaluation.probes.Probe` ``report``): its figures and
    tables across ``runs`` into ``out_dir``; nothing when no run has one."""
    groups = probe_groups(runs)
    if not groups:
        return []
    shas = {e["windows_sha256"] for es in groups.values() for e in es}
    if len(shas) > 1:
        log(f"note: the copy probe entries were scored on {len(shas)} different window sets "
            "(other eval.copy settings or data); they are shown as separate lines, never pooled")
    files: list[Path] = []
    kinds = list(dict.fromkeys(k for es in groups.values() for e in es for k in e["kinds"]))
    lacking = [label for label, es in groups.items() if not any(has_matched(e) for e in es)]
    if lacking:
        log(f"note: {len(lacking)} copy probe lines have {NO_MATCHED}: no retrieval gain is shown for them "
            "(posbench eval run=<dir> 'eval.probes=[copy]' measures it on the same windows)")
    for kind in kinds:
        files += save(_gain_figure(groups, kind, "retrieval"), out_dir, f"copy_retrieval_{kind}", formats)
        files += save(_gain_figure(groups, kind, "sensitivity"), out_dir, f"copy_sensitivity_{kind}", formats)
    write_text_atomic(out_dir / "copy.md", copy_markdown(groups))
    write_text_atomic(out_dir / "copy.csv", copy_csv(groups))
    return files + [out_dir / "copy.md", out_dir / "copy.csv"]


__all__ = ["MEASURES", "cell_intervals", "compare_figures", "copy_csv", "copy_markdown", "mean_reach", "probe_groups",
           "reaches"]
