"""Adding a task touches its module, its ``configs/task/<name>.yaml`` and its tests, nothing else
(docs/adding-a-task.md): a task defined here, registered with ``@register_task`` and given a task
YAML (in a config folder of its own, on Hydra's search path) trains through the real trainer on
the shared task model preset, is scored against its baselines and drawn by ``posbench plot``,
whose tables show what the task declares: its test sets' notes and a new answer axis."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import compose_config

from posbench.tasks import Batch, Task, list_tasks, register_task, unregister_task
from posbench.tasks.base import STANDARD

NAME = "test_first"
SYMBOLS = 4

TASK_YAML = f"""# @package _global_
# First symbol: the answer at the last position is the sequence's first symbol.
defaults:
  - override /model: task

task:
  name: {NAME}
  seed: 0
experiment_name: tasks
run_name: ${{task.name}}-${{method.name}}-s${{seed}}
trainer:
  context: 16
  max_steps: 6
eval:
  lengths: [16, 32]
"""


class FirstSymbol(Task):
    """A throwaway task: random symbols; the last target is the first symbol (chance 1 / 4)."""

    name = NAME
    vocab = tuple("abcd")
    TEST_NOTES = {STANDARD: "the last target is the sequence's first symbol"}
    AXES = {"reach": "reach to the first symbol"}

    def chance(self) -> float:
        return 1 / SYMBOLS

    def answer_axes(self, batch: Batch) -> dict[str, np.ndarray]:
        """``reach``: how far back the answer's source lies (L - 1 for the last target)."""
        n, length = batch.answers.shape
        return {"reach": np.broadcast_to(np.arange(length), (n, length)).astype(np.int64)}

    def generate(self, rng: np.random.Generator, n: int, length: int, split: str) -> Batch:
        tokens = rng.integers(0, SYMBOLS, size=(n, length + 1))  # (N, L + 1)
        tokens[:, -1] = tokens[:, 0]
        answers = np.zeros((n, length), dtype=bool)
        answers[:, -1] = True  # target L - 1 is the token after the last input: the first symbol
        return Batch(tokens, answers)


@pytest.fixture
def task_configs(tmp_path):
    """The task registered and its YAML in a config folder searched after the shipped ones."""
    register_task(FirstSymbol)
    folder = tmp_path / "configs"
    (folder / "task").mkdir(parents=True)
    (folder / "task" / f"{NAME}.yaml").write_text(TASK_YAML)
    try:
        yield f"hydra.searchpath=[file://{folder}]"
    finally:
        unregister_task(NAME)
    assert NAME not in list_tasks()


def test_a_task_yaml_composes_on_the_shared_task_model(task_configs) -> None:
    from omegaconf import OmegaConf

    from posbench.runs.spec import build_spec

    cfg = compose_config("train", [task_configs, f"task={NAME}", "logger=none"])
    model = OmegaConf.to_container(cfg.model, resolve=True)
    assert model["flavour"] == f"task_{NAME}" and (model["d_model"], model["n_layers"]) == (64, 2)
    spec = build_spec(cfg)
    assert spec.task.name == NAME and spec.task.vocab_size == SYMBOLS and spec.trainer.context == 16


@pytest.mark.slow
def test_a_registered_task_trains_is_scored_and_plotted(task_configs, tmp_path) -> None:
    from posbench.report.plot import plot_runs
    from posbench.runs.results import read_results
    from posbench.train.trainer import train

    run_dir = tmp_path / "run"
    cfg = compose_config("train", [task_configs, f"task={NAME}", "logger=none", "trainer.precision=fp32",
                                   "trainer.batch_size=8", "trainer.val_every=0", "trainer.val_sequences=8",
                                   "trainer.checkpoint_every_steps=0", "trainer.checkpoint_every_minutes=0",
                                   "eval.num_sequences=8", "eval.batch_size=8",
                                   "+task.learnt_at_c=0.0"])  # 6 steps learn nothing: every seed is averaged
    train(cfg, run_dir, log=lambda _: None)
    results = read_results(run_dir)
    assert results["task"]["name"] == NAME and results["model"]["flavour"] == f"task_{NAME}"
    entries = [e for e in results["task"]["entries"] if e.get("extension", "none") == "none"]
    assert sorted({e["length"] for e in entries}) == [16, 32]
    for entry in entries:
        assert 0.0 <= entry["accuracy"]["mean"] <= 1.0 and entry["baselines"]["chance"] == pytest.approx(0.25)
    assert (run_dir / "figures" / f"task_{NAME}.png").is_file()  # the run's own figure (its kind's)
    out = tmp_path / "comparison"
    written = plot_runs([str(run_dir)], out, log=lambda _: None)
    tables = (out / "tasks.md").read_text()
    assert str(out / f"tasks_{NAME}.png") in written["files"] and f"## {NAME} " in tables
    # What the task declares reaches the tables: its test set's note and its answer axis, with
    # the axis's summary row, its band table and its rows in tasks.csv.
    assert "the last target is the sequence's first symbol." in tables
    assert "| *reach: median / p90 / share >= C* | | 15 / 15 / 0.000 | 31 / 31 / 1.000 | tokens | |" in tables
    assert "**accuracy by reach to the first symbol at L=32** (learnt seeds)\n\n| method | 0-16 | 16-32 |" in tables
    assert ",reach:16-32," in (out / "tasks.csv").read_text()
