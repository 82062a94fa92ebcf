"""Documented tables and paired numbers equal the committed data they come from.

Each test reads a table (or the paired intervals) of README.md or a page of docs/ and the
CSV or markdown that ``posbench plot`` wrote from the committed runs beside it, and checks every
number to its printed precision. A table whose raw results are not committed has no test here:
the matched-control tables of docs/probes.md (and the README's rope seed-0 numbers taken from
them), and the passkey and retrieval tables of docs/retrieval.md, whose runs were not kept.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"[+\-−]?\d+\.\d+"
TRIPLE = re.compile(rf"({NUMBER}) \[({NUMBER}), ({NUMBER})\]")


def number(text: str) -> float:
    return float(text.replace("−", "-"))


def section(path: Path, start: str, end: str) -> str:
    text = path.read_text(encoding="utf-8")
    begin = text.index(start)
    return text[begin:text.index(end, begin)]


def table_rows(text: str) -> dict[str, list[str]]:
    """``| name | a | b |`` rows of a markdown table -> {name: [a, b]} (header and rule left out)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and not set(cells[1]) <= set("-:") and cells[0] != "method":
            rows[cells[0]] = cells[1:]
    return rows


def close(shown: str, value: float, digits: int) -> bool:
    return abs(number(shown) - value) <= 0.5 * 10 ** -digits + 1e-9


def interval_cell(cell: str, row: dict[str, str], key: str, digits: int) -> None:
    """``mean ± h`` (or ``mean``) against the CSV's mean and half its interval's width (a
    bootstrap interval is not symmetric)."""
    mean, _, half = cell.partition(" ± ")
    assert close(mean, float(row[f"{key}_mean"]), digits), (cell, key, row[f"{key}_mean"])
    if half:
        assert close(half, (float(row[f"{key}_high"]) - float(row[f"{key}_low"])) / 2, digits), (cell, key)


