"""posbench viz end to end: the CLI on a method, on runs and sweeps, W&B, task runs (the
measures and settings: tests/unit/viz/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import QUICK_TRAIN, compose_config, posbench_cli

from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims
from posbench.viz.command import run_viz

DIMS = ModelDims(d_model=32, n_heads=4, n_layers=2)


@pytest.mark.slow
def test_viz_method_cli_needs_no_training(tmp_path):
    out = tmp_path / "sin"
    proc = posbench_cli("viz", "method=sinusoidal", f"out={out}", "formats=[png,svg]")
    for stem in ("position_table", "position_similarity"):
        assert (out / f"{stem}.png").stat().st_size > 1000 and (out / f"{stem}.svg").is_file()
    assert "wrote" in proc.stdout + proc.stderr
    written = run_viz(compose_config("viz", ["method=alibi", "model=tiny", f"out={tmp_path / 'alibi'}"]),
                      log=lambda _: None)
    assert written == [tmp_path / "alibi" / "score_terms.png"]


@pytest.mark.slow
def test_viz_is_a_listed_command_and_errors_are_one_line(tmp_path):
    from posbench.commands.cli import usage
    from posbench.core.errors import PosbenchError

    assert "\n  viz " in usage()
    proc = posbench_cli("viz", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "posbench viz: error: posbench viz needs method=<name> (no training) or run=<run or sweep directory>")
    with pytest.raises(PosbenchError, match="is not a directory"):
        run_viz(compose_config("viz", [f"run={tmp_path / 'missing'}"]))
    with pytest.raises(PosbenchError, match="unknown decay rule 'nonsense'"):
        run_viz(compose_config("viz", ["method=rope", "decay.rules=[nonsense]"]))
    with pytest.raises(PosbenchError, match="not both"):
        run_viz(compose_config("viz", ["method=rope", f"run={tmp_path}"]))
    with pytest.raises(PosbenchError, match="unsupported figure format"):
        run_viz(compose_config("viz", ["method=rope", "formats=[jpg]"]))


@pytest.fixture(scope="module")
def trained_sweep(tmp_path_factory) -> Path:
    """Two tiny trained runs (learned, relative) in one sweep-like folder."""
    from posbench.train.trainer import train

    sweep = tmp_path_factory.mktemp("sweep")
    for i, method in enumerate(("learned", "relative")):
        train(compose_config("train", [*QUICK_TRAIN, f"method={method}"]), sweep / f"{i}_{method}-s0",
              log=lambda _: None)
    return sweep


@pytest.mark.slow
def test_viz_run_cli(trained_sweep, tmp_path):
    run = trained_sweep / "0_learned-s0"
    posbench_cli("viz", f"run={run}", "attention.num_sequences=2")
    out = run / "figures" / "viz"
    for stem in ("position_table", "position_similarity", "attention_maps_layer0", "attention_maps_layer1",
                 "attention_entropy_distance"):
        assert (out / f"{stem}.png").stat().st_size > 1000, stem


@pytest.mark.slow
def test_viz_sweep_overview_and_content_dependent_score(trained_sweep, tmp_path):
    out = tmp_path / "viz"
    cfg = compose_config("viz", [f"run={trained_sweep}", f"out={out}", "attention.num_sequences=2",
                                 "attention.length_factor=4"])
    written = run_viz(cfg, log=lambda _: None)
    assert out / "overview.png" in written
    assert (out / "1_relative-s0" / "score_terms.png").is_file()  # from real queries of the run
    assert not (out / "0_learned-s0" / "score_terms.png").exists()


@pytest.mark.slow
def test_figures_go_to_the_runs_wandb_run(tmp_path, monkeypatch):
    """Offline: the figures are logged by resuming the W&B run id recorded in the run dir."""
    from omegaconf import OmegaConf

    from posbench.train.wandb_session import wandb_init
    from posbench.viz.command import log_to_wandb

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    run_dir = tmp_path / "run"
    first = wandb_init(mode="offline", dir=run_dir, project="posbench", name="alibi-s0")
    run_id = first.id
    first.finish()
    written = run_viz(compose_config("viz", ["method=alibi", "model=tiny", f"out={run_dir / 'figures'}"]),
                      log=lambda _: None)
    config = OmegaConf.create({"logger": {"name": "wandb", "mode": "offline", "project": "posbench"}})
    messages: list[str] = []
    assert log_to_wandb(run_dir, config, written, messages.append), messages
    assert messages == [f"logged 1 figures to W&B run {run_id} (offline)"]
    # W&B names offline run folders by start second and id, adding "-1" when a second W&B run of
    # the id starts within the same second (the plain glob missed that folder on fast machines).
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2  # the training run's and the one that added the figures, same id
    assert list(runs[-1].glob("files/media/images/viz/score_terms_*.png"))
    # No W&B run recorded (or logger=none): nothing happens.
    assert not log_to_wandb(tmp_path / "elsewhere", config, written, messages.append)


@pytest.mark.slow
def test_sweep_callback_adds_the_viz_pictures(trained_sweep):
    from omegaconf import OmegaConf

    from posbench.commands.sweep import ComparePlotsCallback

    ComparePlotsCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(trained_sweep)}}}))
    viz = trained_sweep / "comparison" / "viz"
    assert (viz / "overview.png").is_file() and (viz / "1_relative-s0" / "attention_entropy_distance.png").is_file()
    assert (trained_sweep / "comparison" / "loss_by_position.png").is_file()  # posbench plot's, as before


@pytest.mark.slow
def test_qk_decay_of_a_run_is_titled_as_analytic_not_by_step(tmp_path, monkeypatch, trained_run):
    """Rope's q.k decay comes from its definition, so naming the run's step
    (``rope, step 400``) misleads; a method with trained q/k parameters keeps the step."""
    import posbench.viz.draw as viz

    titles = []
    original = viz.qk_decay_figure
    monkeypatch.setattr(viz, "qk_decay_figure", lambda curves, context, title: titles.append(title)
                        or original(curves, context, title))
    run = trained_run("method=rope").rename(tmp_path / "rope-s0")
    run_viz(compose_config("viz", [f"run={run}", f"out={tmp_path / 'viz'}", "attention.num_sequences=2"]),
            log=lambda _: None)
    (title,) = titles
    assert "step" not in title.split("\n")[0] and "analytic" in title and title.startswith("rope")


@pytest.mark.slow
def test_viz_of_a_task_run_draws_attention_on_its_task_sequences(tmp_path, monkeypatch, trained_run):
    """A task run (task=flipflop) has no text: viz asked the hub for TinyStories and told the
    user to use data=sample. Its attention is now measured on the task's own held-out sequences."""
    from posbench.runs.load import load_run
    from posbench.tasks.base import VALID, make_task
    from posbench.viz import attention as viz
    from posbench.viz.settings import AttentionSettings

    run_dir = trained_run("task=flipflop", "method=rope").rename(tmp_path / "flipflop-rope-s0")

    def no_text(*args, **kwargs):
        raise AssertionError("a task run has no text to load")

    monkeypatch.setattr(viz, "run_data", no_text)
    run = load_run(run_dir)
    settings = AttentionSettings(num_sequences=2)
    tokens, where = viz.held_out_windows(run, 64, settings, log=lambda _: None)
    expected, _ = make_task(run.config.task, 32).sequences(VALID, 64, 2).inputs_targets()
    assert torch.equal(tokens, expected) and tokens.shape == (2, 64)
    assert where == "2 held-out flipflop sequences (validation) of 64 tokens"
    written = run_viz(compose_config("viz", [f"run={run_dir}", "attention.num_sequences=2", "wandb=false"]),
                      log=lambda _: None)
    assert {p.stem for p in written} >= {"attention_maps_layer0", "attention_entropy_distance"}
    with pytest.raises(PosbenchError, match="attention.split=train is not held out"):
        viz.held_out_windows(run, 64, AttentionSettings(split="train"), log=lambda _: None)
