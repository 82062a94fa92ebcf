"""Measured agreement of every position method with its independent reference.

    python scripts/reference_table.py                             # print the tables
    python scripts/reference_table.py docs/reference_checks.md    # rewrite the page's tables

Runs the reference tests (``SECTIONS``, test files or single tests: the sequence methods, the
schedules and stick-breaking, the q-k transforms and extensions, the grid methods) with ``POSBENCH_REFERENCE_LOG`` set, so each
``assert_matches_reference`` call also records the largest absolute difference it saw; then
tabulates, per method and reference, the number of comparisons, the largest difference over all
of them and the tolerance the test asserts. Each section's table sits between
``<!-- reference-table: <section> -->`` and ``<!-- reference-table: <section> end -->`` of the
page; the rest of the page is written by hand. The tests must pass: a failing run prints pytest's
output and exits 1. Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_reference import replace_region

from posbench.commands.cli import run_script
from posbench.core.errors import PosbenchError
from posbench.core.io import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = {
    "methods": ["tests/unit/methods/test_methods.py", "tests/unit/methods/test_rotary.py",
                "tests/unit/methods/test_score.py", "tests/unit/model/test_attention.py",
                "tests/unit/model/test_transformer.py", "tests/unit/methods/test_path.py",
                "tests/unit/methods/test_dape.py", "tests/unit/methods/test_ssmax.py",
                "tests/unit/methods/test_fidelity.py::test_t5_default_bias_scale_is_sqrt_head_dim_as_x_transformers"],
    "schedules": ["tests/unit/methods/test_stickbreaking.py", "tests/unit/methods/test_layers.py"],
    "rotary": ["tests/unit/methods/test_pope.py", "tests/unit/methods/test_hope.py",
               "tests/unit/model/test_extension_rerope.py", "tests/unit/model/test_extension_streams.py"],
    "grid": sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests/unit/methods").glob("test_grid*.py")),
}


def collect(files: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "reference.jsonl"
        env = {**os.environ, "POSBENCH_REFERENCE_LOG": str(log)}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            sys.stdout.write(run.stdout + run.stderr)
            raise SystemExit(1)
        return [json.loads(line) for line in log.read_text().splitlines()]


def section_of(record: dict) -> str:
    """The section that lists the test (or its file) that logged ``record``."""
    test = record["test"]
    return next(name for name, entries in SECTIONS.items() if any(test.startswith(f"{e}::") or test.startswith(f"{e}[")
                                                                   or test == e for e in entries))


def tolerance(record: dict) -> str:
    if record["atol"] is None and record["rtol"] is None:
        return "torch default"
    return f"atol {record['atol']:g}, rtol {record['rtol']:g}"


def table(records: list[dict]) -> str:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["method"], r["reference"]), []).append(r)
    lines = ["| method | reference | comparisons | elements | compared as | max abs diff | asserted |",
             "|---|---|---:|---:|---|---:|---|"]
    for (method, reference), rs in sorted(groups.items()):
        worst = max(rs, key=lambda r: r["max_abs_diff"])
        dtypes = "/".join(sorted({r["dtype"] for r in rs}))
        lines.append(f"| {method} | {reference} | {len(rs)} | {sum(r['elements'] for r in rs):,} | {dtypes} | "
                     f"{worst['max_abs_diff']:.2e} | {tolerance(worst)} |")
    return "\n".join(lines)


def tables(records: list[dict]) -> dict[str, str]:
    """Each section's table of the records its tests logged."""
    return {name: table([r for r in records if section_of(r) == name]) for name in SECTIONS}


def render(page: str, by_section: dict[str, str]) -> str:
    """``page`` with each section's region replaced by its table."""
    for name, text in by_section.items():
        page = replace_region(page, f"<!-- reference-table: {name} -->", f"<!-- reference-table: {name} end -->",
                              text, "the reference page")
    return page


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise PosbenchError("usage: python scripts/reference_table.py [docs/reference_checks.md]")
    out = Path(argv[0]) if argv else None
    if out is not None:
        render(out.read_text(), dict.fromkeys(SECTIONS, ""))  # every region is there before the tests run
    by_section = tables(collect([f for files in SECTIONS.values() for f in files]))
    if out is None:
        print("\n\n".join(by_section.values()))
    else:
        write_text_atomic(out, render(out.read_text(), by_section))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run_script("reference_table.py", main)
