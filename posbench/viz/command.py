"""Pictures of what a position method does and of what a trained run learned: ``posbench viz``.

Three sources, one set of figures (every figure marks the training context C):

- ``method=<name>``: the method's own signals, untrained, on a model of shape ``model``;
- ``run=<run dir>``: the trained model's signals plus its attention on held-out text;
- ``run=<sweep dir>``: every run of the sweep in its own sub-folder plus ``overview.<fmt>``.

Figures (each only for methods that have the signal):

- ``position_table``: the input-embedding table, position x dimension (sinusoidal, learned);
- ``position_similarity``: cosine similarity of the input embeddings of every position pair; a
  trained learned table shows noise past C, where rows never got a gradient;
- ``qk_decay``: ``E[q.k] / D`` against distance for q, k with iid entries of mean 1 (RoFormer's
  long-term decay), i.e. ``q = k = 1`` through the method's ``rotate_qk``; one curve per RoPE
  base in ``decay.bases`` and per evaluation-time extension in ``decay.rules`` (any of
  :data:`posbench.model.extension.EXTENSIONS` that applies to the method, at factor span; see
  :func:`posbench.viz.measures.decay_rules`);
- ``score_terms``: the score term against distance d = i - j, per head, 0 to span x C, trained
  range and extrapolated range shaded differently. It is the mean over queries i of the term at
  (i, i - d), computed from the method's ``score_term`` on a dense index grid, so any score method
  draws without code here; content-dependent terms (relative, and anything gating on q or on the
  layer input) are averaged over the real queries of a run;
- ``attention_maps_layer<l>``: per-head attention of one held-out window at length_factor x C;
- ``attention_entropy_distance``: attention entropy and mean attended distance against query
  position, mean over heads and windows, one line per layer;
- ``overview`` (sweeps): per method, the loss by position next to the mean attended distance.

Attention weights are recomputed by the model's own eager backend
(:mod:`posbench.viz.attention`), one window at a time.

A grid method or a grid run (the grid encoder) is drawn on the grid instead: position maps of
query cells and the attended distance in cells at the training side and beyond
(:mod:`posbench.viz.grid`); a sweep's overview draws its sequence runs only.

Modules: :mod:`~posbench.viz.settings` (the options), :mod:`~posbench.viz.measures` (the numbers),
:mod:`~posbench.viz.attention` (recording a run's attention), :mod:`~posbench.viz.figures` (the
figures), :mod:`~posbench.viz.draw` (what a method or a run shows) and this command (sweeps, W&B).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

from omegaconf import DictConfig, OmegaConf

from posbench.core.errors import PosbenchError
from posbench.report.compare import method_order
from posbench.report.figures import save
from posbench.runs.run_record import discover_runs
from posbench.runs.rundir import RunDir
from posbench.runtime.device import resolve_device
from posbench.train.loggers import upload_figures
from posbench.viz.checks import settings_from_config
from posbench.viz.draw import viz_method, viz_run
from posbench.viz.figures import overview_figure
from posbench.viz.settings import VizSettings

logger = logging.getLogger("posbench")
Log = Callable[[str], None]


def viz_sweep(sweep_dir: Path, s: VizSettings, out: Path, device: str, log: Log) -> list[Path]:
    """Every finished run of a sweep (sub-folder per run) and ``overview.<fmt>``."""
    runs, problems = discover_runs([sweep_dir])
    for path, reason in problems:
        log(f"skipped {path}: {reason}")
    if not runs:
        raise PosbenchError(f"no finished runs under {sweep_dir}; pass run=<a run or sweep directory>")
    order = {m: i for i, m in enumerate(method_order(r.method for r in runs))}
    runs = sorted(runs, key=lambda r: (order[r.method], str(r.path)))
    written: list[Path] = []
    rows = []
    drawn = 0
    for run in runs:
        try:
            files, record, results = viz_run(run.path, s, out / run.path.name, device, log)
        except PosbenchError as err:  # e.g. a run without checkpoints: the others still draw
            log(f"skipped {run.path}: {err}")
            continue
        written += files
        drawn += 1
        if record is not None:  # a grid run has no attention by query position to draw there
            rows.append((run.name, run.method, results, record))
    if not drawn:
        raise PosbenchError(f"no run under {sweep_dir} could be drawn (see the lines above)")
    if not rows:
        log("overview not drawn: it draws loss and attended distance by query position, which grid runs lack")
        return written
    written += save(overview_figure(rows, f"Sweep {sweep_dir.name}"), out, "overview", s.formats)
    log(f"wrote {written[-1]}")
    return written


def viz_sweep_default(sweep_dir: Path, out: Path, formats: Sequence[str], log: Log) -> list[Path]:
    """The sweep callback's hook: :func:`viz_sweep` with the default settings, on the best device."""
    settings = VizSettings(formats=list(formats)).validate()
    return viz_sweep(Path(sweep_dir), settings, Path(out), str(resolve_device("auto")), log)


def log_to_wandb(run_dir: Path, run_config: DictConfig, paths: Sequence[Path], log: Log) -> bool:
    """Add the figures to the run's W&B run as ``viz/<name>`` (see :func:`posbench.train.loggers.upload_figures`)."""
    return upload_figures(run_dir, run_config.get("logger") or {}, paths, log, prefix="viz")


def run_viz(cfg: DictConfig, log: Log = logger.info) -> list[Path]:
    """``posbench viz``: method=<name>, run=<run dir> or run=<sweep dir>."""
    s = settings_from_config(cfg)
    if cfg.get("method") and cfg.get("run"):
        raise PosbenchError("posbench viz takes method=<name> or run=<dir>, not both")
    if cfg.get("method"):
        return viz_method(cfg, s, log)
    if not cfg.get("run"):
        raise PosbenchError("posbench viz needs method=<name> (no training) or run=<run or sweep directory>")
    path = Path(str(cfg.run)).expanduser()
    if not path.is_dir():
        raise PosbenchError(f"{path} is not a directory; pass run=<a run or sweep directory made by posbench train>")
    device = str(resolve_device(str(cfg.get("device", "cpu"))))
    rundir = RunDir(path)
    if rundir.checkpoint_dir.is_dir() or rundir.results_path.is_file():
        out = Path(cfg.out) if cfg.get("out") else rundir.figures_dir / "viz"
        written, _, _ = viz_run(path, s, out, device, log)
        if cfg.get("wandb", True):
            log_to_wandb(path, load_run_config(path), written, log)
        return written
    out = Path(cfg.out) if cfg.get("out") else path / "comparison" / "viz"
    return viz_sweep(path, s, out, device, log)


def load_run_config(run_dir: Path) -> DictConfig:
    """The run's resolved config.yaml (written by posbench train)."""
    config = RunDir(run_dir).config_path
    return OmegaConf.load(config) if config.is_file() else OmegaConf.create({})


__all__ = ["load_run_config", "log_to_wandb", "run_viz", "viz_sweep", "viz_sweep_default"]
