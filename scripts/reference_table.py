"""Measured agreement of every position method with its independent reference.

    python scripts/reference_table.py [out.md]

Runs the reference tests (tests/unit/methods/: test_methods.py, test_rotary.py, test_score.py, test_path.py,
test_dape.py, test_ssmax.py; tests/unit/model/: test_attention.py, test_transformer.py) with
``POSBENCH_REFERENCE_LOG`` set, so each ``assert_matches_reference`` call also records the
largest absolute difference it saw; then prints, per method and reference, the number of
comparisons, the largest difference over all of them and the tolerance the test asserts. The
tests must pass: a failing run prints pytest's output and exits 1. Takes about a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/unit/methods/test_methods.py", "tests/unit/methods/test_rotary.py", "tests/unit/methods/test_score.py",
         "tests/unit/model/test_attention.py", "tests/unit/model/test_transformer.py", "tests/unit/methods/test_path.py",
         "tests/unit/methods/test_dape.py", "tests/unit/methods/test_ssmax.py"]


def collect() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "reference.jsonl"
        env = {**os.environ, "POSBENCH_REFERENCE_LOG": str(log)}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            sys.stdout.write(run.stdout + run.stderr)
            raise SystemExit(1)
        return [json.loads(line) for line in log.read_text().splitlines()]


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


def main(argv: list[str]) -> None:
    text = table(collect())
    print(text)
    if argv:  # keep the file's prose, replace its table (from the header row to the end)
        out = Path(argv[0])
        old = out.read_text() if out.is_file() else ""
        keep = old[: old.index("| method | reference")] if "| method | reference" in old else old
        out.write_text(keep + text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
