"""scripts/budget_check.py: ranks, Kendall's tau and order flips between two bands.csv files."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "budget_check.py"
spec = importlib.util.spec_from_file_location("budget_check", SCRIPT)
budget_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(budget_check)


def write_bands(path: Path, rows: dict[str, tuple[float, float]]) -> Path:
    """rows: label -> (0-256 mean, half-width); 256-512 = 0-256 + 0.1."""
    lines = ["method,label,0-256_mean,0-256_low,0-256_high,256-512_mean,256-512_low,256-512_high"]
    for label, (mean, half) in rows.items():
        lines.append(f"{label},{label},{mean},{mean - half},{mean + half},{mean + .1},{mean + .1 - half},{mean + .1 + half}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_kendall_tau_extremes_and_one_swap():
    assert budget_check.kendall_tau(list("abcd"), list("abcd")) == 1.0
    assert budget_check.kendall_tau(list("abcd"), list("dcba")) == -1.0
    assert budget_check.kendall_tau(list("abcd"), list("bacd")) == pytest.approx((5 - 1) / 6)  # 1 of 6 pairs discordant


def test_flips_reported_with_interval_overlap(tmp_path, capsys):
    short = write_bands(tmp_path / "s.csv", {"a": (3.0, 0.01), "b": (3.1, 0.01), "c": (3.5, 0.01), "x": (4.0, 0.1)})
    long = write_bands(tmp_path / "l.csv", {"a": (2.9, 0.2), "b": (2.8, 0.2), "c": (3.4, 0.01)})
    assert budget_check.main([str(short), str(long), "--labels", "400,1600"]) == 0
    out = capsys.readouterr().out
    assert "| b | 3.100 [3.090, 3.110] | 2 | 2.800 [2.600, 3.000] | 1 | -0.300 |" in out
    assert "Kendall tau between the two orders: **+0.333** (3 methods)" in out
    assert "- a ahead of b at 400, behind at 1600; intervals separate at 400, overlap at 1600" in out
    assert "In one file only (left out): x" in out


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case, message", [
    ("band", "band 512-1024 is not in"),
    ("not a number", "the 0-256 interval of 'a' is not three numbers ({'mean': 'abc'"),
    ("missing", "cannot read bands.csv"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case, message):
    """A band the files lack, a cell that is not a number (a traceback before) and a missing file:
    one line naming the fix, exit 2, no table printed."""
    path = write_bands(tmp_path / "s.csv", {"a": (3.0, 0.01), "b": (3.1, 0.01)})
    other = tmp_path / "l.csv"
    other.write_text(path.read_text().replace("3.0,2.99", "abc,2.99") if case == "not a number" else path.read_text())
    args = [str(path), str(other if case != "missing" else tmp_path / "none.csv")]
    proc = run_script(*args, *(["--bands", "512-1024"] if case == "band" else []))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("budget_check: error: ") and proc.stderr.count("\n") == 1
    assert message in proc.stderr
