"""Reliability faults of sweeps, posbench eval and training: a sweep continued with one run's
``trainer.resume``, a damaged results.json re-evaluated at other lengths, eval and viz renaming
nothing, eval's refusals coming first, a model too large refused before the data, and progress
lines off a terminal. Tiny models on the CPU; the CLI runs in a subprocess where it matters."""

from __future__ import annotations

import json
import re
from pathlib import Path

import helpers
import pytest
from helpers import QUICK_TRAIN, QUIET, compose_config, interrupted, posbench_cli, run_train, snapshot, status_of
from omegaconf import OmegaConf

from posbench.core.errors import PosbenchError
from posbench.train.trainer import TrainingInterrupted, train


def run_eval(run_dir: Path, *overrides: str, log=QUIET) -> dict:
    return helpers.run_eval(run_dir, "eval.num_sequences=4", "eval.batch_size=4", *overrides, log=log)


# ----------------------------------------------------------------------------- a sweep continued with trainer.resume


@pytest.mark.slow
def test_an_interrupted_sweep_names_its_sweep_dir_and_the_same_command_continues_it(tmp_path):
    """The hint of a stopped sweep job is the sweep's, not ``trainer.resume=<job dir>`` (which
    would send every job of the sweep into that one run)."""
    sweep = ["train", "-m", *QUICK_TRAIN, "method=rope", "seed=0,1"]
    stopped = posbench_cli(*sweep, "trainer.stop_after_steps=2", cwd=tmp_path, check=False)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    hint = re.search(r"continue the sweep with the same command plus hydra\.sweep\.dir=(\S+)", stopped.stderr)
    assert hint and "trainer.resume" not in stopped.stderr, stopped.stderr[-2000:]
    sweep_dir = Path(hint.group(1))
    assert (sweep_dir / "0_rope-s0" / "checkpoints").is_dir()
    finished = posbench_cli(*sweep, f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, check=False)
    assert finished.returncode == 0, finished.stderr[-2000:]
    first = json.loads((sweep_dir / "0_rope-s0" / "results.json").read_text())
    assert first["train"]["resumed_from_step"] == 2
    assert "## Finished (2)" in (sweep_dir / "summary.md").read_text()


def test_the_hint_of_a_run_started_with_trainer_resume_adds_nothing(tmp_path):
    run_dir = tmp_path / "run"
    interrupted(run_dir, "method=rope")
    with pytest.raises(TrainingInterrupted) as stopped:
        train(compose_config("train", [*QUICK_TRAIN, "method=rope", f"trainer.resume={run_dir}",
                                       "trainer.stop_after_steps=4"]), tmp_path / "elsewhere", log=lambda _: None)
    assert str(stopped.value).endswith("continue with the same command")


@pytest.mark.slow
def test_a_sweep_sharing_one_runs_trainer_resume_is_refused_before_any_job(tmp_path):
    old = tmp_path / "old" / "0_alibi-s0"
    interrupted(old, "method=alibi")
    before = snapshot(old)
    sweep_dir = tmp_path / "new"
    proc = posbench_cli("train", "-m", *QUICK_TRAIN, "method=alibi,nope", f"trainer.resume={old}",
                        f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("posbench train: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"trainer.resume={old} continues one run" in errors[0] and "hydra.sweep.dir=<its sweep dir>" in errors[0]
    assert snapshot(old) == before
    assert not sweep_dir.exists() or not any(sweep_dir.iterdir())


def test_a_refused_resume_of_another_run_writes_nothing_there_and_fails_its_own_job(tmp_path):
    """A job refused for ``trainer.resume=<another sweep's run>``: that run stays byte for byte
    (no refused.json), the job's own directory records the failure, the sweep counts it."""
    from posbench.commands.sweep import ComparePlotsCallback, failed_jobs_of_last_sweep

    old = tmp_path / "old" / "0_alibi-s0"
    interrupted(old, "method=alibi")
    before = snapshot(old)
    job = tmp_path / "new" / "1_nope-s0"
    job.mkdir(parents=True)  # Hydra made the job's directory
    with pytest.raises(PosbenchError, match="method=alibi, not method=nope"):
        run_train(job, "method=nope", f"trainer.resume={old}")
    assert snapshot(old) == before
    assert status_of(job)["status"] == "failed" and "method=alibi, not method=nope" in status_of(job)["error"]
    ComparePlotsCallback(viz=False).on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(job.parent)}}}))
    assert failed_jobs_of_last_sweep() == 1
    summary = (job.parent / "summary.md").read_text()
    assert "## Failed or missing (1)" in summary and "`1_nope-s0`: failed: " in summary


