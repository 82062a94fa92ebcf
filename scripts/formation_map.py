"""The formation map: when does copying form, by method, seed and setting?

    python scripts/formation_map.py run --grid docs/retrieval/formation/grid.json --out docs/retrieval/formation [--shard 0/2]
    python scripts/formation_map.py report --grid docs/retrieval/formation/grid.json --out docs/retrieval/formation

``run`` trains ``scripts/induction_budget.py`` once per (setting, method, seed) of the grid file and
appends each finished run to ``<out>/runs.jsonl`` as one line (its settings, reports, the step and
seconds at which it formed, the held-out copy loss by distance). A run already in the file is
skipped, so an interrupted map goes on where it stopped; ``--shard i/n`` takes every n-th run, for n
processes side by side. ``report`` writes ``<out>/map.md`` (one row per setting and method: the
step at which each seed formed, and whether the formed model copies a short span at every
distance) and ``<out>/formation.png`` (copy loss against step, one panel per setting).

The grid file is data: ``{"common": [args...], "methods": [...], "seeds": [...],
"settings": [{"name": ..., "args": [...], "methods": [...]?, "seeds": [...]?, "note": ...}]}``;
a setting's args follow the common ones, so they override them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

from posbench.core.errors import PosbenchError

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("induction_budget", HERE / "induction_budget.py")
induction_budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(induction_budget)

COPIES_AT_EVERY_DISTANCE = 0.5  # nats: a held-out copy loss below this in every distance band


def load_grid(path: Path) -> dict:
    try:
        grid = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PosbenchError(f"--grid {path}: cannot read a JSON grid ({err}); see the docstring's format") from None
    names = [s["name"] for s in grid["settings"]]
    if len(set(names)) != len(names):
        raise PosbenchError(f"--grid {path}: setting names must be unique, got {names}")
    return grid


def jobs(grid: dict) -> list[tuple[str, str, int, list[str]]]:
    """Every (setting, method, seed, argv) of the grid, in a fixed order."""
    out = []
    for s in grid["settings"]:
        for seed in s.get("seeds", grid["seeds"]):
            for method in s.get("methods", grid["methods"]):
                argv = [*grid["common"], *s["args"], "--method", method, "--seed", str(seed)]
                out.append((s["name"], method, seed, argv))
    return out


def read_runs(path: Path) -> dict[tuple[str, str, int], dict]:
    """The finished runs by (setting, method, seed); a torn last line (a killed process) is ignored."""
    runs = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            runs[(r["setting"], r["method"], r["seed"])] = r
    return runs


def run_map(grid: dict, out: Path, shard: tuple[int, int]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.jsonl"
    todo = [j for i, j in enumerate(jobs(grid)) if i % shard[1] == shard[0]]
    for name, method, seed, argv in todo:
        if (name, method, seed) in read_runs(path):
            continue
        args = induction_budget.parse(argv)
        print(f"== {name}: {induction_budget.setting(args)}", flush=True)
        result = induction_budget.run(args, report=lambda line: print("   " + line, flush=True))
        record = {"setting": name, "method": method, "seed": seed, "argv": argv,
                  "context": args.context, "span": args.span, "pool": args.pool, **result}
        torn = path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
        with path.open("a") as f:  # one whole line per run, never glued to a torn one
            f.write(("\n" if torn else "") + json.dumps(record) + "\n")


def copies_everywhere(r: dict) -> bool:
    return all(b["copy"] < COPIES_AT_EVERY_DISTANCE for b in r["by_distance"])


def cell(rs: list[dict]) -> str:
    """``500, 600, -`` (formed step per seed, - not formed by the last step) and the median."""
    steps = [r["formed"] for r in rs]
    text = ", ".join("-" if s is None else str(s) for s in steps)
    done = [s for s in steps if s is not None]
    return f"{text} (median {statistics.median(done):.0f})" if len(done) == len(steps) else text


def map_markdown(grid: dict, runs: dict) -> str:
    """map.md: the settings, then one row per setting and method that has runs."""
    lines = ["| setting | method | seeds | formed at step (per seed) | seconds to form | last step | "
             "held-out copy loss by distance band, mean over seeds | copies a span of 8 at every distance |",
             "|---|---|---|---|---|---:|---|---|"]
    for s in grid["settings"]:
        for method in s.get("methods", grid["methods"]):
            rs = [runs[k] for seed in s.get("seeds", grid["seeds"]) if (k := (s["name"], method, seed)) in runs]
            if not rs:
                continue
            bands = [statistics.mean(r["by_distance"][i]["copy"] for r in rs) for i in range(len(rs[0]["by_distance"]))]
            span = " / ".join(f"{b:.2f}" for b in bands)
            ranges = ", ".join(f"{b['d_min']}-{b['d_max']}" for b in rs[0]["by_distance"])
            every = sum(copies_everywhere(r) for r in rs)
            seconds = ", ".join("-" if r["formed_seconds"] is None else f"{r['formed_seconds']:.0f}" for r in rs)
            lines.append(f"| {s['name']} | {method} | {', '.join(str(r['seed']) for r in rs)} | {cell(rs)} | {seconds} | "
                         f"{max(r['history'][-1]['step'] for r in rs)} | {span} (d {ranges}) | {every} of {len(rs)} |")
    notes = "\n".join(f"- **{s['name']}**: `{' '.join(s['args'])}`" + (f" ({s['note']})" if s.get("note") else "")
                      for s in grid["settings"])
    return ("# The formation map (generated by `python scripts/formation_map.py report`)\n\n"
            f"Common settings: `{' '.join(grid['common'])}`; ln(pool) is the copy loss without copying, "
            "and a run *formed* at the first report whose copy loss was below half of it. Seconds are wall "
            "time of one thread per run on whatever machine ran it (upper bounds where it was shared). "
            "A setting without rows has not run yet: `formation_map.py run` goes on from here.\n\n"
            f"{notes}\n\n" + "\n".join(lines) + "\n")


def report(grid: dict, out: Path) -> str:
    if not (out / "runs.jsonl").is_file():
        raise PosbenchError(f"--out {out} holds no runs.jsonl: run the map first (formation_map.py run --out {out})")
    runs = read_runs(out / "runs.jsonl")
    text = map_markdown(grid, runs)
    (out / "map.md").write_text(text)
    figure(grid, runs, out / "formation.png")
    return text


def figure(grid: dict, runs: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in grid["settings"] if any(k[0] == s["name"] for k in runs)]
    cols = min(4, len(settings)) or 1
    rows = (len(settings) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    colours = {m: f"C{i}" for i, m in enumerate(grid["methods"])}
    for ax, s in zip(axes.flat, settings):
        for (name, method, seed), r in sorted(runs.items()):
            if name != s["name"]:
                continue
            steps = [h["step"] for h in r["history"]]
            ax.plot(steps, [h["copy"] / r["no_copy"] for h in r["history"]], color=colours.get(method, "k"),
                    alpha=0.8, label=method if seed == min(s.get("seeds", grid["seeds"])) else None)
        ax.axhline(0.5, color="grey", ls=":", lw=1)
        ax.set_title(s["name"], fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("copy loss / ln(pool)")
        ax.set_ylim(0, 1.1)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(settings):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run", "report"])
    parser.add_argument("--grid", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shard", default="0/1", help="i/n: run every n-th job starting at i")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        i, n = (int(x) for x in args.shard.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        print(f"error: --shard takes i/n with 0 <= i < n, e.g. 0/2; got {args.shard!r}", file=sys.stderr)
        return 2
    try:
        grid = load_grid(args.grid)
        for *_, argv_ in jobs(grid):  # every job's settings are checked before any trains
            induction_budget.parse(argv_)
        if args.command == "run":
            run_map(grid, args.out, (i, n))
        else:
            print(report(grid, args.out), end="")
    except PosbenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
