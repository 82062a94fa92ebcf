"""Task runs end to end: the CLI trains a task and plots it, micro-batching, resume (the
generators and their evaluation: tests/unit/tasks/)."""

from __future__ import annotations

import csv
import io
import json

import pytest
from helpers import QUICK_TASK, compose_config, posbench_cli

from posbench.core.errors import PosbenchError
from posbench.evaluation.stats import bootstrap_interval
from posbench.report.tasks import interval, task_tables
from posbench.runs.run_record import RunRecord
from posbench.train.trainer import train


@pytest.mark.slow
def test_cli_trains_a_task_and_plots_two_runs(tmp_path):
    runs = [tmp_path / f"s{seed}" for seed in (0, 1)]
    learnt = "task.learnt_at_c=0"  # 4 steps learn nothing: let the gate pass both seeds into the tables
    posbench_cli("train", "task=copy", "method=alibi", "seed=0", *QUICK_TASK, learnt, f"hydra.run.dir={runs[0]}")
    lines: list[str] = []
    train(compose_config("train", ["task=copy", "method=alibi", "seed=1", *QUICK_TASK, learnt]), runs[1], log=lines.append)
    (start,) = [line for line in lines if line.startswith("training copy-alibi-s1:")]
    assert "4 steps x 256 tokens (fresh data every step)" in start and "steps/epoch" not in start  # was "(1 steps/epoch)"
    results = json.loads((runs[0] / "results.json").read_text())
    assert results["eval"] == [] and results["task"]["name"] == "copy" and results["method"] == "alibi"
    entries = [e for e in results["task"]["entries"] if e["test_set"] == "standard"]
    assert [e["length"] for e in entries] == [32, 64, 128] and all(e["extension"] == "none" for e in entries)
    assert set(entries[-1]["by_position"]) == {"0-32", "32-64", "64-128"}
    assert 0.0 <= entries[0]["accuracy"]["mean"] <= 1.0 and "exact_match" in entries[0]
    assert results["model"]["vocab_size"] == 18 and results["data"]["meta"]["task"] == "copy"
    metrics = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert any("val_accuracy" in m and "val_accuracy_32_64" in m for m in metrics)
    out = tmp_path / "comparison"
    posbench_cli("plot", f"runs=[{runs[0]},{runs[1]}]", f"out={out}")
    assert (out / "tasks_copy.png").stat().st_size > 0
    table = (out / "tasks.md").read_text()
    assert "| alibi | 2 |" in table and "t over 2 seeds" in table and "exact_match" in table
    rows = list(csv.DictReader(io.StringIO((out / "tasks.csv").read_text())))
    assert {r["task"] for r in rows} == {"copy"} and {r["group"] for r in rows} == {"alibi"}
    assert json.loads(rows[0]["options"]) == results["task"]["options"]  # the options column is JSON
    overall = [r for r in rows if r["metric"] == "accuracy" and r["positions"] == "all" and r["test_set"] == "standard"]
    assert [int(r["length"]) for r in overall] == [32, 64, 128]
    assert all(r["seeds"] == "2" and r["interval"] == "t" for r in overall)

    # One seed: the bootstrap over the run's sequences (the interval its results.json stored).
    one = [RunRecord(runs[0], results)]
    table = task_tables(one)[0]
    for entry in entries:
        got = interval(table.groups["alibi"], "accuracy", entry["length"])
        assert got == bootstrap_interval(entry["sequence_accuracy"])
        got = interval(table.groups["alibi"], "exact_match", entry["length"])
        assert got == bootstrap_interval(entry["sequence_exact_match"])
        for bucket, value in entry["by_position"].items():
            band = interval(table.groups["alibi"], "accuracy", entry["length"], bucket)
            assert (band is None) == (value["mean"] is None)  # a bucket without answers has no value
            assert band is None or (band.mean, band.low, band.kind) == (value["mean"], value["low"], value["kind"])


@pytest.mark.slow
def test_the_training_loss_does_not_depend_on_the_micro_batching(tmp_path):
    """Micro-batches hold unequal numbers of answers: the mean of their means is not the batch's
    mean over answers, so trainer.micro_batch_size (a memory setting) changed the objective."""
    quick = ["task=flipflop", "method=nope", *QUICK_TASK, "trainer.max_steps=1", "trainer.log_every=1",
             "eval.lengths=[32,64]", "eval.num_sequences=2"]
    losses = []
    for micro in (8, 2):
        train(compose_config("train", [*quick, f"trainer.micro_batch_size={micro}"]), tmp_path / str(micro),
              log=lambda _: None)
        rows = [json.loads(line) for line in (tmp_path / str(micro) / "metrics.jsonl").read_text().splitlines()]
        losses.append(next(r["loss"] for r in rows if "loss" in r))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=0)


@pytest.mark.slow
def test_a_stopped_task_run_resumes_to_the_uninterrupted_result(tmp_path):
    from posbench.commands.eval import evaluate_saved_run
    from posbench.train.trainer import TrainingInterrupted

    quick = ["task=flipflop", "method=rope", *QUICK_TASK, "trainer.checkpoint_every_steps=2"]
    train(compose_config("train", quick), tmp_path / "whole", log=lambda _: None)
    with pytest.raises(TrainingInterrupted):
        train(compose_config("train", [*quick, "trainer.stop_after_steps=2"]), tmp_path / "split", log=lambda _: None)
    train(compose_config("train", quick), tmp_path / "split", log=lambda _: None)
    whole, split = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("whole", "split"))
    assert split["train"]["resumed_from_step"] == 2
    assert [e["sequence_accuracy"] for e in split["task"]["entries"]] == [e["sequence_accuracy"] for e in whole["task"]["entries"]]
    assert split["train"]["final_loss"] == whole["train"]["final_loss"]
    # a resumed run must keep its task: another p_ignore is refused
    with pytest.raises(PosbenchError, match="its task differs"):
        train(compose_config("train", [*quick, "task.p_ignore=0.5", "trainer.max_steps=6"]), tmp_path / "split",
              log=lambda _: None)
    from omegaconf import OmegaConf

    with pytest.raises(PosbenchError, match="is a task run .task=flipflop.: posbench eval adds entries to text runs only"):
        evaluate_saved_run(OmegaConf.create({"run": str(tmp_path / "whole"), "device": "cpu"}), log=lambda _: None)
