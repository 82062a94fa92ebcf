"""``posbench runs <folder>``: every run and sweep under a folder with its state (running,
stopped at step N, failed and why, finished with its headline), read from the run records; and
``posbench train ... --dry-run``: steps, tokens and the resolved config, nothing trained or written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import QUICK_TRAIN, compose_config, interrupted, posbench_cli, results_of

from posbench.runs.inventory import list_runs
from posbench.runs.status import write_status
from posbench.train.dry_run import dry_run


def dead_pid() -> int:
    """The PID of a process that has ended (a killed run's PID file names one)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_runs_lists_each_state_from_the_records(trained_run, tmp_path):
    finished = trained_run("method=rope")
    root = tmp_path / "outputs"
    sweep = root / "sweeps" / "s1"
    (sweep).mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    shutil.move(finished, sweep / "0_rope-s0")
    failed = shutil.copytree(sweep / "0_rope-s0", sweep / "1_alibi-s0")
    write_status(failed, "failed", error="the loss became NaN at step 3; lower trainer.lr")
    killed = shutil.copytree(sweep / "0_rope-s0", root / "killed")
    write_status(killed, "running")
    (killed / ".posbench.pid").write_text(f"{dead_pid()}\n")
    running = shutil.copytree(sweep / "0_rope-s0", root / "running")
    write_status(running, "running")
    (running / ".posbench.pid").write_text(f"{os.getpid()}\n")
    interrupted(root / "stopped", at=2)

    listing = list_runs(root)
    states = {r.path.name: r for r in listing.all()}
    assert {name: r.state for name, r in states.items()} == {
        "0_rope-s0": "finished", "1_alibi-s0": "failed", "killed": "stopped", "running": "running",
        "stopped": "stopped"}
    headline = results_of(sweep / "0_rope-s0")["eval"][0]["bands"]["32-64"]
    assert states["0_rope-s0"].headline == headline
    assert f"6 steps, 32-64 loss {headline:.4f}" == states["0_rope-s0"].detail
    assert "the loss became NaN at step 3" in states["1_alibi-s0"].detail
    assert states["killed"].detail.startswith("at step 6/6, its process is gone (killed?)")
    assert states["stopped"].step == 2 and states["stopped"].detail.startswith("at step 2/6, stopped;")
    assert f"trainer.resume={root / 'stopped'}" in states["stopped"].detail
    assert states["running"].detail == f"at step 6/6, PID {os.getpid()}"
    assert list(listing.sweeps) == [sweep] and len(listing.sweeps[sweep]) == 2
    text = listing.text()
    assert "sweep sweeps/s1: 2 run(s), 1 finished, 1 failed" in text
    assert text.splitlines()[-1] == f"5 run(s) under {root}: 1 finished, 1 failed, 2 stopped, 1 running"


@pytest.mark.slow
def test_runs_command_prints_the_listing_and_refuses_a_missing_folder(trained_run, tmp_path):
    run = trained_run()
    proc = posbench_cli("runs", str(run.parent))
    assert "run  " in proc.stdout and "finished  6 steps, 32-64 loss" in proc.stdout
    assert posbench_cli("runs", f"dir={run.parent}").stdout == proc.stdout
    missing = posbench_cli("runs", str(tmp_path / "nothing"), check=False)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"posbench runs: error: dir={tmp_path / 'nothing'} is not a folder; posbench runs <folder with runs or sweeps>"]


@pytest.mark.slow
def test_dry_run_counts_what_training_does(trained_run):
    """The dry run's steps, tokens and parameters are those the run records when it trains."""
    lines: list[str] = []
    numbers = dry_run(compose_config("train", [*QUICK_TRAIN, "method=alibi"]), log=lines.append)
    results = results_of(trained_run("method=alibi"))
    assert numbers["steps"] == results["train"]["steps"] == 6
    assert numbers["tokens"] == results["train"]["tokens"] == 6 * 4 * 32
    assert numbers["parameters"] == results["model"]["parameters"]
    (text,) = lines
    assert text.startswith("dry run: nothing is trained and no run directory is written\n")
    assert "steps 6 x 128 tokens (batch 4 x context 32; micro-batch 4 x 1 accumulation) = 768 training tokens" in text
    assert "\nresolved config:\n" in text and "name: alibi" in text


@pytest.mark.slow
def test_dry_run_from_the_command_line_writes_nothing(tmp_path):
    out = tmp_path / "would-be-run"
    proc = posbench_cli("train", *QUICK_TRAIN, "method=rope", f"hydra.run.dir={out}", "--dry-run", cwd=tmp_path)
    assert "steps 6 x 128 tokens" in proc.stdout and "resolved config:" in proc.stdout
    assert not out.exists() and not (tmp_path / "outputs").exists()
    sweep = posbench_cli("train", "-m", "method=rope,alibi", "--dry-run", cwd=tmp_path, check=False)
    assert sweep.returncode == 2 and "--dry-run shows one run; leave out -m" in sweep.stderr
    bad = posbench_cli("train", "trainer.lr=-1", "--dry-run", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "posbench train: error: trainer.lr must be positive, got -1.0"]
