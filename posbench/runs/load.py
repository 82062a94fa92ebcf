"""A finished run loaded back: its trained model, config and results, and its own token cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from posbench.core.errors import PosbenchError
from posbench.core.paths import recorded_location
from posbench.data import PreparedData, cache_dir_of, prepare_data
from posbench.model.transformer import ModelConfig, Transformer, build_model
from posbench.runs.checkpoint import list_checkpoints, load_latest_checkpoint, load_model_weights
from posbench.runs.results_types import Results
from posbench.runs.rundir import RunDir
from posbench.runs.spec import MethodSpec, data_config

logger = logging.getLogger("posbench")


@dataclass
class Run:
    """A run directory loaded back: the trained model, its config and its results (if any)."""

    path: Path
    model: Transformer
    config: DictConfig
    results: Results | None
    step: int
    data_dir: str | None = None
    """The token cache the run trained on, as its checkpoint records it."""


def load_run(run_dir: str | Path, device: str | torch.device = "cpu", log: Callable[[str], None] = logger.info) -> Run:
    """Load the latest checkpoint of ``run_dir`` into a model in eval mode.

    Reading renames nothing: a damaged checkpoint is reported and the one before it used, a
    damaged results.json is reported and read as missing (``results`` None)."""
    path = Path(run_dir).expanduser()
    if not path.is_dir():
        raise PosbenchError(f"run directory {path} does not exist; pass run=<a directory made by posbench train>")
    if not list_checkpoints(path):
        raise PosbenchError(
            f"{path} has no checkpoints/step_*.pt; pass run=<a directory made by posbench train>"
        )
    state = load_latest_checkpoint(path, log=log, map_location="cpu", quarantine=False)
    if state is None:
        raise PosbenchError(f"every checkpoint in {path / 'checkpoints'} is damaged; retrain this run")
    method = MethodSpec.from_saved({"name": state["method"], **(state.get("method_options") or {})})
    model = build_model(ModelConfig.from_dict(state["model_config"]), method.name, method.options)
    load_model_weights(model, state, path)
    model.to(device).eval()
    results = RunDir(path).read_results(log)
    return Run(path, model, OmegaConf.create(state["config"]), results, state["step"], state.get("data_dir"))


def run_data(run: Run, log: Callable[[str], None] = logger.info):
    """The run's own token cache, with the tokenizer it trained with; never a new tokenizer.

    The run records its cache directory (the checkpoint's ``data_dir``; results.json's ``data.dir``,
    relative to the repository or from ``~`` since posbench stopped recording absolute paths) and the sha256 of its tokenizer (``data.meta.tokenizer.sha256``). That cache
    is used when it is still there with that tokenizer, even if the training text changed since:
    it holds the very tokens the run trained and was evaluated on. A cache that is gone is
    rebuilt only from unchanged text, and the rebuilt tokenizer must match the checksum.
    Anything else is refused: evaluating with another tokenizer would give numbers that are not
    comparable with the run's own.
    """
    recorded = (run.results or {}).get("data") or {}
    # The checkpoint's own path first (this machine's); results.json's may be relative to the repository.
    where = run.data_dir or recorded.get("dir")
    recorded_dir = str(recorded_location(where)) if where else None
    recorded_sha = ((recorded.get("meta") or {}).get("tokenizer") or {}).get("sha256")
    cfg = data_config(run.config.data)

    def verified(prepared: PreparedData) -> PreparedData:
        if recorded_sha and prepared.tokenizer_sha256() != recorded_sha:
            raise PosbenchError(
                f"the tokenizer in {prepared.dir} is not the one {run.path} trained with (sha256 differs); "
                "restore the run's data cache or retrain the run"
            )
        return prepared

    try:
        current, why = cache_dir_of(cfg), "the training text changed since"
    except PosbenchError as err:  # the text is gone or unreadable now
        current, why = None, str(err)
    unchanged = current is not None and (not recorded_dir or current.name == Path(recorded_dir).name)
    if recorded_dir and Path(recorded_dir).is_dir():
        if not unchanged:
            reason = why if current is None else (f"{current.name}, not {Path(recorded_dir).name}: the text, its "
                                                  "location or its files' dates changed since the run")
            log(f"note: the run's data settings no longer lead to its cache ({reason}); "
                f"evaluating on the run's own cached tokens in {recorded_dir}")
        return verified(PreparedData.open(recorded_dir))
    if not unchanged:
        raise PosbenchError(
            f"the data cache {recorded_dir} that {run.path} trained with is gone and cannot be rebuilt ({why}); "
            "restore the cache or the original text, or retrain the run"
        )
    if recorded_dir:
        log(f"the run's data cache {recorded_dir} is gone; rebuilding it from the unchanged text")
    return verified(prepare_data(cfg, log=log))
