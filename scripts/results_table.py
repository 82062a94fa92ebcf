"""The README's results table: loss bands, extrapolation cost and copy retrieval gain per method.

    python scripts/results_table.py COMPARISON_DIR [--distances 32,320] [--kind random] [--label GROUP=SHOWN ...]

Reads ``bands.csv`` and ``copy.csv`` of a ``posbench plot`` output (the same runs) and prints a
markdown table, one row per group sorted by the first band past the training context C: seeds, every loss band
of the file (0-C, C-2C, ...), the cost on the bands past C, the effective length at the longest
evaluated length, and the copy probe's retrieval gain of ``--kind`` spans at the
smallest distance inside the context and at ``--distances`` past it (a repeat whose copy lies
past C, docs/probes.md). Every value is ``mean ± half-width`` of its 95 % interval, as the CSVs
hold it (t across seeds; for one seed, bands.csv's bootstrap over sequences widened by the pooled
between-seed sd, copy.csv's bootstrap); ``-`` where a group has no such value (also a copy.csv of
entries without the matched control: they have no retrieval gain).
``--label`` shows a group under another name (e.g. ``rope[model.attention_window=none]=rope``).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from posbench.commands.cli import run_script
from posbench.core.errors import PosbenchError


def read_csv(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as handle:
            return list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise PosbenchError(f"cannot read {path} ({err}); make it again with posbench plot") from None


def shown(mean: str, low: str, high: str, signed: bool = False, digits: int = 3) -> str:
    """``mean ± half-width`` (``-`` when there is no mean; the mean alone without bounds)."""
    if not mean:
        return "-"
    m = float(mean)
    text = f"{m:+.{digits}f}" if signed else f"{m:.{digits}f}"
    if not low or not high:
        return text
    return f"{text} ± {(float(high) - float(low)) / 2:.{digits}f}"


def gains(copy_rows: list[dict[str, str]], kind: str) -> dict[tuple[str, str, int], dict[str, str]]:
    """(group, region, distance) -> its copy.csv row, for spans of ``kind``."""
    return {(r["group"], r["region"], int(r["distance"])): r for r in copy_rows if r["kind"] == kind}


def band_columns(row: dict[str, str]) -> list[str]:
    """The loss bands of a bands.csv (``0-256``, ``256-512``, ...), then their costs, in position order."""
    names = [k[:-len("_mean")] for k in row if k.endswith("_mean")]
    plain = sorted((n for n in names if n[:1].isdigit()), key=lambda n: int(n.split("-")[0]))
    longest = sorted((n for n in names if n.startswith("effective_length_") and n[len("effective_length_"):].isdigit()),
                     key=lambda n: int(n.split("_")[-1]))[-1:]  # at the longest evaluated length
    return plain + [f"cost_{n}" for n in plain if f"cost_{n}" in names] + longest


def table(bands: list[dict[str, str]], copy_rows: list[dict[str, str]], distances: list[int], kind: str,
          labels: dict[str, str] | None = None) -> str:
    columns = band_columns(bands[0]) if bands else []
    headline = next((c for c in columns if not c.startswith(("0-", "cost_"))), None)  # C-2C: the first band past C
    by_cell = gains(copy_rows, kind)
    inside = min((d for (_, region, d) in by_cell if region == "inside"), default=None)
    gain_columns = ([("inside", inside)] if inside is not None else []) + [("past", d) for d in distances]
    head = ["method", "seeds", *(c.replace("_", " ") for c in columns)]
    head += [f"retrieval gain, {region} d={d}" for region, d in gain_columns]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]

    def order(row: dict[str, str]) -> float:
        return float(row[f"{headline}_mean"]) if headline and row.get(f"{headline}_mean") else float("inf")

    for row in sorted(bands, key=order):
        cells = [(labels or {}).get(row["label"], row["label"]), row["seeds"]]
        for band in columns:
            cells.append(shown(row.get(f"{band}_mean", ""), row.get(f"{band}_low", ""), row.get(f"{band}_high", ""),
                               signed=band.startswith("cost"), digits=0 if band.startswith("effective") else 3))
        for region, d in gain_columns:
            g = by_cell.get((row["label"], region, d))
            cells.append("-" if g is None else shown(g.get("retrieval_gain", ""), g.get("retrieval_gain_low", ""),
                                                     g.get("retrieval_gain_high", ""), signed=True))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("comparison", type=Path, help="a posbench plot output with bands.csv and copy.csv")
    parser.add_argument("--distances", default="32,320", help="copy distances past the context, comma-separated")
    parser.add_argument("--kind", default="random", choices=("random", "text"), help="copy probe span kind")
    parser.add_argument("--label", action="append", default=[], metavar="GROUP=SHOWN",
                        help="show GROUP (a bands.csv label) as SHOWN; repeatable")
    args = parser.parse_args(argv)
    missing = [name for name in ("bands.csv", "copy.csv") if not (args.comparison / name).is_file()]
    if missing:
        print(f"results_table: {args.comparison} has no {' or '.join(missing)}; make it with "
              f"posbench plot 'runs=[...]' out={args.comparison} (runs trained with eval.probes=[copy])",
              file=sys.stderr)
        return 2
    try:
        distances = [int(d) for d in args.distances.split(",") if d]
    except ValueError:
        raise PosbenchError(f"--distances {args.distances!r} is not comma-separated integers, e.g. --distances 32,320") from None
    bands = read_csv(args.comparison / "bands.csv")
    if not bands:
        raise PosbenchError(f"{args.comparison / 'bands.csv'} has no rows (no finished run was plotted); "
                            f"plot finished runs: posbench plot 'runs=[...]' out={args.comparison}")
    groups = sorted((row["label"] for row in bands), key=len, reverse=True)  # labels may hold "=" themselves
    labels = {}
    for item in args.label:
        group = next((g for g in groups if item.startswith(g + "=") and len(item) > len(g) + 1), None)
        if group is None:
            print(f"results_table: --label {item!r} is not GROUP=SHOWN with GROUP one of the groups of "
                  f"{args.comparison / 'bands.csv'}: {', '.join(row['label'] for row in bands)}", file=sys.stderr)
            return 2
        labels[group] = item[len(group) + 1:]
    try:
        print(table(bands, read_csv(args.comparison / "copy.csv"), distances, args.kind, labels))
    except (ValueError, KeyError) as err:
        raise PosbenchError(f"{args.comparison} holds a bands.csv or copy.csv that posbench plot did not write "
                            f"({type(err).__name__}: {err}); make them again with posbench plot") from None
    return 0


if __name__ == "__main__":
    run_script("results_table", main)
