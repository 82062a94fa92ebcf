"""Does a trained MQAR run look its answers up, or answer by elimination?

    python scripts/mqar_diagnosis.py <run dir of task=assoc_recall, with a checkpoint> [--sequences 400]

Every key of an MQAR sequence is queried once and each query ``k v`` shows its value
(posbench.tasks.generators.AssocRecall), so the j-th query (j = 0 .. N-1) can be answered without
reading its key: pick a value not yet shown in the query region, which is right with probability
1 / (N - j). This prints the run's accuracy by query
rank next to that elimination baseline, and how many predictions are values of keys not yet queried.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

import posbench
from posbench.tasks.base import make_task


def profile(predict, task, sequences: int = 400) -> tuple[dict[int, float], float]:
    """``predict``: (N, C) input ids -> (N, C) predicted next ids. Returns the accuracy by query
    rank j and the share of predictions that are the value of a key not yet queried."""
    context = task.context
    batch = task.generate(np.random.default_rng([task.seed, 7, context]), sequences, context, "test")  # own stream
    x, _ = batch.inputs_targets()
    pred = np.asarray(predict(x))  # (N, C)
    tokens, pairs = batch.tokens, task.pairs(context)
    right: dict[int, list[bool]] = {}
    unqueried = total = 0
    for row in range(len(tokens)):
        keys, values = list(tokens[row, 0:2 * pairs:2]), list(tokens[row, 1:2 * pairs:2])
        queries = np.nonzero(batch.answers[row])[0]  # positions of the query keys, in order
        for j, at in enumerate(queries):
            left = {values[keys.index(tokens[row, q])] for q in queries[j:]}
            right.setdefault(j, []).append(bool(pred[row, at] == tokens[row, at + 1]))
            unqueried += int(pred[row, at] in left)
            total += 1
    return {j: float(np.mean(v)) for j, v in right.items()}, unqueried / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--sequences", type=int, default=400)
    args = parser.parse_args()
    run = posbench.load_run(args.run)
    task = make_task(run.config["task"], int(run.config["trainer"]["context"]))
    if task.name != "assoc_recall":
        raise SystemExit(f"{args.run} trained task={task.name}; this diagnosis is for task=assoc_recall")

    def predict(x: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return run.model(x).argmax(-1).numpy()

    by_rank, unqueried = profile(predict, task, args.sequences)
    pairs = task.pairs(task.context)
    print(f"{args.run}: accuracy {np.mean(list(by_rank.values())):.3f} (mean over query ranks)")
    print("query rank j:         " + " ".join(f"{j:5d}" for j in by_rank))
    print("accuracy:             " + " ".join(f"{a:5.2f}" for a in by_rank.values()))
    print("elimination 1/(N-j):  " + " ".join(f"{1 / (pairs - j):5.2f}" for j in by_rank))
    print(f"predictions that are the value of a key not yet queried: {unqueried:.3f}")


if __name__ == "__main__":
    main()
