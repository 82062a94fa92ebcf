"""``posbench train ... --dry-run``: what a run would do, without doing it.

The config is checked as a training checks it (:func:`posbench.runs.spec.build_spec`), the data
is prepared as a training prepares it (a token cache that is not there yet is built: the count
of steps of an epochs-based run depends on it, and a later training reuses it), the model is
built on PyTorch's meta device (no memory, no weights) to count its parameters. Nothing is
trained and no run directory (nor Hydra's record) is written. The CLI strips ``--dry-run`` and
composes the config without starting Hydra's app (:func:`posbench.commands.cli.main`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from posbench.evaluation.probes import configure_probes
from posbench.model.transformer import build_model
from posbench.runs.spec import build_spec
from posbench.train.optim import micro_batching, total_steps
from posbench.train.workload import make_workload


def dry_run(cfg: DictConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Print the steps, tokens and resolved config of the run ``cfg`` describes; the numbers."""
    spec = build_spec(cfg)
    t = spec.trainer
    configure_probes(spec.eval, t.context)
    micro, accum = micro_batching(t, 1)
    workload = make_workload(spec, lambda _: None)  # the data as a training prepares it
    spec = replace(spec, model=replace(spec.model, vocab_size=workload.vocab_size))
    batches = workload.train_batches(t, spec.seed, 0, 1, torch.device("cpu"))
    tokens_per_step = t.batch_size * t.context
    steps = total_steps(t, tokens_per_step, batches.steps_per_epoch)
    with torch.device("meta"):  # shapes only: no memory, no init
        parameters = build_model(spec.model, spec.method, spec.method_options).num_parameters()
    m = spec.model
    numbers = {"method": spec.method, "parameters": parameters, "steps": steps, "tokens_per_step": tokens_per_step,
               "tokens": steps * tokens_per_step, "context": t.context, "micro_batch_size": micro,
               "accumulation": accum, "eval_lengths": list(spec.eval.lengths)}
    where = "a synthetic task, generated each step" if workload.text is None and workload.data_dir is None \
        else f"{batches.steps_per_epoch:,} steps per epoch of the training text"
    try:
        resolved = OmegaConf.to_yaml(cfg, resolve=True)
    except Exception:  # an interpolation only Hydra's app resolves (${hydra:...}): shown as written
        resolved = OmegaConf.to_yaml(cfg)
    log("\n".join([
        "dry run: nothing is trained and no run directory is written",
        f"  method {spec.method}, model {m.flavour}: d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, "
        f"vocab {m.vocab_size:,}, {parameters:,} parameters",
        f"  steps {steps:,} x {tokens_per_step:,} tokens (batch {t.batch_size} x context {t.context}; micro-batch "
        f"{micro} x {accum} accumulation) = {steps * tokens_per_step:,} training tokens ({where})",
        f"  evaluation at lengths {', '.join(map(str, spec.eval.lengths))} ({spec.eval.num_sequences} windows each)",
        "resolved config:",
        resolved.rstrip(),
    ]))
    return numbers
