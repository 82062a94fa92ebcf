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
    ids, copy, _ = induction_budget.windows(torch.Generator().manual_seed(0), pool, batch=32, context=64, span=8)
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
    ids, copy, _ = induction_budget.windows(gen, torch.arange(1, 50), batch=4, context=32, span=6)
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


def test_a_fixed_distance_puts_every_second_copy_d_after_the_first():
    ids, copy, ds = induction_budget.windows(torch.Generator().manual_seed(2), torch.arange(1, 500), batch=16,
                                             context=64, span=8, distances=(32, 32))
    assert (ds == 32).all()
    for row in range(16):
        first = int(torch.nonzero(copy[row]).flatten()[0])  # the second copy's first id
        assert torch.equal(ids[row, first : first + 8], ids[row, first - 32 : first - 24])


def test_periodic_windows_repeat_a_block_to_the_end_and_mark_every_copied_id():
    ids, copy, ds = induction_budget.periodic_windows(torch.Generator().manual_seed(3), torch.arange(1, 900), batch=16,
                                                      context=64, periods=(8, 56))
    assert ids.shape == (16, 65) and copy.shape == (16, 64) and ((ds >= 8) & (ds <= 56)).all()
    for row in range(16):
        d = int(ds[row])
        assert torch.equal(ids[row, d:], ids[row, : 65 - d])  # every id from the second block on repeats
        assert not copy[row, :d].any() and copy[row, d:].all()  # target t is ids[t + 1]: ids d+1 .. C


def test_distance_bands_cover_every_distance_that_fits_once():
    bands = induction_budget.distance_bands(span=8, context=64)
    assert bands[0][0] == 8 and bands[-1][1] == 57 and len(bands) == 4
    assert all(b[0] == a[1] + 1 for a, b in zip(bands, bands[1:]))
    assert induction_budget.distance_bands(span=32, context=64) == [(32, 32), (33, 33)]  # C/2 leaves no room


def test_settings_are_derived_before_any_work():
    args = induction_budget.parse(["--context", "64", "--span-frac", "0.25", "--distance", "20", "--curriculum", "10:32"])
    assert args.span == 16 and args.distances == (20, 20) and args.curriculum_span == (10, 32)
    assert induction_budget.parse(["--context", "64", "--span", "8"]).distances is None  # uniform


def test_the_curriculum_trains_its_span_first_and_formed_counts_after_it():
    args = induction_budget.parse(["--model", "tiny", "--vocab", "64", "--context", "16", "--span", "2",
                                   "--curriculum", "2:8", "--steps", "4", "--every", "1", "--batch-size", "2"])
    result = induction_budget.run(args, report=lambda line: None)
    assert [h["span"] for h in result["history"]] == [8, 8, 2, 2]
    assert len(result["by_distance"]) >= 1 and result["formed"] in (None, 3, 4)


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


@pytest.mark.parametrize("args, fix", [
    (["--warmup", "-1"], "--warmup must be 0 (none) or a positive"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--out", "no/such/folder/log.jsonl"], "does not exist; create it"),
    (["--span", "8", "--span-frac", "0.1"], "give --span or --span-frac, not both"),
    (["--span-frac", "0.7"], "--span-frac must be in (0, 0.5]"),
    (["--context", "64", "--span", "8", "--distance", "60"], "--distance 60 does not fit"),
    (["--distance", "far"], "--distance takes uniform or a whole number"),
    (["--curriculum", "10"], "--curriculum takes STEPS:SPAN"),
    (["--probe-span", "0"], "--probe-span must be in 1 .."),
    (["--context", "64", "--span", "8", "--periods", "1:3"], "need 2 <= LO <= HI <= 63"),
    (["--periods", "8"], "--periods takes LO:HI"),
])
def test_bad_settings_are_refused_before_any_work(args, fix, capsys, monkeypatch):
    """In-process: main() returns 2 with one line on stderr, and never reaches training."""
    monkeypatch.setattr(induction_budget, "run", lambda *a, **k: pytest.fail("trained despite a bad setting"))
    assert induction_budget.main(args) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [captured.err.strip()] and fix in captured.err
    assert captured.out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_cuda_without_a_cuda_device_is_refused_in_one_line():
    done = run_script("--device", "cuda")
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: --device cuda but no CUDA device is visible; use --device cpu")


def test_a_periodic_run_and_a_periodic_curriculum_train():
    for extra in (["--windows", "periodic", "--periods", "4:12"], ["--span", "2", "--curriculum", "2:periodic"]):
        args = induction_budget.parse(["--model", "tiny", "--vocab", "64", "--context", "16", "--steps", "3",
                                       "--every", "1", "--batch-size", "2", *extra])
        history = induction_budget.run(args, report=lambda line: None)["history"]
        assert [h["span"] for h in history] == (["periodic"] * 3 if "--windows" in extra else ["periodic"] * 2 + [2])


def test_no_warm_up_trains():
    args = induction_budget.parse(["--model", "tiny", "--vocab", "64", "--context", "16", "--span", "4",
                                   "--warmup", "0", "--steps", "2", "--every", "1", "--batch-size", "2"])
    assert [h["step"] for h in induction_budget.run(args, report=lambda line: None)["history"]] == [1, 2]


def test_a_short_run_reports_and_writes_its_log(tmp_path):
    out = tmp_path / "log.jsonl"
    done = run_script("--model", "tiny", "--context", "32", "--span", "8", "--pool", "64", "--steps", "6",
                      "--every", "3", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "not formed in 6 steps" in done.stdout and "pool 64" in done.stdout
    assert "held-out copy loss by distance: d 8-" in done.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6]
    assert all(r["no_copy"] == pytest.approx(math.log(64)) and r["copy"] > 0 for r in records)
