"""The extension matrix: how each method fares under each context extension (``eval.extension``).

Written by ``posbench plot`` next to the method comparison, only when some run has entries
evaluated under an extension:

- ``extensions.md`` / ``extensions.csv``: one row per (method, extension), the mean over seeds of
  every band (``0-C``, ``C-2C``, ``2C-4C``, ...), each from the shortest evaluated length containing
  it (so with the default factor L / C, band ``C-2C`` is measured at L = 2C, factor 2; ``2C-4C`` at
  L = 4C, factor 4), the change against the plain model (``none``) on the same band, and the
  extrapolation cost of the band when the entries carry one (``cost.bands``).
- ``extension_matrix.<fmt>``: a heatmap per method, extensions x bands, coloured by the change
  against ``none`` (blue = better), annotated with the loss.
- ``extension_curves.<fmt>``: per-position loss of one method (the one with the most extensions)
  under every extension at the longest length an extension was evaluated at, and below it the
  difference to ``none`` (the same windows, so the text's own ups and downs cancel).

Extensions are often evaluated on some seeds only (``posbench eval run=<seed 0> eval.extension=...``).
The change against ``none`` is therefore paired by seed: the mean over the seeds that have both of
(extension - none), the seeds named; never one seed's extension against a mean over other seeds.
A band or curve that some seeds of a group lack is the mean of those that have it, its seeds named.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from posbench.core.io import write_text_atomic
from posbench.evaluation.stats import moving_average as _moving_average
from posbench.model.extension import NONE, list_extensions
from posbench.report.compare import band_key as _band_key
from posbench.report.figures import new_figure, save
from posbench.report.groups import group_runs
from posbench.runs.entries import entry_extension
from posbench.runs.run_record import RunRecord


def _extension_order(names: set[str]) -> list[str]:
    known = [NONE, *list_extensions()]
    return [n for n in known if n in names] + sorted(names - set(known))


def _band_from(run: RunRecord, split: str, extension: str, band: str, cost: bool = False) -> float | None:
    """``band`` (of the loss, or of its extrapolation cost) from the shortest length that has it."""
    entries = sorted((e for e in run.results["eval"] if e["split"] == split and entry_extension(e) == extension),
                     key=lambda e: e["length"])
    for entry in entries:
        bands = (entry.get("cost") or {}).get("bands", {}) if cost else entry["bands"]
        if bands.get(band) is not None:
            return float(bands[band])
    return None


def _std(values: Sequence[float]) -> float | None:
    return float(np.std(values, ddof=1)) if len(values) >= 2 else None


def _seeds(seeds: Sequence[str]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(seeds)


def _stats(by_seed: dict[str, float]) -> dict[str, Any]:
    values = list(by_seed.values())
    return {"mean": float(np.mean(values)), "std": _std(values), "n": len(values), "seeds": list(by_seed)}


def extension_matrix(runs: Sequence[RunRecord], split: str) -> tuple[list[str], list[dict[str, Any]]]:
    """(bands, rows): a row per (group, extension) with band means (and costs) over seeds, each
    with the seeds it is over; a group is runs that differ only by seed
    (:func:`posbench.report.compare.group_runs`), its label the row's ``method`` (``rope``,
    ``rope[steps=60]``). ``change``: the extension minus ``none`` paired by seed, over the seeds
    that have both (absent where none has); ``group_seeds``: the group's seeds."""
    entries = [(r, e) for r in runs for e in r.results["eval"] if e["split"] == split]
    bands = sorted({b for _, e in entries for b in e["bands"]}, key=_band_key)
    rows = []
    for method, group in group_runs(runs).items():
        method_runs = group.runs
        names = {entry_extension(e) for r in method_runs for e in r.results["eval"] if e["split"] == split}
        group_seeds = [str(r.seed) for r in method_runs]
        plain: dict[str, dict[str, float]] = {}
        for extension in _extension_order(names):
            row: dict[str, Any] = {"method": method, "extension": extension, "seeds": 0, "group_seeds": group_seeds,
                                   "loss": {}, "cost": {}, "change": {}}
            for band in bands:
                for kind in ("loss", "cost"):
                    by_seed = {str(r.seed): v for r in method_runs
                               if (v := _band_from(r, split, extension, band, kind == "cost")) is not None}
                    if not by_seed:
                        continue
                    row[kind][band] = _stats(by_seed)
                    row["seeds"] = max(row["seeds"], len(by_seed))
                    if kind == "loss" and extension == NONE:
                        plain[band] = by_seed
                    elif kind == "loss" and (common := [s for s in by_seed if s in plain.get(band, {})]):
                        row["change"][band] = _stats({s: by_seed[s] - plain[band][s] for s in common})
            rows.append(row)
    return bands, rows


def _loss_cell(row: dict[str, Any], band: str) -> str:
    """The band's loss, its seeds named when they are not all of the group's, and for an
    extension the paired change against ``none`` with its seeds."""
    stats = row["loss"].get(band)
    if stats is None:
        return "-"
    text = f"{stats['mean']:.4f}"
    change = row["change"].get(band)
    if change is not None:
        text += f" ({change['mean']:+.3f}, {_seeds(change['seeds'])})"
    if stats["seeds"] != _row_seeds(row) and (change is None or change["seeds"] != stats["seeds"]):
        text += f" [{_seeds(stats['seeds'])}]"
    return text


