"""Faults a careless user or a busy cluster causes: every one ends in one clear line,
a finishable run and an intact record. Tiny model, CPU, a few steps each."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import QUICK_TRAIN, QUIET, compose_config, interrupted, results_of, run_eval, run_train, status_of
from omegaconf import OmegaConf

from posbench.core.errors import PosbenchError
from posbench.runs.checkpoint import list_checkpoints, read_checkpoint
from posbench.runs.resume import check_resumable
from posbench.runs.rundir import RunLock
from posbench.runs.spec import build_spec
from posbench.train.trainer import Trainer


def evaluate(run_dir: Path, log=QUIET) -> dict:
    return run_eval(run_dir, "eval.lengths=[64]", "eval.num_sequences=4", "eval.batch_size=4", log=log)


# -------------------------------------------------- a stop after the final checkpoint


@pytest.mark.slow
def test_a_run_stopped_after_its_final_checkpoint_is_finished_by_the_next_start(tmp_path):
    with pytest.raises(PosbenchError):  # training succeeds, the final evaluation fails
        run_train(tmp_path, "method=rope", "eval.lengths=[1000000]")
    assert status_of(tmp_path)["status"] == "failed" and not (tmp_path / "results.json").exists()
    lines = []
    results = run_train(tmp_path, "method=rope", log=lines.append)
    assert results["train"]["resumed_from_step"] == 6 and results["eval"][0]["length"] == 64
    assert any("straight to the final evaluation" in line for line in lines)
    assert status_of(tmp_path)["status"] == "completed"


@pytest.mark.slow
def test_posbench_eval_finishes_a_run_that_has_no_results_yet(tmp_path):
    with pytest.raises(PosbenchError):
        run_train(tmp_path, "method=alibi", "eval.lengths=[1000000]")
    (tmp_path / "status.json").unlink()  # a lost status.json must not matter either
    results = evaluate(tmp_path)
    assert [e["length"] for e in results["eval"]] == [64] and results["train"]["steps"] == 6
    assert status_of(tmp_path)["status"] == "completed"


def test_posbench_eval_refuses_a_run_with_steps_left_to_train(tmp_path):
    interrupted(tmp_path, "method=nope", at=2)
    with pytest.raises(PosbenchError, match="stopped at step 2 of 6; finish training it first"):
        evaluate(tmp_path)
    assert status_of(tmp_path)["status"] == "interrupted" and not (tmp_path / "refused.json").exists()


# ------------------------------------------------------------------- a refused resume


@pytest.mark.slow
def test_a_refused_resume_leaves_the_runs_record_and_counts_as_failed(tmp_path):
    from posbench.commands.sweep import ComparePlotsCallback, failed_jobs_of_last_sweep

    job = tmp_path / "sweep" / "0"
    run_train(job, "method=nope")
    before = {name: (job / name).read_text() for name in ("config.yaml", "status.json", "results.json")}
    with pytest.raises(PosbenchError, match="trainer.context=32, not trainer.context=16"):
        run_train(job, "method=nope", "trainer.context=16")
    assert {name: (job / name).read_text() for name in before} == before
    ComparePlotsCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}}))
    assert failed_jobs_of_last_sweep() == 1
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "## Finished (0)" in summary and "refused" in summary and "trainer.context=32" in summary
    run_train(job, "method=nope")  # the same config again: accepted, the refusal is over
    assert not (job / "refused.json").exists()


# ------------------------------------------------------------- a locked run directory


def test_a_second_training_into_a_locked_run_directory_is_refused(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(PosbenchError, match=f"in use by another posbench process \\(PID {os.getpid()}\\)"):
            run_train(tmp_path, "method=alibi")
    assert not (tmp_path / "status.json").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path):
    holder = subprocess.run(
        [sys.executable, "-c", "import os, signal, sys; from posbench.runs.rundir import RunLock; "
         "RunLock(sys.argv[1]).__enter__(); os.kill(os.getpid(), signal.SIGKILL)", str(tmp_path)])
    assert holder.returncode == -signal.SIGKILL and (tmp_path / RunLock.OWNER_FILE).exists()
    assert run_train(tmp_path, "method=alibi")["train"]["steps"] == 6


# -------------------------------------------------------- resume lists every difference


def test_resume_lists_every_difference_of_model_options_and_trainer(tmp_path):
    interrupted(tmp_path, "method=rope", at=2)
    with pytest.raises(PosbenchError) as refused:
        run_train(tmp_path, "method=rope", "model.n_heads=2", "method.base=500", "trainer.lr=0.5")
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    for part in ("model.n_heads=4, not model.n_heads=2", "method.base=10000", "trainer.lr="):
        assert part in message, message


def test_resume_refuses_other_data(tmp_path):
    interrupted(tmp_path, "method=nope", at=2)
    state = read_checkpoint(list_checkpoints(tmp_path)[-1])
    spec = build_spec(compose_config("train", [*QUICK_TRAIN, "method=nope"]))
    spec = replace(spec, model=replace(spec.model, vocab_size=state["model_config"]["vocab_size"]))
    other = {**state["data_identity"], "tokenizer_sha256": "0" * 64}
    with pytest.raises(PosbenchError, match=r"holds a run with other data \(its tokenizer differs: "):
        check_resumable(state, spec, 6, tmp_path, other)


def test_a_refused_resume_names_the_setting_that_matters_first(tmp_path):
    """It listed every difference, the cause among its consequences: another method's options
    after the method, the vocabulary size and four sha256 sums before the data."""
    interrupted(tmp_path, "method=rope", at=2)
    state = read_checkpoint(list_checkpoints(tmp_path)[-1])
    vocab = state["model_config"]["vocab_size"]
    alibi = build_spec(compose_config("train", [*QUICK_TRAIN, "method=alibi", "seed=3"]))
    alibi = replace(alibi, model=replace(alibi.model, vocab_size=vocab))
    with pytest.raises(PosbenchError) as refused:
        check_resumable(state, alibi, 6, tmp_path, state["data_identity"])
    assert f"{tmp_path} holds a run with method=rope, not method=alibi; seed=0, not seed=3 (method=rope)" in str(refused.value)
    rope = build_spec(compose_config("train", [*QUICK_TRAIN, "method=rope", "trainer.lr=0.5"]))
    rope = replace(rope, model=replace(rope.model, vocab_size=vocab + 1))  # other data, so another vocabulary
    other = {key: "0" * 64 for key in state["data_identity"]}
    with pytest.raises(PosbenchError) as refused:
        check_resumable(state, rope, 6, tmp_path, other)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path} holds a run with other data (its tokenizer, train, validation"), message
    assert "differ: another data setting or changed text); trainer.lr=0.001, not trainer.lr=0.5 (" in message
    assert "vocab_size" not in message and "0" * 64 not in message


def test_resume_refuses_a_change_of_randomized_positions(tmp_path):
    interrupted(tmp_path, "method=rope", "positions.randomize_max=128", at=2)
    with pytest.raises(PosbenchError, match="positions.randomize_max=128, not positions.randomize_max=off"):
        run_train(tmp_path, "method=rope")


# --------------------------------------------------------------- a damaged results.json


@pytest.mark.slow
def test_a_damaged_results_json_is_quarantined_and_recomputed(trained_run):
    run_dir = trained_run("method=alibi")
    first = results_of(run_dir)
    (run_dir / "results.json").write_text('{"schema_version": 1, "meth')
    lines = []
    again = run_train(run_dir, "method=alibi", log=lines.append)
    assert (run_dir / "results.json.corrupt").exists() and status_of(run_dir)["status"] == "completed"
    assert again["eval"][0]["bands"] == pytest.approx(first["eval"][0]["bands"])
    assert any("moved it aside" in line for line in lines)
    (run_dir / "results.json").write_text("[1, 2]")  # valid JSON, not results: eval recomputes too
    assert evaluate(run_dir)["eval"][0]["bands"] == pytest.approx(first["eval"][0]["bands"])


@pytest.mark.slow
def test_a_damaged_metrics_line_does_not_break_resume(tmp_path):
    interrupted(tmp_path, "method=nope", at=4)
    metrics = tmp_path / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    metrics.write_text("\n".join([rows[0], "[1, 2]", "7", *rows[1:]]) + "\n")
    results = run_train(tmp_path, "method=nope")
    assert results["train"]["resumed_from_step"] == 4
    assert (tmp_path / "metrics.jsonl.corrupt").exists()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 6


# ------------------------------------------------------------ an overwritten checkpoint


@pytest.mark.slow
def test_a_checkpoint_with_overwritten_bytes_is_caught_and_the_previous_one_used(tmp_path):
    interrupted(tmp_path, "method=rope", "trainer.checkpoint_every_steps=2", at=4)
    newest = list_checkpoints(tmp_path)[-1]
    state = read_checkpoint(newest)["model"]
    tensor = next(t for t in state.values() if t.dtype == torch.float32 and t.numel() >= 64)
    data = newest.read_bytes()
    original = tensor.flatten()[:16].numpy().tobytes()
    assert data.count(original) == 1
    newest.write_bytes(data.replace(original, b"\xff\xff\xc0\x7f" * 16))  # NaNs, same size and shape
    lines = []
    results = run_train(tmp_path, "method=rope", "trainer.checkpoint_every_steps=2", log=lines.append)
    assert results["train"]["resumed_from_step"] == 2
    assert any("sha256" in line for line in lines), lines


@pytest.mark.slow
def test_token_ids_past_the_vocabulary_are_refused_when_the_data_is_opened(tmp_path):
    import numpy as np

    from posbench.data import prepare_data
    from posbench.runs.spec import data_config

    cfg = compose_config("train", [*QUICK_TRAIN, f"data.cache_dir={tmp_path}"])
    prepared = prepare_data(data_config(cfg.data), log=lambda _: None)
    path = prepared.dir / prepared.meta["splits"]["train"]["file"]
    tokens = np.memmap(path, dtype=prepared.dtype, mode="r+")
    tokens[5] = np.iinfo(prepared.dtype).max  # flipped bits: same size, an id past the vocabulary
    tokens.flush()
    del tokens
    with pytest.raises(PosbenchError, match="past the vocabulary"):
        prepare_data(data_config(cfg.data), log=lambda _: None)


def test_a_config_that_is_non_finite_from_the_start_is_not_blamed_on_the_learning_rate(tmp_path):
    with pytest.raises(PosbenchError) as err:
        run_train(tmp_path, "method=rope", "method.base=-1")
    assert "lower trainer.lr" not in str(err.value) and "method" in str(err.value)


# ------------------------------------------------------------ what cannot fit in memory


@pytest.mark.parametrize("override", ["model.n_layers=100000000", "trainer.batch_size=100000000"])
def test_what_cannot_fit_in_memory_is_refused_before_building(tmp_path, override):
    with pytest.raises(PosbenchError, match="this run needs at least .* GiB"):
        run_train(tmp_path, "method=nope", override)
    assert status_of(tmp_path)["status"] == "failed"


@pytest.mark.parametrize("error, message", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"), "out of memory"),
    (OSError(errno.ENOSPC, "No space left on device", "step_00000002.pt"), "no space left on the device"),
])
def test_out_of_memory_and_a_full_disk_end_in_one_line(tmp_path, monkeypatch, error, message):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(Trainer, "save_checkpoint", fail)
    with pytest.raises(PosbenchError, match=message) as err:
        run_train(tmp_path, "method=nope")
    assert len(str(err.value).splitlines()) == 1
    assert status_of(tmp_path)["status"] == "failed"


# ----------------------------------------------------------- stray temporary files


@pytest.mark.slow
def test_stray_temporary_files_of_a_killed_write_are_removed_at_the_next_start(tmp_path):
    interrupted(tmp_path, "method=nope", at=4)
    stray = [tmp_path / "checkpoints" / ".tmp-step_00000006.pt.x1y2", tmp_path / ".tmp-results.json.abcd"]
    for path in stray:
        path.write_bytes(b"\0" * 1000)
    run_train(tmp_path, "method=nope")
    assert not any(path.exists() for path in stray)


# ---------------------------------------------------------- validation scores the band past C


@pytest.mark.slow
def test_validation_also_scores_the_band_past_the_training_context(tmp_path, monkeypatch):
    import posbench.train.loggers

    logged = {}
    make_logger = posbench.train.loggers.make_logger

    def recording_logger(*args, **kwargs):
        real = make_logger(*args, **kwargs)
        log_metrics = real.log_metrics
        real.log_metrics = lambda metrics, step: (logged.setdefault(step, {}).update(metrics), log_metrics(metrics, step))
        return real

    monkeypatch.setattr(posbench.train.loggers, "make_logger", recording_logger)
    run_train(tmp_path, "method=alibi", "trainer.val_every=3", "trainer.val_extrapolation_sequences=2")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    validation = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in validation] == [3, 6]
    assert all(0 < r["val_loss_32_64"] < 20 for r in validation)
    assert logged[3]["val/loss_32_64"] == validation[0]["val_loss_32_64"] and "val/loss" in logged[3]
    run_train(tmp_path / "off", "method=alibi", "trainer.val_extrapolation_sequences=0")
    rows = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()]
    assert not any("val_loss_32_64" in r for r in rows)
