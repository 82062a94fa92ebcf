"""scripts/mqar_diagnosis.py: accuracy by query rank of an MQAR model against the elimination baseline."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from posbench.tasks.base import make_task

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "mqar_diagnosis.py"
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
    """Never reads the query key: answers the value of the first key not queried yet."""
    x = x.numpy()
    pred = np.full_like(x, TASK.filler)
    for row in range(len(x)):
        keys, values = list(x[row, 0:16:2]), list(x[row, 1:16:2])
        asked: set[int] = set()
        for at in range(16, x.shape[1], 2):
            if x[row, at] in keys:
                left = [v for k, v in zip(keys, values) if k not in asked]
                pred[row, at] = left[0]
                asked.add(x[row, at])
    return pred


def test_a_lookup_is_right_at_every_rank():
    by_rank, unqueried = mqar_diagnosis.profile(oracle, TASK, sequences=50)
    assert list(by_rank) == list(range(8)) and all(a == 1.0 for a in by_rank.values())
    assert unqueried == 1.0  # the right value always belongs to a key not yet queried


def test_elimination_follows_one_over_remaining_keys():
    by_rank, unqueried = mqar_diagnosis.profile(eliminator, TASK, sequences=400)
    assert unqueried == 1.0 and by_rank[7] == 1.0  # the last query has one value left
    for j in range(7):
        assert abs(by_rank[j] - 1 / (8 - j)) < 0.08, (j, by_rank[j])
