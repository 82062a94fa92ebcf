"""Recurrent and hybrid models end to end: state passing trains, is recorded and resumes bitwise;
evaluation past the context, the probes and the tasks run for them; a bad combination is one line."""

from __future__ import annotations

import pytest
import torch
from helpers import QUICK_TASK, compose_config, posbench_cli, run_eval, run_train

from posbench.core.errors import PosbenchError
from posbench.runs.checkpoint import list_checkpoints, read_checkpoint
from posbench.train.state_passing import StatePassing
from posbench.train.trainer import TrainingInterrupted, train

GDN = ["method=nope", "model.mixer=gated_deltanet"]
HYBRID = ["method=rope", "model.mixer=[gated_deltanet,attention]"]


def final_weights(run_dir):
    return read_checkpoint(list_checkpoints(run_dir)[-1])["model"]


def same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_state_passing_resumes_bitwise_and_is_recorded(tmp_path, monkeypatch):
    """A run stopped mid-stream and resumed equals the straight run bit for bit: the checkpoint
    holds the carried state. A resume that forgets it (the state starts at zero) does not."""
    common = [*GDN, "trainer.state_passing=carry", "trainer.max_steps=8"]
    straight = run_train(tmp_path / "straight", *common)
    assert straight["train"]["state_passing"] == {"mode": "carry"}
    assert straight["model"]["mixer"] == "gated_deltanet"
    with pytest.raises(TrainingInterrupted):
        run_train(tmp_path / "split", *common, "trainer.stop_after_steps=4")
    assert "state_passing" in read_checkpoint(list_checkpoints(tmp_path / "split")[-1])
    resumed = run_train(tmp_path / "split", *common)
    assert resumed["train"]["resumed_from_step"] == 4
    assert resumed["train"]["final_loss"] == straight["train"]["final_loss"]
    assert same_weights(final_weights(tmp_path / "straight"), final_weights(tmp_path / "split"))

    with pytest.raises(TrainingInterrupted):
        run_train(tmp_path / "forgetful", *common, "trainer.stop_after_steps=4")
    monkeypatch.setattr(StatePassing, "load_state_dict", lambda self, saved: None)
    run_train(tmp_path / "forgetful", *common)
    assert not same_weights(final_weights(tmp_path / "straight"), final_weights(tmp_path / "forgetful"))


@pytest.mark.slow
def test_state_passing_changes_training_and_noise_is_recorded(tmp_path):
    off = run_train(tmp_path / "off", *GDN)
    noise = run_train(tmp_path / "noise", *GDN, "trainer.state_passing=noise", "trainer.state_noise=0.5")
    assert "state_passing" not in off["train"]
    assert noise["train"]["state_passing"] == {"mode": "noise", "noise": 0.5}
    assert noise["train"]["final_loss"] != off["train"]["final_loss"]


@pytest.mark.slow
def test_hybrid_run_evaluates_to_8c_with_the_probes_and_extensions(tmp_path):
    results = run_train(tmp_path, *HYBRID, "eval.lengths=[64,256]", "eval.extension=[none,yarn,window]",
                        "eval.probes=[copy,passkey]", "eval.copy.distances=[8,40]", "eval.copy.span=4",
                        "eval.copy.num_windows=2", "eval.copy.kinds=[random]", "eval.passkey.lengths=[64]",
                        "eval.passkey.depths=[0.0]", "eval.passkey.num_windows=2")
    entries = {(e["length"], e["extension"]): e for e in results["eval"]}
    assert set(entries) == {(L, x) for L in (64, 256) for x in ("none", "yarn", "window")}
    assert "128-256" in entries[256, "none"]["bands"]  # 4C-8C of C = 32
    assert entries[256, "none"]["windowed"] is not None  # the windowed twin: a fresh state every window
    assert {p["extension"] for p in results["probes"]} == {"none", "yarn", "window"}
    assert results["passkey"]


@pytest.mark.slow
def test_a_recurrent_model_takes_no_extension(tmp_path):
    """Every extension changes attention (window and log_scaling apply to nope, and changed
    nothing but the time spent): ``all`` evaluates the plain model only."""
    results = run_train(tmp_path, *GDN, "eval.extension=all")
    assert {e["extension"] for e in results["eval"]} == {"none"}
    # posbench eval of the saved run: the same rule (it evaluated window and log_scaling entries)
    again = run_eval(tmp_path, "eval.lengths=[128]", "eval.num_sequences=2", "eval.extension=all")
    assert {(e["length"], e["extension"]) for e in again["eval"]} == {(64, "none"), (128, "none")}
    with pytest.raises(PosbenchError, match="no attention layer"):
        run_eval(tmp_path, "eval.lengths=[128]", "eval.num_sequences=2", "eval.extension=[window]")


@pytest.mark.slow
@pytest.mark.parametrize("task", ["flipflop", "assoc_recall", "copy"])
def test_task_runs_train_a_recurrent_model(tmp_path, task):
    cfg = compose_config("train", [*QUICK_TASK, f"task={task}", "method=nope", "model.mixer=mamba2",
                                   "trainer.state_passing=noise"])
    results = train(cfg, tmp_path, log=lambda _: None)
    assert results["task"] and results["model"]["mixer"] == "mamba2"


@pytest.mark.parametrize("overrides, match", [
    (["method=rope", "model.mixer=mamba2"], "use method=nope"),
    (["method=rope", "trainer.state_passing=carry"], "has none; set model.mixer"),
    (["method=nope", "model.mixer=mamba2", "task=flipflop", "trainer.state_passing=carry"], "are independent"),
    (["method=nope", "model.mixer=mamba2", "trainer.state_passing=always"], "must be one of off, carry, noise"),
    (["method=nope", "model.mixer=mamba2", "eval.extension=[window]"], "no attention layer .model.mixer.; use eval"),
])
def test_bad_combinations_are_refused_before_training(tmp_path, overrides, match):
    with pytest.raises(PosbenchError, match=match):
        run_train(tmp_path, *overrides)


@pytest.mark.slow
def test_cpu_quick_smoke_of_every_mixer(tmp_path):
    """``posbench train experiment=cpu_quick model=tiny`` as a user runs it, 20 steps, with a
    model holding each mixer: mamba2, gated_deltanet and attention (rope) layers."""
    posbench_cli("train", "experiment=cpu_quick", "model=tiny", "model.n_layers=3",
                 "model.mixer=[mamba2,gated_deltanet,attention]", "method=rope", "trainer.max_steps=20",
                 "trainer.batch_size=4", "trainer.val_every=0", "trainer.checkpoint_every_steps=0",
                 "eval.lengths=[512]", "eval.num_sequences=4", "eval.figures=false", "trainer.progress=false",
                 f"hydra.run.dir={tmp_path}")
    assert (tmp_path / "results.json").is_file()
