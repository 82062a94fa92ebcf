"""Shared pytest fixtures. (Helpers to import are in helpers.py and model_checks.py.)"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import run_train

# Test models are tiny: one thread avoids oversubscribing a 2-core CI machine, where torch's
# default threading made single steps ~100x slower under load. Subprocesses inherit the env.
torch.set_num_threads(1)
import os as _os  # noqa: E402

_os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def sample_data() -> Path:
    """The TinyStories sample shipped inside the package (real text: train.txt.gz,
    valid.txt.gz); always present, so tests using it never skip."""
    from posbench.data.sources import SAMPLE_DIR

    assert (SAMPLE_DIR / "train.txt.gz").is_file(), f"{SAMPLE_DIR} lacks train.txt.gz: a broken install"
    return SAMPLE_DIR


@pytest.fixture
def tiny_corpus() -> dict[str, list[str]]:
    """A few short stories per split, with the distinct story texts tests can look for."""
    names = ["Lily", "Ben", "Tom", "Mia", "Sam", "Max"]
    train = [
        f"Once upon a time, {n} had a red ball.\n{n} played in the park with a dog. "
        f"The dog was happy and {n} was happy too. Story number {i}."
        for i, n in enumerate(names * 5)
    ]
    valid = [f"One day, {n} saw a big bird near the lake. Validation story {i}." for i, n in enumerate(names)]
    return {"train": train, "validation": valid}


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory):
    """Every test shares one token cache in a temp dir, never the user's ~/.cache/posbench: the
    `posbench` subprocesses too (helpers.ENV, their environment, was made before this cache)."""
    import os

    import helpers

    cache = tmp_path_factory.mktemp("posbench-cache")
    old = os.environ.get("POSBENCH_CACHE")
    for env in (os.environ, helpers.ENV):
        env["POSBENCH_CACHE"] = str(cache)
    os.environ.setdefault("MPLBACKEND", "Agg")
    yield cache
    for env in (os.environ, helpers.ENV):
        if old is None:
            env.pop("POSBENCH_CACHE", None)
        else:
            env["POSBENCH_CACHE"] = old


@pytest.fixture(scope="session")
def finished_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, ...], Path]:
    """The quick tiny runs trained so far in this session, by their overrides (trained_run's store)."""
    return {}


@pytest.fixture
def trained_run(finished_runs: dict[tuple[str, ...], Path], tmp_path_factory: pytest.TempPathFactory,
                tmp_path: Path) -> Callable[..., Path]:
    """``trained_run(*overrides)``: a finished quick tiny run (helpers.QUICK_TRAIN, then
    ``overrides``) of the test's own, in ``tmp_path/run`` (``run-1``, ... for more). Each distinct
    list of overrides trains once per pytest run; every call gets a fresh copy of that run directory,
    which the test may change. For tests that inspect or re-evaluate a finished run, not for those
    that watch the training itself (its log lines, its return value, a fault injected mid-run)."""
    copies = 0

    def make(*overrides: str) -> Path:
        nonlocal copies
        if overrides not in finished_runs:
            run_dir = tmp_path_factory.mktemp("trained") / "run"
            run_train(run_dir, *overrides)
            finished_runs[overrides] = run_dir
        copy = tmp_path / ("run" if copies == 0 else f"run-{copies}")
        copies += 1
        return Path(shutil.copytree(finished_runs[overrides], copy))

    return make