@pytest.mark.slow
def test_a_sweep_job_that_continued_its_own_run_elsewhere_counts_as_finished(tmp_path):
    """Sweeping ``trainer.resume`` (one run per job): the job's own directory holds only Hydra's
    record, and the summary follows it to the run it finished instead of calling it missing."""
    from posbench.commands.sweep import ComparePlotsCallback, failed_jobs_of_last_sweep
    from posbench.runs.runlog import HydraRecord

    old = tmp_path / "old" / "0_alibi-s0"
    interrupted(old, "method=alibi")
    job = tmp_path / "new" / "0_alibi-s0"
    job.mkdir(parents=True)
    record = HydraRecord(job, {"overrides.yaml": f"- trainer.resume={old}\n"}, multirun=True, created=[],
                         sweep_dir=job.parent)
    train(compose_config("train", [*QUICK_TRAIN, "method=alibi", f"trainer.resume={old}"]), job,
          log=lambda _: None, hydra_record=record)
    assert (job / ".hydra" / "config.yaml").is_file() and not (job / "status.json").exists()
    ComparePlotsCallback(viz=False).on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(job.parent)}}}))
    assert failed_jobs_of_last_sweep() == 0
    summary = (job.parent / "summary.md").read_text()
    assert "## Finished (1)" in summary and f"`{old}`" in summary and "## Failed or missing (0)" in summary


# ----------------------------------------------------------------------------- a damaged results.json, eval, viz


@pytest.fixture
def finished(trained_run) -> Path:
    """A finished tiny alibi run of its own for each test (a copy: training once is enough)."""
    return trained_run("method=alibi")


@pytest.mark.slow
def test_eval_at_other_lengths_of_a_run_with_damaged_results_recomputes_its_own_first(finished):
    """The run's own entry (its own lengths, its headline) is recomputed under its own eval
    settings; the asked length is added beside it, marked ``added``."""
    own = json.loads((finished / "results.json").read_text())
    (finished / "results.json").write_text('{"schema_version": 1, "meth')
    results = run_eval(finished, "eval.lengths=[96]")
    by_length = {e["length"]: e for e in results["eval"]}
    assert sorted(by_length) == [64, 96] and by_length[96]["added"] and not by_length[64].get("added")
    assert by_length[64]["bands"] == pytest.approx(own["eval"][0]["bands"])
    assert json.loads((finished / "results.json").read_text())["eval"] == results["eval"]
    assert (finished / "results.json.corrupt").read_text() == '{"schema_version": 1, "meth'


def test_a_refused_eval_renames_nothing_in_a_damaged_run(finished):
    """A damaged results.json and a damaged newest checkpoint are reported, never renamed, by
    an eval that is refused (here: a length below the training context) and by viz."""
    from posbench.runs.checkpoint import list_checkpoints, read_checkpoint, save_checkpoint

    (finished / "results.json").write_text("[1, 2]")
    (newest,) = list_checkpoints(finished)
    state = read_checkpoint(newest)
    save_checkpoint(finished, {**state, "step": state["step"] + 1}, keep=5)
    damaged = list_checkpoints(finished)[-1]
    damaged.write_bytes(damaged.read_bytes()[:100])
    before = snapshot(finished)
    lines: list[str] = []
    with pytest.raises(PosbenchError, match="below trainer.context"):
        run_eval(finished, "eval.lengths=[16]", log=lines.append)
    assert snapshot(finished) == before
    assert any("results.json is damaged" in line for line in lines)
    assert any(damaged.name in line and "trying the previous one" in line for line in lines)