def _row_seeds(row: dict[str, Any]) -> list[str]:
    """The seeds any band of the row's loss comes from, in the group's order."""
    have = {s for stats in row["loss"].values() for s in stats["seeds"]}
    return [s for s in row["group_seeds"] if s in have]


def _cost_cell(row: dict[str, Any], band: str) -> str:
    stats = row["cost"].get(band)
    if stats is None:
        return "-"
    partial = f" [{_seeds(stats['seeds'])}]" if stats["seeds"] != _row_seeds(row) else ""
    return f"{stats['mean']:+.4f}{partial}"


def _markdown(bands: list[str], rows: list[dict[str, Any]], split: str) -> str:
    has_cost = any(r["cost"] for r in rows)
    head = "| method | extension | seeds | " + " | ".join(bands)
    head += (" | " + " | ".join(f"cost {b}" for b in bands)) if has_cost else ""
    lines = [
        "# Context extension matrix",
        "",
        f"Mean next-token loss (nats) on the `{split}` split per band, mean over seeds; in brackets the "
        f"change against the plain model (`none`), paired by seed over the seeds named (the mean of "
        f"extension - none per seed). In square brackets: the seeds a value is over, where they are not "
        f"all of the method's. Each band comes from the shortest evaluated length "
        f"containing it, so with the default factor L / C the band `C-2C` is measured at factor 2, "
        f"`2C-4C` at factor 4, and so on.",
        "",
        head + " |",
        "|---|---|---:|" + "---:|" * (len(bands) * (2 if has_cost else 1)),
    ]
    for row in rows:
        cells = [_loss_cell(row, band) for band in bands]
        if has_cost:
            cells += [_cost_cell(row, b) for b in bands]
        lines.append(f"| {row['method']} | {row['extension']} | {row['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _csv(bands: list[str], rows: list[dict[str, Any]]) -> str:
    """One row per (method, extension): loss and cost mean/std per band, then per band the seeds
    the loss is over and the paired change against ``none`` with its seeds."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["method", "extension", "seeds"] + [f"{kind}_{b}_{stat}" for kind in ("loss", "cost")
                                                         for b in bands for stat in ("mean", "std")]
                    + [name for b in bands for name in (f"loss_{b}_seeds", f"change_{b}_mean", f"change_{b}_seeds")])
    for row in rows:
        cells: list[Any] = [row["method"], row["extension"], row["seeds"]]
        for kind in ("loss", "cost"):
            for band in bands:
                stats = row[kind].get(band)
                cells += ["", ""] if stats is None else [repr(stats["mean"]),
                                                         "" if stats["std"] is None else repr(stats["std"])]
        for band in bands:
            stats, change = row["loss"].get(band), row["change"].get(band)
            cells += [" ".join(stats["seeds"]) if stats else "", repr(change["mean"]) if change else "",
                      " ".join(change["seeds"]) if change else ""]
        writer.writerow(cells)
    return buffer.getvalue()


def _heatmap(bands: list[str], rows: list[dict[str, Any]], split: str):
    methods = list(dict.fromkeys(r["method"] for r in rows))
    per_method = {m: [r for r in rows if r["method"] == m] for m in methods}
    heights = [max(1.2, 0.45 * len(per_method[m]) + 0.8) for m in methods]
    fig = new_figure(1.6 * len(bands) + 3.5, sum(heights) + 0.8)
    axes = fig.subplots(len(methods), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    deltas = [row["change"][b]["mean"] for row in rows for b in row["change"]]
    limit = max([abs(d) for d in deltas if np.isfinite(d)] + [1e-3])
    image = None
    for ax, method in zip(axes, methods):
        method_rows = per_method[method]
        grid = np.full((len(method_rows), len(bands)), np.nan)
        for i, row in enumerate(method_rows):
            for j, band in enumerate(bands):
                if band in row["change"]:
                    grid[i, j] = row["change"][band]["mean"]
                if band in row["loss"]:
                    stats = row["loss"][band]
                    # a cell over fewer seeds than its group names them (its change is over those)
                    partial = "" if stats["seeds"] == row["group_seeds"] else f"\n{_seeds(stats['seeds'])}"
                    ax.text(j, i, f"{stats['mean']:.3f}{partial}", ha="center", va="center", fontsize=8)
        image = ax.imshow(grid, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
        ax.set_yticks(range(len(method_rows)), [r["extension"] for r in method_rows], fontsize=8)
        ax.set_xticks(range(len(bands)), bands, fontsize=8)
        ax.set_ylabel(method)
    axes[0].set_title(f"Loss per band under each context extension ({split})\n"
                      f"colour: change against none, paired by seed (blue = better); text: loss", fontsize=10)
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="loss - loss(none), paired by seed (nats)", shrink=0.8)
    return fig


def _curves(run_rows: Sequence[RunRecord], method: str, split: str):
    """Per-position loss of ``method`` under every extension at the longest length: the mean over
    the seeds that have it (named in the legend), and below it extension - none paired by seed
    (the seeds that have both)."""
    entries = [(str(r.seed), e) for r in run_rows for e in r.results["eval"] if e["split"] == split]
    # the longest length some extension was evaluated at (a plain entry alone there shows nothing)
    length = max(e["length"] for _, e in entries if entry_extension(e) != NONE)
    context = run_rows[0].train_context
    fig = new_figure(9.0, 7.5)
    ax, diff_ax = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    window = max(1, length // 64)
    x = np.arange(length)
    by_seed: dict[str, dict[str, np.ndarray]] = {}  # extension -> seed -> (length,)
    for extension in _extension_order({entry_extension(e) for _, e in entries}):
        curves = {seed: np.asarray(e["loss_by_position"], dtype=np.float64) for seed, e in entries
                  if e["length"] == length and entry_extension(e) == extension}
        if curves:
            by_seed[extension] = curves
    top, means, shown = [], [], set()
    plain = by_seed.get(NONE, {})
    for extension, curves in by_seed.items():
        mean = _moving_average(np.mean(list(curves.values()), axis=0), window)
        style = {"color": "black", "linewidth": 2.0} if extension == NONE else {"linewidth": 1.3}
        line, = ax.plot(x, mean, label=f"{extension} ({_seeds(list(curves))})", **style)
        means.append(mean)
        shown.update(curves)
        top.append(float(np.nanpercentile(mean[: min(context, length)], 95)))
        common = [s for s in curves if s in plain]
        if extension != NONE and common:  # the same windows: free of the text's own ups and downs
            diff = np.mean([curves[s] - plain[s] for s in common], axis=0)
            diff_ax.plot(x, _moving_average(diff, 4 * window), label=f"{extension} ({_seeds(common)})",
                         color=line.get_color(), linewidth=1.3)
    lo = min(float(np.nanmin(m)) for m in means)
    # As the method comparison: a little above the in-context loss, so one blow-up does not
    # flatten the others.
    hi = lo + 1.5 * (max(top) - lo) if top and max(top) > lo else None
    if hi is not None:
        ax.set_ylim(lo - 0.03 * (hi - lo), hi)
    diff_ax.axhline(0.0, color="black", linewidth=1.0)  # none itself
    for axis in (ax, diff_ax):
        axis.axvline(context, color="grey", linestyle="--", linewidth=1)
        axis.grid(alpha=0.3)
    ax.set_xlim(0, length)
    diff_ax.set_xlabel("position (dashed: training context)")
    ax.set_ylabel("next-token loss (nats)")
    diff_ax.set_ylabel(f"loss - loss(none), paired by seed\n(moving average of {4 * window})")
    seeds = sorted(shown, key=lambda s: [str(r.seed) for r in run_rows].index(s))
    of = f" of {len(run_rows)}" if len(seeds) < len(run_rows) else ""
    ax.set_title(f"{method} under each context extension ({split}, length {length}, "
                 f"{_seeds(seeds)}{of})\nmoving average of {window} positions; "
                 "legend: the seeds each curve is over", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    if any(not line.get_label().startswith("_") for line in diff_ax.get_lines()):
        diff_ax.legend(fontsize=7, ncol=2)
    return fig


def plot_extensions(runs: Sequence[RunRecord], out: Path, formats: Sequence[str], split: str,
                    log: Callable[[str], Any] = print) -> list[Path]:
    """The extension matrix files in ``out``; nothing when no run was evaluated under an extension."""
    if not any(entry_extension(e) != NONE for r in runs for e in r.results["eval"]):
        return []
    bands, rows = extension_matrix(runs, split)
    files = save(_heatmap(bands, rows, split), out, "extension_matrix", formats)
    counts = {m: sum(r["method"] == m for r in rows) for m in dict.fromkeys(r["method"] for r in rows)}
    shown = max(counts, key=lambda m: counts[m])  # first of the most extended (registry order)
    files += save(_curves(group_runs(runs)[shown].runs, shown, split), out, "extension_curves", formats)
    write_text_atomic(out / "extensions.md", _markdown(bands, rows, split))
    write_text_atomic(out / "extensions.csv", _csv(bands, rows))
    log(f"extension matrix: {len(rows)} (method, extension) rows in {out / 'extensions.md'}")
    return files + [out / "extensions.md", out / "extensions.csv"]


def run_extension_figures(run: RunRecord, out: Path, formats: Sequence[str]) -> list[Path]:
    """One run's own figure of its extension curves (``extension_curves``, as in a comparison),
    once ``posbench eval ... eval.extension=[...]`` has added them; nothing before."""
    split = next((e["split"] for e in run.results["eval"] if entry_extension(e) != NONE), None)
    if split is None:
        return []
    return save(_curves([run], run.method, split), out, "extension_curves", formats)


__all__ = ["extension_matrix", "plot_extensions", "run_extension_figures"]
