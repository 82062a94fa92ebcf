"""``posbench export run=<dir> out=<dir>``: a finished rope or nope run as a transformers model.

The folder ``out`` is what ``save_pretrained`` writes (config.json, model.safetensors), the
run's tokenizer when it has one (tokenizer.json and its config, so ``AutoTokenizer`` loads it),
and ``posbench_export.json`` (which run and step, and the measured agreement). Before ``out``
appears, the saved folder is loaded back with ``AutoModelForCausalLM.from_pretrained`` and its
logits are compared with the run's model on one sequence of the training context: an export
that does not compute the run's function is never left behind. The model mapping is
:mod:`posbench.model.hf_export`.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from posbench.core.errors import PosbenchError
from posbench.core.io import check_output_dir, write_json_atomic
from posbench.data.tokenizer import EOT, TOKENIZER_FILE
from posbench.model.hf_export import check_exportable, to_transformers
from posbench.runs.load import Run, load_run

logger = logging.getLogger("posbench")

TOLERANCE = 1e-4
"""Largest |logit difference| an export may have, relative to the largest |logit| (fp32 rounding
of the same sums in another order is about 1e-6 of it)."""


def export_run(cfg: DictConfig, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """``posbench export``: ``cfg.run``'s newest checkpoint -> ``cfg.out``; the export record."""
    if not cfg.get("run") or not cfg.get("out"):
        raise PosbenchError("posbench export needs run=<finished run directory> out=<new folder>")
    out = check_output_dir(cfg.out, "out")
    if out.exists() and any(out.iterdir()):
        raise PosbenchError(f"out={out} is not empty; choose a new folder (export never overwrites one)")
    run = load_run(cfg.run, device="cpu", log=log)
    check_exportable(run.model)  # one line naming why, before anything is written
    if run.results is None:
        raise PosbenchError(f"{run.path} has no results.json: it has not finished; finish it "
                            f"(posbench train ... trainer.resume={run.path}) before exporting it")
    context = int(run.config.trainer.context)
    tokenizer = run_tokenizer(run)
    eos = tokenizer.convert_tokens_to_ids(EOT) if tokenizer is not None and EOT in tokenizer.get_vocab() else None
    hf = to_transformers(run.model, max_positions=context, eos_token_id=eos)
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        hf.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        difference = check_export(run, staging, context)
        record = {"run": str(run.path), "step": run.step, "method": run.model.method_name,
                  "class": type(hf).__name__, "max_abs_logit_difference": difference,
                  "checked_length": context, "tokenizer": tokenizer is not None,
                  "transformers": __import__("transformers").__version__}
        write_json_atomic(staging / "posbench_export.json", record)
        if out.exists():
            out.rmdir()  # empty, checked above
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"exported {run.path} (step {run.step}, {run.model.method_name}) as transformers "
        f"{type(hf).__name__} to {out}; logits agree to {difference:.1e}")
    if tokenizer is None:
        log("note: the run has no text tokenizer (a task run, or its token cache is gone); "
            "out has the model only")
    return {**record, "out": str(out)}


def run_tokenizer(run: Run) -> Any:
    """The run's tokenizer as a transformers fast tokenizer (EOT as its end-of-sequence token), or
    None for a run with no token cache (a task run) or whose cache is gone."""
    recorded = ((run.results or {}).get("data") or {}).get("dir") or run.data_dir
    if not recorded or not (Path(recorded) / TOKENIZER_FILE).is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(recorded) / TOKENIZER_FILE))
    if EOT in tokenizer.get_vocab():
        tokenizer.eos_token = EOT
    return tokenizer


def check_export(run: Run, folder: Path, length: int) -> float:
    """Load ``folder`` back as any user would and compare its logits with the run's model on one
    sequence of ``length`` random tokens; the largest |difference|, or one line when too large."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, run.model.cfg.vocab_size, (1, length), generator=generator)  # (1, T)
    with torch.no_grad():
        ours = run.model(idx)
        theirs = loaded(input_ids=idx).logits
    difference = float((ours - theirs).abs().max())
    scale = float(ours.abs().max()) or 1.0
    if not difference <= TOLERANCE * scale:
        raise PosbenchError(f"the exported {type(loaded).__name__} differs from the run's model by {difference:.2e} "
                            f"in its logits (more than fp32 rounding); nothing was written")
    return difference