def test_viz_renames_nothing_in_a_damaged_run(finished):
    from posbench.runs.load import load_run

    (finished / "results.json").write_text("not json")
    before = snapshot(finished)
    run = load_run(finished, log=lambda _: None)
    assert run.results is None and snapshot(finished) == before


def test_eval_of_an_unfinished_run_refuses_first_in_one_line(tmp_path):
    interrupted(tmp_path, "method=nope")
    lines: list[str] = []
    with pytest.raises(PosbenchError, match="stopped at step 2 of 6; finish training it first"):
        run_eval(tmp_path, log=lines.append)
    assert not [line for line in lines if "final evaluation" in line or "resuming" in line], lines


def test_eval_of_a_busy_run_names_what_eval_takes(tmp_path):
    from posbench.runs.rundir import RunLock

    with pytest.raises(PosbenchError):  # the final checkpoint, no results.json: eval would finish it
        run_train(tmp_path, "method=nope", "eval.lengths=[1000000]")
    lines: list[str] = []
    with RunLock(tmp_path), pytest.raises(PosbenchError, match="in use by another posbench process") as refused:
        run_eval(tmp_path, log=lines.append)
    assert "hydra.run.dir" not in str(refused.value) and f"posbench eval run={tmp_path}" in str(refused.value)
    assert not [line for line in lines if "final evaluation" in line], lines


# ----------------------------------------------------------------------------- too large: refused before the data


@pytest.mark.parametrize("override", ["model.n_layers=100000000", "trainer.batch_size=100000000"])
def test_a_model_too_large_is_refused_before_the_data_is_prepared(tmp_path, monkeypatch, override):
    import posbench.train.trainer

    def no_data(*args, **kwargs):
        raise AssertionError("the data was prepared before the memory check")

    monkeypatch.setattr(posbench.train.trainer, "make_workload", no_data)
    with pytest.raises(PosbenchError, match="this run needs at least .* GiB") as refused:
        run_train(tmp_path, "method=nope", override)
    assert len(str(refused.value).splitlines()) == 1 and "lower" in str(refused.value)


# ----------------------------------------------------------------------------- progress off a terminal


def test_off_a_terminal_a_progress_line_comes_every_interval_with_rate_and_eta(monkeypatch):
    import io

    import posbench.train.progress as progress_module

    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(progress_module.sys, "stderr", io.StringIO())  # a log file, not a terminal
    monkeypatch.delenv("CI", raising=False)
    lines: list[str] = []
    progress = progress_module.make_progress(total=1000, initial=0, enabled=True, every_seconds=30, log=lines.append)
    for step in range(1, 1001):
        clock[0] += 1.0  # one step a second
        if step % 40 == 0:
            progress.update_to(step, 2.5, 1234.0)
        progress.tick(step)
    assert len(lines) == 1000 // 30 + 1  # every 30 s, and the last step
    # Before the first logged loss: a dash, not "loss nan nan tok/s"; after it: the step it comes from.
    assert lines[0] == "step 30/1000 (3%) loss - - tok/s 1.00 steps/s ETA 16:10"
    assert lines[1] == "step 60/1000 (6%) loss 2.5000 at step 40 1,234 tok/s 1.00 steps/s ETA 15:40"
    assert lines[-1].startswith("step 1000/1000 (100%) loss 2.5000 at step 1000") and lines[-1].endswith("ETA 00:00")
    assert not any("nan" in line for line in lines)


@pytest.mark.slow
def test_a_training_off_a_terminal_logs_timed_progress_lines(tmp_path):
    lines: list[str] = []
    run_train(tmp_path, "method=nope", "trainer.progress_every_seconds=0.000001", log=lines.append)
    progress = [line for line in lines if re.match(r"step \d+/6 \(\d+%\) loss .* steps/s ETA ", line)]
    assert [line.split()[1] for line in progress] == [f"{step}/6" for step in range(1, 7)]
