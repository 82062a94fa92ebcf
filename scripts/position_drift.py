"""Movement of a run's learned position parameters, from its checkpoints (docs/fidelity.md).

For runs trained before the trainer logged ``position/<param>/norm`` and ``/move`` in
metrics.jsonl: rebuilds the seed's initialisation from the run's config.yaml (the trainer seeds,
then builds the model) and compares every checkpoint (and any extra ``.pt`` files given, e.g.
copies of checkpoints the run has since rotated away) with it.

    .venv/bin/python scripts/position_drift.py RUN_DIR [CHECKPOINT.pt ...] [--csv OUT.csv]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from omegaconf import OmegaConf

from posbench.commands.cli import run_script
from posbench.core.errors import PosbenchError
from posbench.methods.base import ParameterDrift
from posbench.model.transformer import build_model
from posbench.runs.checkpoint import list_checkpoints, read_checkpoint
from posbench.train.trainer import build_spec, seed_everything


def drift_rows(run_dir: Path, extra: list[Path]) -> list[dict]:
    if not (run_dir / "config.yaml").is_file():
        raise PosbenchError(f"{run_dir} has no config.yaml; give the directory of a posbench run")
    missing = [str(p) for p in extra if not p.is_file()]
    if missing:
        raise PosbenchError(f"no checkpoint file {', '.join(missing)}")
    spec = build_spec(OmegaConf.load(run_dir / "config.yaml"))
    seed_everything(spec.seed)
    model = build_model(spec.model, spec.method, spec.method_options)  # the seed's initialisation
    drift = ParameterDrift(model.position)
    paths = {p.name: p for p in [*extra, *list_checkpoints(run_dir)]}
    rows = []
    for path in sorted(paths.values(), key=lambda p: p.name):
        state = read_checkpoint(path)
        trained = {k.removeprefix("position."): v for k, v in state["model"].items() if k.startswith("position.")}
        with torch.no_grad():
            for name, param in model.position.position_parameters().items():
                param.copy_(trained[name])
        rows.append({"method": spec.method, "seed": spec.seed, "step": state["step"], **drift.metrics()})
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("checkpoints", type=Path, nargs="*")
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    rows = drift_rows(args.run_dir, args.checkpoints)
    if not rows:
        raise PosbenchError(f"{args.run_dir} has no checkpoints (checkpoints/step_*.pt) and none were named")
    for row in rows:
        print(row)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    run_script("position_drift", main)
