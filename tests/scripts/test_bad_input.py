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


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["--device", "nosuch"], ["--device nosuch is not a device; use auto, cpu, cuda or cuda:N"]),
    (["--steps", "0"], ["--steps must be a positive integer, got 0"]),
    (["--batch-size", "0"], ["--batch-size must be a positive integer, got 0"]),
    (["--out", "{tmp}/missing/speed.json"], ["the folder {tmp}/missing does not exist; create it or choose another --out"]),
    (["--modes", "fastest"], ["--modes: 'fastest' is not one of"]),
])
def test_speed_refuses_bad_arguments_in_one_line_before_any_work(tmp_path, args, words):
    """--device nosuch, --steps 0 and --out in a missing folder gave tracebacks (the last after
    every warm-up); --batch-size 0 exited 0 with a row of 0 tok/s."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "speed.json")]
    proc = run("speed.py", "--model", "tiny", "--context", "16", "--vocab-size", "64", "--warmup", "1",
               "--rounds", "1", "--no-compile", *out, *args)
    assert_one_line(proc, "speed", *[w.replace("{tmp}", str(tmp_path)) for w in words])
    assert list(tmp_path.rglob("*.json")) == []
