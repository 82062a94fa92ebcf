"""scripts/induction_budget.py: windows with one repeated span, the copy/rest split of the loss,
the report of when copying formed, and its one-line refusals."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "induction_budget.py"
spec = importlib.util.spec_from_file_location("induction_budget", SCRIPT)
induction_budget = importlib.util.module_from_spec(spec)
spec.loader.exec_module(induction_budget)


def test_each_window_repeats_one_span_and_marks_the_targets_a_copy_predicts():
    pool = torch.arange(100, 164)
    ids, copy = induction_budget.windows(torch.Generator().manual_seed(0), pool, batch=32, context=64, span=8)
    assert ids.shape == (32, 65) and copy.shape == (32, 64)
    assert bool(torch.isin(ids, pool).all())
    assert (copy.sum(dim=1) == 7).all()  # the 2nd .. k-th ids of the second copy
    for row in range(32):
        targets = torch.nonzero(copy[row]).flatten()  # target t is ids[t + 1]
        assert (targets.diff() == 1).all()
        first = int(targets[0])  # ids[first] is the second copy's first id: find its earlier occurrence
        later = ids[row, first : first + 8]
        starts = [p for p in range(0, first - 7) if torch.equal(ids[row, p : p + 8], later)]
        assert starts, "the span must occur earlier in the window"
        assert starts[0] + 8 <= first  # the second copy starts after the first ends


def test_the_loss_splits_into_copy_targets_and_the_rest():
    """An oracle that copies has copy loss ~0; a uniform model has ln(vocab) on both parts."""
    gen = torch.Generator().manual_seed(1)
    ids, copy = induction_budget.windows(gen, torch.arange(1, 50), batch=4, context=32, span=6)
    vocab = 50
    uniform = torch.zeros(4, 32, vocab)
    total, copy_loss, rest = induction_budget.split_loss(uniform, ids, copy)
    assert copy_loss == pytest.approx(math.log(vocab)) and rest == pytest.approx(math.log(vocab))
    assert float(total) == pytest.approx(math.log(vocab))
    oracle = uniform.clone()
    rows, cols = torch.nonzero(copy, as_tuple=True)
    oracle[rows, cols, ids[rows, cols + 1]] = 100.0  # all mass on the copied id
    _, copy_loss, rest = induction_budget.split_loss(oracle, ids, copy)
    assert copy_loss < 1e-6 and rest == pytest.approx(math.log(vocab))


def test_formed_is_the_first_report_below_the_level():
    history = [{"step": 50, "copy": 9.0}, {"step": 100, "copy": 4.0}, {"step": 150, "copy": 1.0}]
    assert induction_budget.formed_at(history, 4.5) == 100
    assert induction_budget.formed_at(history, 0.5) is None


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("args, fix", [
    (["--pool", "1"], "--pool must be in 2 .. 8191"),
    pytest.param(["--span", "200"], "--span must be in 1 .. 128", marks=pytest.mark.slow),
    pytest.param(["--steps", "0"], "--steps must be a positive integer", marks=pytest.mark.slow),
    pytest.param(["--device", "gpu0"], "is not a device; use cpu, cuda", marks=pytest.mark.slow),
])
def test_bad_settings_are_refused_in_one_line(args, fix):
    done = run_script(*args)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and fix in done.stderr
    assert done.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_cuda_without_a_cuda_device_is_refused_in_one_line():
    done = run_script("--device", "cuda")
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: --device cuda but no CUDA device is visible; use --device cpu")


def test_a_short_run_reports_and_writes_its_log(tmp_path):
    out = tmp_path / "log.jsonl"
    done = run_script("--model", "tiny", "--context", "32", "--span", "8", "--pool", "64", "--steps", "6",
                      "--every", "3", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "not formed in 6 steps" in done.stdout and "pool 64" in done.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6]
    assert all(r["no_copy"] == pytest.approx(math.log(64)) and r["copy"] > 0 for r in records)
