"""Does the ranking of methods settle as training gets longer? (docs/fidelity.md)

    python scripts/budget_check.py SHORT/bands.csv LONG/bands.csv [--bands 0-256,256-512] [--labels a,b]

Reads two ``bands.csv`` files written by ``posbench plot`` (the same methods trained at two
budgets) and prints, per band, a markdown table: each method's mean and rank at both budgets,
Kendall's tau between the two orders, and every pair whose order flips, with whether the two
intervals at each budget overlap (a flip between overlapping intervals is not a real change of
order). Rows present in only one file are listed and left out of the ranks.
"""

from __future__ import annotations

import argparse
import csv
import itertools
from pathlib import Path

from posbench.commands.cli import run_script
from posbench.core.errors import PosbenchError


def read_bands(path: Path) -> dict[str, dict[str, str]]:
    """label -> row of a bands.csv."""
    with path.open(newline="") as handle:
        return {row["label"]: row for row in csv.DictReader(handle)}


def kendall_tau(first: list[str], second: list[str]) -> float:
    """Kendall's tau-a between two orders of the same items (1 = same order, -1 = reversed)."""
    where = {item: i for i, item in enumerate(second)}
    pairs = list(itertools.combinations(first, 2))
    if not pairs:
        return 1.0
    agree = sum(1 if where[a] < where[b] else -1 for a, b in pairs)
    return agree / len(pairs)


def interval(row: dict[str, str], band: str) -> tuple[float, float, float]:
    try:
        return float(row[f"{band}_mean"]), float(row[f"{band}_low"]), float(row[f"{band}_high"])
    except (KeyError, TypeError, ValueError):
        cells = {k: row.get(f"{band}_{k}") for k in ("mean", "low", "high")}
        raise PosbenchError(f"the {band} interval of {row.get('label')!r} is not three numbers ({cells}); "
                            "give bands.csv files written by posbench plot") from None


def overlap(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    return a[1] <= b[2] and b[1] <= a[2]


def band_report(short: dict, long: dict, band: str, labels: tuple[str, str]) -> list[str]:
    common = [m for m in short if m in long and short[m].get(f"{band}_mean") and long[m].get(f"{band}_mean")]
    order_s = sorted(common, key=lambda m: interval(short[m], band)[0])
    order_l = sorted(common, key=lambda m: interval(long[m], band)[0])
    rank_s = {m: i + 1 for i, m in enumerate(order_s)}
    rank_l = {m: i + 1 for i, m in enumerate(order_l)}
    lines = [f"### band {band}", "",
             f"| method | {labels[0]} | rank | {labels[1]} | rank | change |", "|---|---:|---:|---:|---:|---:|"]
    for m in order_l:
        s, l = interval(short[m], band), interval(long[m], band)
        lines.append(f"| {m} | {s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}] | {rank_s[m]} | "
                     f"{l[0]:.3f} [{l[1]:.3f}, {l[2]:.3f}] | {rank_l[m]} | {l[0] - s[0]:+.3f} |")
    lines += ["", f"Kendall tau between the two orders: **{kendall_tau(order_s, order_l):+.3f}** "
              f"({len(common)} methods)."]
    flips = []
    for a, b in itertools.combinations(common, 2):
        if (rank_s[a] < rank_s[b]) != (rank_l[a] < rank_l[b]):
            first, second = (a, b) if rank_s[a] < rank_s[b] else (b, a)
            separated = [not overlap(interval(d[first], band), interval(d[second], band)) for d in (short, long)]
            flips.append(f"- {first} ahead of {second} at {labels[0]}, behind at {labels[1]}; intervals "
                         f"{'separate' if separated[0] else 'overlap'} at {labels[0]}, "
                         f"{'separate' if separated[1] else 'overlap'} at {labels[1]}")
    lines += ["", f"Pairs whose order flips: {len(flips)}" + (":" if flips else "."), *flips, ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("short", type=Path, help="bands.csv of the shorter budget")
    parser.add_argument("long", type=Path, help="bands.csv of the longer budget")
    parser.add_argument("--bands", default="0-256,256-512", help="comma-separated bands (default: 0-256,256-512)")
    parser.add_argument("--labels", default="short,long", help="names of the two budgets in the tables")
    args = parser.parse_args(argv)
    labels = tuple(args.labels.split(","))
    if len(labels) != 2:
        parser.error("--labels takes two comma-separated names")
    try:
        short, long = read_bands(args.short), read_bands(args.long)
    except (OSError, KeyError, csv.Error, UnicodeDecodeError) as err:
        raise PosbenchError(f"cannot read bands.csv ({err}); give two files written by posbench plot") from None
    only = sorted(set(short) ^ set(long))
    out = []
    for band in args.bands.split(","):
        if not any(f"{band}_mean" in row for row in short.values()):
            raise PosbenchError(f"band {band} is not in {args.short}; name bands it has with --bands")
        out += band_report(short, long, band, labels)  # type: ignore[arg-type]
    if only:
        out.append(f"In one file only (left out): {', '.join(only)}")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    run_script("budget_check", main)