def paired_triples(path: Path, columns: tuple[int, ...]) -> list[tuple[float, float, float]]:
    """(mean, low, high) of every paired row of ``path``, from the cells at ``columns`` (a mean
    followed by its ``[low, high]``); both signs, since a text may name the pair either way round."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.split("|")]
        for i in columns:
            if len(cells) > i + 1 and (m := re.fullmatch(rf"\[({NUMBER}), ({NUMBER})\]", cells[i + 1])):
                mean, low, high = float(cells[i].split(" ")[0]), number(m[1]), number(m[2])
                out += [(mean, low, high), (-mean, -high, -low)]
    return out


def assert_every_interval_is_in(text: str, triples: list[tuple[float, float, float]], digits: int = 3) -> int:
    found = TRIPLE.findall(" ".join(text.split()))  # an interval may wrap onto the next line
    for mean, low, high in found:
        assert any(close(mean, m, digits) and close(low, lo, digits) and close(high, hi, digits)
                   for m, lo, hi in triples), f"{mean} [{low}, {high}] is in no paired row"
    return len(found)


# ----------------------------------------------------------------------------- README: cpu_quick, 3 seeds

README_LABELS = {"rope, window W = 256 (baseline)": "rope[model.attention_window=256]",
                 "rope": "rope[model.attention_window=none]"}


def test_the_readme_table_is_the_cpu_quick_rerun_bands():
    bands = {r["label"]: r for r in csv.DictReader(open(ROOT / "docs/cpu_quick/rerun/bands.csv", encoding="utf-8"))}
    rows = table_rows(section(ROOT / "README.md", "| method | 0-256 | 256-512 | 512-1024 | cost 256-512",
                              "\n\n"))
    assert len(rows) == 11
    for name, cells in rows.items():
        row = bands[README_LABELS.get(name, name)]
        assert row["seeds"] == "3", name
        for cell, key in zip(cells, ["0-256", "256-512", "512-1024", "cost_256-512", "cost_512-1024"], strict=True):
            interval_cell(cell, row, key, 3)


def test_the_readme_paired_intervals_are_rows_of_paired_md():
    text = section(ROOT / "README.md", "What three seeds show", "What they do not show")
    assert assert_every_interval_is_in(text, paired_triples(ROOT / "docs/cpu_quick/rerun/paired.md", (4,))) >= 10


# ----------------------------------------------------------------------------- the synthetic tasks, 3 seeds

TASKS = ROOT / "docs/tasks/rerun/comparison"
RESULTS_LABELS = {"rope, window 64 (baseline)": "rope[model.attention_window=64]",
                  "rope": "rope[model.attention_window=none]"}


def test_the_results_task_table_is_the_rerun_tasks_csv():
    rows = [r for r in csv.DictReader(open(TASKS / "tasks.csv", encoding="utf-8"))
            if r["metric"] == "accuracy" and r["positions"] == "all"]
    cell = {(r["task"], r["test_set"], r["group"], int(r["length"])): r for r in rows}
    table = table_rows(section(ROOT / "docs/results.md", "| method | flip-flop standard 8C", "\n\n"))
    columns = [("flipflop", "standard", 512), ("flipflop", "sparse", 512), ("flipflop", "far", 512),
               ("copy", "standard", 128), ("copy", "standard", 512)]
    assert len(table) == 13
    for name, cells in table.items():
        group = RESULTS_LABELS.get(name, name)
        for shown, (task, test, length) in zip(cells, columns, strict=True):
            value, seeds = re.fullmatch(r"(.+) \((\d)\)", shown).groups()
            row = cell.get((task, test, group, length))
            if row is None:
                assert (value, seeds) == ("-", "0"), (name, task, test)
                continue
            assert seeds == row["seeds"], (name, task, test)
            mean, _, half = value.partition(" ± ")
            assert close(mean, float(row["mean"]), 2), (name, task, test)
            if half:
                assert close(half, float(row["high"]) - float(row["mean"]), 2), (name, task, test)


@pytest.mark.parametrize("page", ["docs/tasks/rerun/README.md", "docs/results.md"])
def test_the_task_paired_intervals_are_rows_of_tasks_paired_md(page):
    """Every ``x [a, b]`` of the task text is a difference or a change from C of tasks_paired.md."""
    triples = paired_triples(TASKS / "tasks_paired.md", (4, 6))
    text = (ROOT / page).read_text(encoding="utf-8")
    if page == "docs/results.md":
        text = section(ROOT / page, "What holds over 3 seeds", "### Before the length-true tests")
    else:
        text = text[text.index("**Flip-flop.**"):text.index("**Against the papers.**")]
    assert assert_every_interval_is_in(text, triples) >= 5


# ----------------------------------------------------------------------------- the GPU seed setup, one seed

def test_the_gpu_seed_table_is_its_comparison():
    folder = ROOT / "docs/gpu_seed/comparison"
    bands = {r["label"]: r for r in csv.DictReader(open(folder / "bands.csv", encoding="utf-8"))}
    copy = {r["group"]: r for r in csv.DictReader(open(folder / "copy.csv", encoding="utf-8"))
            if (r["kind"], r["region"], r["distance"]) == ("random", "past", "32")}
    rows = table_rows(section(ROOT / "docs/gpu_seed/README.md", "| method | 0-256 |", "\n\n"))
    assert len(rows) == 15
    for name, cells in rows.items():
        label = name.split(" ")[0]
        row = bands[label]
        for cell, key in zip(cells[:4], ["0-256", "256-512", "512-1024", "1024-2048"], strict=True):
            interval_cell(cell, row, key, 3)
        for cell, key in zip(cells[4:6], ["cost_256-512", "cost_1024-2048"], strict=True):
            assert close(cell, float(row[f"{key}_mean"]), 3), (name, key)
        mean, half = cells[6].split(" ± ")  # the sensitivity, one seed: its bootstrap over windows
        assert close(mean, float(copy[label]["sensitivity"]), 2), name
        assert close(half, (float(copy[label]["sensitivity_high"]) - float(copy[label]["sensitivity_low"])) / 2, 2), name


# ----------------------------------------------------------------------------- fidelity: the budget swaps over 3 seeds

@pytest.mark.slow
def test_the_budget_swaps_over_three_seeds_are_the_cpu_quick_runs():
    """fidelity.md's 3-seed check of the five swaps, recomputed from the committed runs."""
    from posbench.evaluation.stats import paired_difference
    from posbench.report.compare import run_values
    from posbench.runs.run_record import discover_runs

    methods = {"rope", "t5", "alibi", "relative", "nope", "learned", "sinusoidal"}
    runs, _ = discover_runs([ROOT / f"docs/cpu_quick/runs/{m}-s{s}" for m in methods for s in (0, 1, 2)])
    band = {}
    for run in runs:
        band.setdefault(run.method, {})[run.seed] = run_values(run, "validation")["band:0-256"].value
    triples = []
    for a, b in (("rope", "t5"), ("alibi", "t5"), ("rope", "relative"), ("nope", "learned"), ("learned", "sinusoidal")):
        d = paired_difference(band[a], band[b])
        assert d.n == 3
        triples.append((d.mean, d.low, d.high))
    text = section(ROOT / "docs/fidelity.md", "cpu_x4 has seed 0 only.", "\n\n")
    assert assert_every_interval_is_in(text, triples) == 5
    assert sum(low <= 0 <= high for _, low, high in triples) == 2  # "2 of the 5 swaps is not distinguishable"
