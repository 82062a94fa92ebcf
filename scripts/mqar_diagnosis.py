"""Does a trained MQAR run look its answers up, or answer by elimination?

    python scripts/mqar_diagnosis.py <run dir of task=assoc_recall, with a checkpoint> [--sequences 400]

Where every key is queried once and each query's value is a visible input (posbench's MQAR before
it followed Zoology), the j-th query (j = 0 .. N-1) can be answered without reading its key: pick
a value not yet shown in the query region, right with probability 1 / (N - j). In today's MQAR the
values are labels only, so that guess is 1/N at every rank (the ``elimination`` baseline of
:meth:`posbench.tasks.generators.AssocRecall.guesses`, measured on the same sequences). This prints
the run's accuracy by query rank next to that baseline and to 1 / (N - j), and how many predictions
are values of keys not yet queried. A run directory that is missing or not task=assoc_recall is
refused in one line (exit 2), before anything is loaded.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from posbench.core.errors import PosbenchError
from posbench.runs.rundir import RunDir
from posbench.tasks.base import make_task

OWN_STREAM = 7  # the diagnosis's sequences: not the train (0), validation (1) or test (2) stream


def profile(predict, task, sequences: int = 400) -> dict[str, dict[int, float] | float]:
    """``predict``: (N, C) input ids -> (N, C) predicted next ids. Returns, by query rank j (the
    j-th answer of a sequence), the ``accuracy`` and the ``elimination`` baseline, and the share of
    predictions that are the value of a key not yet queried (``unqueried``)."""
    context = task.context
    batch = task.generate(np.random.default_rng([task.seed, OWN_STREAM, context]), sequences, context, "test")
    x, _ = batch.inputs_targets()  # (N, C)
    pred = np.asarray(predict(x))  # (N, C)
    eliminate = task.guesses(batch)["elimination"]  # (N, C)
    right: dict[int, list[bool]] = {}
    odds: dict[int, list[float]] = {}
    unqueried = total = 0
    keys_end = 2 * task.num_pairs
    for row in range(len(pred)):
        pairs = dict(zip(batch.inputs[row, 0:keys_end:2].tolist(), batch.inputs[row, 1:keys_end:2].tolist()))
        queries = np.flatnonzero(batch.answers[row])  # positions of the query keys, in order
        for j, at in enumerate(queries):
            left = {pairs[int(batch.inputs[row, q])] for q in queries[j:]}
            right.setdefault(j, []).append(bool(pred[row, at] == batch.targets[row, at]))
            odds.setdefault(j, []).append(float(eliminate[row, at]))
            unqueried += int(pred[row, at] in left)
            total += 1
    return {"accuracy": {j: float(np.mean(v)) for j, v in right.items()},
            "elimination": {j: float(np.mean(v)) for j, v in odds.items()}, "unqueried": unqueried / total}


def mqar_config(run: str):
    """The run's config, refused (one line) unless ``run`` is a directory of a task=assoc_recall run."""
    path = Path(run).expanduser()
    if not path.is_dir():
        raise PosbenchError(f"run directory {path} does not exist; pass the directory of a task=assoc_recall run")
    config_path = RunDir(path).config_path
    if not config_path.is_file():
        raise PosbenchError(f"{path} has no config.yaml; pass the directory of a task=assoc_recall run")
    config = OmegaConf.load(config_path)
    task = config.get("task")
    if task is None or task.get("name") != "assoc_recall":
        kind = "a text run" if task is None else f"a task={task.get('name')} run"
        raise PosbenchError(f"{path} is {kind}; this diagnosis reads task=assoc_recall runs")
    return config


def report(run: str, sequences: int) -> None:
    import posbench

    config = mqar_config(run)
    task = make_task(config["task"], int(config["trainer"]["context"]))
    model = posbench.load_run(run).model

    def predict(x: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return model(x).argmax(-1).numpy()

    found = profile(predict, task, sequences)
    by_rank, pairs = found["accuracy"], task.num_pairs
    print(f"{run}: accuracy {np.mean(list(by_rank.values())):.3f} (mean over query ranks)")
    print("query rank j:             " + " ".join(f"{j:5d}" for j in by_rank))
    print("accuracy:                 " + " ".join(f"{a:5.2f}" for a in by_rank.values()))
    print("elimination, measured:    " + " ".join(f"{a:5.2f}" for a in found["elimination"].values()))
    print("1/(N-j), answers visible: " + " ".join(f"{1 / (pairs - j):5.2f}" for j in by_rank))
    print(f"predictions that are the value of a key not yet queried: {found['unqueried']:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--sequences", type=int, default=400)
    args = parser.parse_args(argv)
    try:
        report(args.run, args.sequences)
    except PosbenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
