"""``posbench eval``: re-evaluate a finished run (new lengths, extensions, probes) into its results.json."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from posbench.core.errors import PosbenchError
from posbench.data import DataConfig, tokenize_with
from posbench.evaluation.loss import evaluate_model
from posbench.evaluation.probes import ProbeRun, configure_probes, merge_probe_results, run_probes
from posbench.evaluation.settings import eval_settings
from posbench.model.extension import check_names, resolve_extensions
from posbench.report.plot import write_run_figures
from posbench.runs.entries import entry_measurement, merge_eval_entries, plain_entries
from posbench.runs.load import Run, load_run
from posbench.runs.run_record import recorded_precision
from posbench.runs.rundir import RunDir
from posbench.runtime.device import autocast_dtype, precision_name, resolve_device
from posbench.train.trainer import finish_run
from posbench.train.workload import saved_workload

logger = logging.getLogger("posbench")


def eval_precision(cfg: DictConfig, run: Run) -> str:
    """``precision=auto`` re-evaluates in the precision the run was trained and evaluated in, so
    its new entries are comparable with its old ones; fp32 / bf16 override it."""
    asked = str(cfg.get("precision", "auto"))
    if asked != "auto":
        return asked
    return str(OmegaConf.select(run.config, "trainer.precision", default="auto"))


def run_eval_section(cfg: DictConfig, run: Run) -> tuple[dict[str, Any], bool]:
    """``posbench eval``'s eval section: each setting left null takes the run's own (its
    config.yaml's ``eval``, else the defaults), so by default it measures the very windows of
    the run's training-time evaluation. Returns (section, ``eval.replace``)."""
    asked = OmegaConf.to_container(cfg.get("eval") or OmegaConf.create({}), resolve=True)
    replace = asked.pop("replace", False)
    if not isinstance(replace, bool):
        raise PosbenchError(f"eval.replace must be true or false, got {replace!r}")
    own = OmegaConf.select(run.config, "eval", default=None)
    section = OmegaConf.to_container(own, resolve=True) if own is not None else {}
    for name, value in asked.items():
        if isinstance(value, dict):  # a nested section (eval.copy): merge its set keys into the run's own
            value = {**(section.get(name) or {}), **{k: v for k, v in value.items() if v is not None}}
        if value is not None:
            section[name] = value
    return section, replace


def evaluate_saved_run(cfg: DictConfig, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """``posbench eval``: (re)evaluate a finished run on its own data or on other text."""
    if not cfg.get("run"):
        raise PosbenchError("posbench eval needs run=<run directory>")
    device = resolve_device(str(cfg.get("device", "auto")))
    run = load_run(cfg.run, device=device, log=log)
    section, replace = run_eval_section(cfg, run)
    evaluation = eval_settings(section)
    probes_only = cfg.get("probes_only", False)
    if not isinstance(probes_only, bool):
        raise PosbenchError(f"probes_only must be true or false, got {probes_only!r}")
    if probes_only and not evaluation.probes:
        raise PosbenchError("probes_only=true runs only the probes; name them, e.g. 'eval.probes=[copy]'")
    check_names(evaluation.extension)
    train_context = int(run.config.trainer.context)
    limit = run.model.position.max_positions
    if limit is not None and max(evaluation.lengths) > limit:
        raise PosbenchError(
            f"this {run.model.method_name} model has learned positions up to {limit}; "
            f"choose eval.lengths <= {limit}"
        )
    evaluation.check_lengths(train_context, need_headline=False)
    configure_probes(evaluation, train_context, max_positions=limit)
    workload = saved_workload(run.config)  # the run's kind: text or task
    if run.results is not None:
        workload.check_reevaluation(run)
    prepared = workload.saved_data(run, log)
    other_path = cfg.get("data", {}).get("path") if cfg.get("data") else None
    if run.results is None and not other_path:
        # Its results.json was damaged: the run's own evaluation is recomputed under its own eval
        # settings, and what else was asked is then added beside it (never a headline from other
        # settings). Stopped after its final checkpoint (during its final evaluation, no
        # results.json yet): its final evaluation at these settings finishes it, and its
        # config.yaml records them. Both are refused while steps remain to train.
        damaged = RunDir(run.path).results_path.is_file()
        run.results = finish_run(run.path, run.config, log, device=str(device),
                                 evaluation=None if damaged else OmegaConf.create(section))
        if not damaged or (section == run_eval_section(OmegaConf.create({}), run)[0] and not probes_only):
            return run.results
    source = "run"
    if other_path:
        # All of the other text is evaluation text (valid_fraction=1), cached beside the run's data.
        other = DataConfig(source="local", path=str(other_path), valid_fraction=1.0,
                           cache_dir=str(run.config.data.cache_dir))
        prepared = tokenize_with(prepared, other.validate(), log=log)
        source = str(other_path)
    extensions = resolve_extensions(evaluation.extension, run.model.position, log=log,
                                    scope=evaluation.extension_scope, attention=run.model.cfg.has_attention)
    amp_dtype = autocast_dtype(eval_precision(cfg, run), device)
    precision = precision_name(amp_dtype)  # what it resolved to here (auto -> bf16 or fp32)
    reuse = {} if replace or other_path else reusable_plain_entries(run, evaluation.split, precision)
    entries = [] if probes_only else evaluate_model(
        run.model, prepared.tokens(evaluation.split), dataclasses.replace(evaluation, extension=extensions),
        train_context, device, log=log, autocast_dtype=amp_dtype, reuse=reuse)
    probes = saved_run_probes(run, prepared, evaluation, device, amp_dtype, log)  # {results key: entries}
    for entry in entries + [e for found in probes.values() for e in found]:
        entry["data"] = source
        entry["checkpoint_step"] = run.step
        entry["precision"] = precision
    if other_path:
        # Other text never changes the run's own results.json; it gets a file of its own.
        written = {"method": run.model.method_name, "data": source, "eval": entries, **probes}
        out = RunDir(run.path).write_other_eval(Path(other_path).name, written)
        log(f"wrote {out}")
        return {**written, "path": str(out)}
    # Two evals of one run at once: each re-reads results.json under the run's results lock and
    # merges its entries into what is there now, so neither loses the other's lengths.
    rundir = RunDir(run.path)
    with rundir.results_lock():
        results = rundir.read_results(log)
        if results is None:
            raise PosbenchError(f"{run.path} has no usable results.json; rerun posbench eval run={run.path}")
        trained = results.get("train", {}).get("steps")
        if trained is not None and trained != run.step:
            raise PosbenchError(
                f"the newest checkpoint of {run.path} is at step {run.step} but its results.json is from "
                f"step {trained}; finish the run (posbench train ... trainer.resume={run.path}) before re-evaluating"
            )
        # The run's entries (and so its headline) stay; other measurements are kept beside them.
        # The precision of the run's own entries; unknown (auto, before it was recorded) is never "the same".
        own = {"precision": recorded_precision(results, run.config) or "unknown"}
        merge_eval_entries(results, entries, replace, log, recorded=own)
        merge_probe_results(results, probes, replace, log, recorded=own)
        rundir.write_results(results, log)  # the results lock it takes is the one held here
        if evaluation.figures:
            write_run_figures(run.path, log)
    log(f"updated {rundir.results_path}")
    return results


def reusable_plain_entries(run: Run, split: str, precision: str) -> dict[int, dict[str, Any]]:
    """The run's plain entries of ``split`` measured at this checkpoint in this precision, by
    length: :func:`evaluate_model` reuses one measured on the same windows instead of measuring
    the plain model again (an eval with an extension needs it only as the reference)."""
    own = {"precision": recorded_precision(run.results or {}, run.config), "checkpoint_step": run.step}
    found = {}
    for entry in plain_entries((run.results or {}).get("eval", [])):
        measured = entry_measurement(entry, own)
        if entry["split"] == split and measured["precision"] == precision and measured["checkpoint_step"] == run.step:
            found[int(entry["length"])] = entry
    return found


def saved_run_probes(run: Run, prepared: Any, evaluation: Any, device: torch.device,
                     amp_dtype: torch.dtype | None, log: Callable[[str], None]) -> dict[str, list[dict[str, Any]]]:
    """``posbench eval``'s probes (eval.probes) on ``run``'s model, under its eval.extension:
    ``{results.json key: entries}``."""
    if not evaluation.probes:
        return {}
    evaluation = dataclasses.replace(evaluation, extension=resolve_extensions(
        evaluation.extension, run.model.position, log=lambda _: None, scope=evaluation.extension_scope,
        attention=run.model.cfg.has_attention))
    train_context = int(run.config.trainer.context)
    return run_probes(run.model, prepared, evaluation, ProbeRun.of(evaluation, train_context, device, amp_dtype, log))
