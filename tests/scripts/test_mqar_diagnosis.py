"""scripts/mqar_diagnosis.py: accuracy by query rank of an MQAR model against the elimination
baseline, and its one-line refusals."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from posbench.tasks.base import make_task

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mqar_diagnosis.py"
spec = importlib.util.spec_from_file_location("mqar_diagnosis", SCRIPT)
mqar_diagnosis = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mqar_diagnosis)

TASK = make_task({"name": "assoc_recall", "num_pairs": 8, "num_keys": 128, "num_values": 128}, 64)


def oracle(x: torch.Tensor) -> np.ndarray:
    """Looks every query key up in the key-value region: the right answer everywhere."""
    x = x.numpy()
    pred = np.zeros_like(x)
    for row in range(len(x)):
        lookup = dict(zip(x[row, 0:16:2], x[row, 1:16:2]))
        for at in range(16, x.shape[1]):
            pred[row, at] = lookup.get(x[row, at], TASK.filler)
    return pred


def eliminator(x: torch.Tensor) -> np.ndarray:
    """Never reads the query key: answers the value of the first pair whose value has not been
    shown after the pairs. The values are labels only, so nothing is ever shown."""
    x = x.numpy()
    pred = np.full_like(x, TASK.filler)
    for row in range(len(x)):
        values = list(x[row, 1:16:2])
        for at in range(16, x.shape[1]):
            if x[row, at] < TASK.num_keys:
                shown = set(x[row, 16:at + 1].tolist())
                pred[row, at] = next(v for v in values if v not in shown)
    return pred


def test_a_lookup_is_right_at_every_rank():
    found = mqar_diagnosis.profile(oracle, TASK, sequences=50)
    assert list(found["accuracy"]) == list(range(8)) and all(a == 1.0 for a in found["accuracy"].values())
    assert found["unqueried"] == 1.0  # the right value always belongs to a key not yet queried


def test_elimination_no_longer_follows_one_over_remaining_keys():
    """With the values as labels only, elimination is a guess among all N values at every rank
    (before, it was 1 / (N - j): 1.0 at the last query)."""
    found = mqar_diagnosis.profile(eliminator, TASK, sequences=400)
    assert all(v == 1 / 8 for v in found["elimination"].values())
    for j in range(8):
        assert abs(found["accuracy"][j] - 1 / 8) < 0.06, (j, found["accuracy"][j])
    assert found["accuracy"][7] < 0.5


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["missing", "text", "flipflop"])
def test_a_missing_or_other_run_is_refused_in_one_line(tmp_path, kind):
    run = tmp_path / "run"
    if kind != "missing":
        run.mkdir()
        (run / "config.yaml").write_text("method: {name: rope}\ntrainer: {context: 64}\n" if kind == "text" else
                                         "task: {name: flipflop}\ntrainer: {context: 64}\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    proc = run_script(str(run))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert {"missing": "does not exist", "text": "is a text run", "flipflop": "is a task=flipflop run"}[kind] in proc.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
