"""DroPE trained end to end (method=drope): the switch recorded in results.json, and a run resumed
across it is the uninterrupted run bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_train

from posbench.runs.checkpoint import list_checkpoints, read_checkpoint
from posbench.train.trainer import TrainingInterrupted


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [2, 4])
def test_resumed_across_the_switch_is_the_uninterrupted_run(tmp_path, stop_at):
    """drop_step 3 of 6 steps: a run stopped before the switch (2) or after it (4) and resumed
    gives bitwise the uninterrupted run's weights, losses and results; results.json records the switch."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ["method=drope", "method.drop_step=3"]
    full = run_train(straight, *common)
    assert full["train"]["position_dropped_after_step"] == 3 and full["method_options"]["drop_step"] == 3
    with pytest.raises(TrainingInterrupted):
        run_train(split, *common, f"trainer.stop_after_steps={stop_at}")
    resumed = run_train(split, *common)
    assert resumed["train"]["resumed_from_step"] == stop_at
    assert resumed["train"]["final_loss"] == full["train"]["final_loss"]
    assert resumed["train"]["position_dropped_after_step"] == 3
    a = read_checkpoint(list_checkpoints(straight)[-1])["model"]
    b = read_checkpoint(list_checkpoints(split)[-1])["model"]
    assert a.keys() == b.keys() and int(a["position.steps_done"]) == 6
    for key in a:
        assert torch.equal(a[key], b[key]), key

    def losses(d):
        return [json.loads(line).get("loss") for line in (d / "metrics.jsonl").read_text().splitlines()]

    assert losses(straight) == losses(split)
    assert [e["bands"] for e in resumed["eval"]] == [e["bands"] for e in full["eval"]]


@pytest.mark.slow
def test_a_run_that_never_reaches_the_drop_records_none_and_is_its_base(tmp_path):
    drope = run_train(tmp_path / "drope", "method=drope", "method.drop_step=100")
    rope = run_train(tmp_path / "rope", "method=rope")
    assert "position_dropped_after_step" not in drope["train"]
    assert drope["train"]["final_loss"] == rope["train"]["final_loss"]


@pytest.mark.slow
def test_a_drope_that_forgets_its_steps_on_resume_fails_the_comparison(tmp_path, monkeypatch):
    """The mutation: the step count not restored from the checkpoint (the resumed run counts from
    0, so it trains steps 5-6 with rope again); the resumed run is no longer the uninterrupted one."""
    from posbench.methods.drope import DroPE

    common = ["method=drope", "method.drop_step=3"]
    full = run_train(tmp_path / "straight", *common)
    monkeypatch.setattr(DroPE, "sync_steps", lambda self: None)
    with pytest.raises(TrainingInterrupted):
        run_train(tmp_path / "split", *common, "trainer.stop_after_steps=4")
    resumed = run_train(tmp_path / "split", *common)
    assert resumed["train"]["final_loss"] != full["train"]["final_loss"]
