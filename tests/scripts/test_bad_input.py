"""The scripts the docs tell users to run follow the CLI's contract on bad input: one line naming
the fix on stderr, exit 2, nothing on stdout and nothing written (scripts/extension_table.py and
scripts/position_drift.py gave tracebacks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], check=False,
                          capture_output=True, text=True, timeout=300)


def assert_one_line(proc: subprocess.CompletedProcess, name: str, *words: str) -> None:
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.startswith(f"{name}: error: ") and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert all(w in proc.stderr for w in words), proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "corrupt", "no variant", "no arguments"])
def test_extension_table_refuses_bad_input_in_one_line(tmp_path, case):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = [str(run_dir)]
    if case == "corrupt":
        (run_dir / "results.json").write_text("{not json")
    elif case == "no variant":
        committed = ROOT / "docs" / "cpu_quick" / "runs" / "rope-s0" / "results.json"
        (run_dir / "results.json").write_text(committed.read_text())
        args.append("num_sequences=7")
    elif case == "no arguments":
        args = []
    proc = run("extension_table.py", *args)
    words = {"missing": ["no readable results.json"], "corrupt": ["no readable results.json"],
             "no variant": ["no eval variant 'num_sequences=7'"], "no arguments": ["usage:"]}[case]
    assert_one_line(proc, "extension_table", *words)


@pytest.mark.slow
def test_extension_table_still_prints_a_runs_table():
    proc = run("extension_table.py", str(ROOT / "docs" / "cpu_quick" / "runs" / "rope-s0"))
    assert proc.returncode == 0 and proc.stdout.startswith("| extension | 0-256 |"), proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["no run", "no checkpoints"])
def test_position_drift_refuses_bad_input_in_one_line(tmp_path, case):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    csv = tmp_path / "drift.csv"
    if case == "no checkpoints":  # a committed run: its config, no checkpoints kept
        committed = ROOT / "docs" / "cpu_quick" / "runs" / "rope-s0" / "config.yaml"
        (run_dir / "config.yaml").write_text(committed.read_text())
    proc = run("position_drift.py", str(run_dir), "--csv", str(csv))
    assert_one_line(proc, "position_drift", "config.yaml" if case == "no run" else "has no checkpoints")
    assert not csv.exists()
