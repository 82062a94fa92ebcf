"""scripts/compare_results.py: a missing or corrupt results.json is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_results.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, timeout=120)


def test_equal_and_different_numbers(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"loss": 1.0, "seconds": 3}))
    b.write_text(json.dumps({"loss": 1.0, "seconds": 4}))
    assert run_script(str(a), str(b)).returncode == 0
    b.write_text(json.dumps({"loss": 1.5}))
    proc = run_script(str(a), str(b))
    assert proc.returncode == 1 and ".results.loss: 1.0 != 1.5" in proc.stdout


@pytest.mark.parametrize("case, message", [
    ("missing", "none.json does not exist; give results.json files or run directories"),
    ("corrupt", "is not valid JSON"),
    ("run dir without results", "results.json does not exist"),
    ("odd", "give pairs of results.json files or run directories (got 1 argument(s))"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, message):
    """Tracebacks before (FileNotFoundError, JSONDecodeError); the usage text for an odd count."""
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"loss": 1.0}))
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"loss": 1.0')  # cut short
    (tmp_path / "run").mkdir()
    other = {"missing": tmp_path / "none.json", "corrupt": corrupt, "run dir without results": tmp_path / "run"}
    proc = run_script(str(good)) if case == "odd" else run_script(str(good), str(other[case]))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("compare_results: error: ") and proc.stderr.count("\n") == 1
    assert message in proc.stderr
