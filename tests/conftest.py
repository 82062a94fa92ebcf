"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# Test models are tiny: one thread avoids oversubscribing a 2-core CI machine, where torch's
# default threading made single steps ~100x slower under load. Subprocesses inherit the env.
torch.set_num_threads(1)
import os as _os

_os.environ.setdefault("OMP_NUM_THREADS", "1")


def assert_matches_reference(actual: torch.Tensor, expected: torch.Tensor, *, method: str, reference: str,
                             atol: float | None = None, rtol: float | None = None) -> None:
    """``torch.testing.assert_close`` for a method checked against an independent reference,
    which also records the largest absolute difference when ``POSBENCH_REFERENCE_LOG`` names a
    file: ``scripts/reference_table.py`` runs these tests and tabulates the measured maxima."""
    import json

    log = _os.environ.get("POSBENCH_REFERENCE_LOG")
    if log:
        diff = (actual.detach().double() - expected.detach().double()).abs()
        record = {"method": method, "reference": reference, "dtype": str(actual.dtype).replace("torch.", ""),
                  "max_abs_diff": float(diff.max()) if diff.numel() else 0.0, "elements": diff.numel(),
                  "atol": atol, "rtol": rtol, "test": _os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


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
    """Every test shares one token cache in a temp dir, never the user's ~/.cache/posbench."""
    import os

    cache = tmp_path_factory.mktemp("posbench-cache")
    old = os.environ.get("POSBENCH_CACHE")
    os.environ["POSBENCH_CACHE"] = str(cache)
    os.environ.setdefault("MPLBACKEND", "Agg")
    yield cache
    if old is None:
        os.environ.pop("POSBENCH_CACHE", None)
    else:
        os.environ["POSBENCH_CACHE"] = old


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
]


def compose_config(name: str, overrides: list[str]):
    """Compose a shipped primary config (train, eval, ...) the way the CLI does."""
    from hydra import compose, initialize_config_dir

    from posbench.config import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)
