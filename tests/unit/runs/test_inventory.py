"""``posbench runs``' reading of finished records (posbench.runs.inventory): a text run's headline
band, a task run's verdict at C, a run without a status, a folder that is not one."""

from __future__ import annotations

import pytest

from posbench.core.errors import PosbenchError
from posbench.runs.inventory import list_runs, run_state
from posbench.runs.results import build_results, write_results
from posbench.runs.status import write_status

TRAIN = {"tokens": 6400, "steps": 20, "final_loss": 2.5, "tokens_per_second": 1e4, "wall_seconds": 1.0, "device": "cpu"}


def finished(path, **extra):
    path.mkdir(parents=True)
    write_results(path, build_results(method="rope", seed=0, train_context=64, train=TRAIN, **extra))
    write_status(path, "completed", method="rope", seed=0)
    return path


def test_a_finished_text_run_shows_its_c_to_2c_band_of_the_training_time_entry(tmp_path):
    entries = [{"split": "validation", "length": 128, "num_sequences": 4, "loss_by_position": [3.0] * 128,
                "bands": {"0-64": 3.1, "64-128": 3.25}},
               {"split": "validation", "length": 256, "num_sequences": 4, "loss_by_position": [3.0] * 256,
                "bands": {"0-64": 3.0, "64-128": 9.0}, "added": True}]  # a later length: never the headline
    state = run_state(finished(tmp_path / "run", eval=entries))
    assert (state.state, state.detail, state.headline) == ("finished", "20 steps, 64-128 loss 3.2500", 3.25)


def test_a_finished_task_run_says_whether_it_learnt_its_task(tmp_path):
    verdict = {"test_set": "standard", "length": 64, "metric": "accuracy", "threshold": 0.95, "value": 0.706,
               "learnt": False}
    run = finished(tmp_path / "task", eval=[], task={"name": "flipflop", "entries": [], "learnt_at_c": verdict})
    assert run_state(run).detail == "20 steps, task flipflop, not learnt at C (0.706 < 0.95)"
    (tmp_path / "task" / "status.json").unlink()
    assert run_state(run).detail.endswith("not learnt at C (0.706 < 0.95) (no status.json)")


def test_an_empty_folder_and_a_missing_one(tmp_path):
    assert list_runs(tmp_path).text() == f"no runs under {tmp_path} (no status.json, results.json or config.yaml found)\n"
    with pytest.raises(PosbenchError, match="is not a folder"):
        list_runs(tmp_path / "missing")
