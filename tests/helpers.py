"""What the test files share for runs: the overrides of a quick tiny run, composing a shipped
config, the ``posbench`` command in a subprocess, training and evaluating in-process, and reading a
run's records. (Checks of methods and models are in model_checks.py; fixtures in conftest.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

QUIET = lambda _: None  # noqa: E731  (a log that drops every line)

# The environment of `posbench` subprocesses: one thread, unbuffered output, no W&B.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}


def slow_beyond(values, fast) -> list:
    """Parameters for a check run over every option: those in ``fast`` run in both lanes, the rest
    are marked slow, so the fast lane keeps one case of each kind and the full suite runs them all.
    The test ids are those of plain parametrization."""
    return [value if value in fast else pytest.param(*(value if isinstance(value, tuple) else (value,)),
                                                     marks=pytest.mark.slow) for value in values]


# Overrides that make a full train + eval run take seconds on a CPU.
QUICK_TRAIN = [
    "model=tiny",
    "data=synthetic",
    "trainer.precision=fp32",  # the same arithmetic on every CPU (auto is bf16 where it is native)
    "logger=none",
    "trainer.context=32",
    "trainer.batch_size=4",
    "trainer.max_steps=6",
    "trainer.log_every=2",
    "trainer.val_every=0",
    "trainer.val_sequences=4",
    "trainer.checkpoint_every_steps=0",
    "trainer.checkpoint_every_minutes=0",
    "trainer.warmup_steps=2",
    "eval.lengths=[64]",
    "eval.num_sequences=4",
    "eval.batch_size=4",
    "eval.figures=false",  # the run's figures take most of a quick run's time; a test of them sets eval.figures=true
]


def compose_config(name: str, overrides: list[str]):
    """Compose a shipped primary config (train, eval, ...) the way the CLI does."""
    from hydra import compose, initialize_config_dir

    import posbench.evaluation.probes  # noqa: F401  (registers the probes' eval.<name> sections, as the CLI does)
    from posbench.config import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


# A task run in seconds (trainer.context 32): tests/unit/tasks, tests/integration/test_task_runs.py.
QUICK_TASK = ["logger=none", "trainer.context=32", "trainer.max_steps=4", "trainer.batch_size=8", "trainer.log_every=2",
              "trainer.val_every=2", "trainer.val_sequences=8", "trainer.val_extrapolation_sequences=4",
              "trainer.warmup_steps=1", "trainer.precision=fp32", "eval.lengths=[32,64,128]", "eval.num_sequences=8",
              "eval.batch_size=8", "eval.figures=false"]


def posbench_cli(*args: str, cwd: Path | None = None, env: dict | None = None, check: bool = True,
                 timeout: int = 600) -> subprocess.CompletedProcess:
    """``posbench <args>`` in a subprocess, as a user runs it. With ``check`` a non-zero exit fails
    the test with the command's output; without, the caller inspects the exit and stderr."""
    proc = subprocess.run([sys.executable, "-m", "posbench.commands.cli", *args], capture_output=True, text=True,
                          env=env or ENV, cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


def run_train(run_dir: Path, *overrides: str, log=QUIET, figures: bool = False, **kwargs) -> dict:
    """Train a quick tiny run (QUICK_TRAIN, then ``overrides``) into ``run_dir``; its results.

    The run's figures (``figures/``, drawn after results.json) only with ``figures=True``
    (``eval.figures=true``): drawing them took about three quarters of a quick run's time."""
    from posbench.train.trainer import train

    cfg = compose_config("train", [*QUICK_TRAIN, *overrides, *(["eval.figures=true"] if figures else [])])
    return train(cfg, run_dir, log=log, **kwargs)


def interrupted(run_dir: Path, *overrides: str, at: int = 2) -> None:
    """A quick run stopped (as by a signal) after step ``at``, leaving a checkpoint to resume."""
    from posbench.train.trainer import TrainingInterrupted

    with pytest.raises(TrainingInterrupted):
        run_train(run_dir, *overrides, f"trainer.stop_after_steps={at}")


def run_eval(run_dir: Path, *overrides: str, log=QUIET) -> dict:
    """``posbench eval run=<run_dir>`` in-process, on the CPU, with ``overrides``; its results."""
    from posbench.commands.eval import evaluate_saved_run

    return evaluate_saved_run(compose_config("eval", [f"run={run_dir}", "device=cpu", *overrides]), log=log)


def results_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


def status_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "status.json").read_text())


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (names and bytes): what a command must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def load_script(name: str):
    """``scripts/<name>.py`` as a module, for testing its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_page_is_generated(name: str, edit: tuple[str, str]) -> None:
    """The page ``scripts/<name>.py`` generates is committed as the script renders it (and its
    ``--check`` exits 0), and a hand edit ``edit`` = (old, new) of a generated table is undone."""
    script = load_script(name)
    page = script.PAGE.read_text()
    assert script.render(page) == page, f"{script.PAGE.name} is stale: run python scripts/{name}.py"
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    proc = subprocess.run([sys.executable, str(path), "--check"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    edited = page.replace(*edit)
    assert edited != page and script.render(edited) == page
