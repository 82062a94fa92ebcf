"""Experiment tracking: the ``RunLogger`` interface, a no-op ``NullLogger`` and a W&B ``WandbLogger``.

The run directory (metrics.jsonl, results.json, figures) is the record of truth; a logger only
mirrors it to a dashboard. So a logger must never cost a run: W&B never prompts for a login,
``wandb.init`` is time-bounded, and any exception inside wandb prints ONE warning line and turns
the logger into a no-op while training carries on.

Pick one with the Hydra group ``logger`` (``logger=wandb`` or ``logger=none``) and build it with
:func:`make_logger`. ``logger.mode=auto`` goes online when W&B credentials exist and offline
otherwise (offline runs upload later with ``wandb sync``): :mod:`posbench.train.wandb_session`.
The console's progress of the step loop is :mod:`posbench.train.progress`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from posbench.core.errors import PosbenchError, one_line
from posbench.runs.entries import entry_extension, headline_entries
from posbench.train.wandb_session import Log, note_unreachable, resolve_mode, settle_offline, upload_figures, wandb_init

__all__ = [
    "LOGGERS",
    "MODES",
    "RunLogger",
    "NullLogger",
    "WandbLogger",
    "make_logger",
    "upload_figures",  # re-exported: `posbench viz` adds its figures through it
]

LOGGERS = ("none", "wandb")
MODES = ("auto", "online", "offline", "disabled")

class RunLogger:
    """Interface of a run's tracker. Every method is a no-op here; subclasses override them."""

    @property
    def active(self) -> bool:
        """True while calls reach a real backend."""
        return False

    def log_config(self, config: dict) -> None:
        """Record the resolved run config."""

    def log_metrics(self, metrics: dict, step: int) -> None:
        """Record training/validation scalars (``loss``, ``lr``, ``tokens``, ``val_loss``...) at ``step``."""

    def log_eval(self, entries: list[dict], train_context: int) -> None:
        """Record the ``eval`` entries of results.json (per-position loss curves and bands)."""

    def log_figures(self, paths: list[Path]) -> None:
        """Upload image files (PNG figures)."""

    def summary(self, values: dict) -> None:
        """Set final, one-per-run values (shown as columns in the runs table)."""

    def finish(self, exit_code: int = 0) -> None:
        """Close the run; a non-zero ``exit_code`` marks it failed."""

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.finish(0 if exc_type is None else 1)


class NullLogger(RunLogger):
    """Logs nothing: ``logger=none``, ``mode=disabled``, ranks other than 0."""


def make_logger(
    cfg: Mapping[str, Any],
    *,
    run_dir: Path,
    run_name: str,
    group: str | None,
    tags: Sequence[str],
    config: Mapping[str, Any],
    rank: int = 0,
    log: Log = print,
) -> RunLogger:
    """Build the logger chosen by the ``logger`` config group.

    Args:
        cfg: the ``logger`` group (dict or DictConfig): name, project, entity, mode, group, tags, dir.
        run_dir: the run directory; wandb writes under ``<dir or run_dir>/wandb/``.
        run_name: W&B run name, e.g. ``"rope-s0"``.
        group: run group used when ``cfg.group`` is null (the sweep/experiment name).
        tags: extra tags; the method name (``config["method"]["name"]``) always comes first.
        config: the resolved run config (dict or DictConfig).
        rank: distributed rank; only rank 0 logs.
        log: where one-line notices and warnings go.
    """
    cfg = _to_dict(cfg)
    name = str(cfg.get("name", "none"))
    if name not in LOGGERS:
        raise PosbenchError(
            f"unknown logger {name!r}; choose one of: {', '.join(LOGGERS)} (logger=<name>)"
        )
    mode = str(cfg.get("mode") or "auto").lower()
    if mode not in MODES:
        raise PosbenchError(f"unknown logger.mode {mode!r}; choose one of: {', '.join(MODES)}")
    if name == "none" or rank != 0:
        return NullLogger()
    mode = resolve_mode(mode, log=log)
    if mode == "disabled":
        return NullLogger()

    config = _to_dict(config)
    method = config.get("method")
    method = method.get("name") if isinstance(method, Mapping) else method
    all_tags = [str(t) for t in (method, *tags, *(cfg.get("tags") or [])) if t]
    return WandbLogger(
        project=cfg.get("project") or "posbench",
        entity=cfg.get("entity"),
        name=run_name,
        group=cfg.get("group") or group,
        tags=list(dict.fromkeys(t[:64] for t in all_tags)),  # W&B caps tags at 64 chars; dedupe
        config=config,
        dir=Path(cfg.get("dir") or run_dir),
        mode=mode,
        log=log,
    )


class WandbLogger(RunLogger):
    """Mirror a run to Weights & Biases; use :func:`make_logger` rather than this directly.

    Dashboard layout (chosen so runs of different methods compare out of the box):

    - ``train/*`` (loss, lr, tokens_per_second, step) and ``val/*`` plot against ``train/tokens``,
      so runs with different batch sizes or step counts line up;
    - ``eval/<split>/<length>/loss`` plots against ``eval/position``: W&B's standard line panel
      overlays every run (group or colour by ``method`` tag), the key comparison of the benchmark;
    - ``eval/<split>/<length>/loss_by_position``: per-run custom line chart with its table;
    - past the training context, the same for the like-for-like curve (``windowed_loss`` and
      ``windowed_loss_by_position``: the targets read through windows of the training context)
      and the cost by position (``cost`` and ``cost_by_position``: full minus windowed loss);
    - summary ``eval/<split>/<length>/band_<a>-<b>`` and ``headline/loss_256_512`` (for training
      context 256): columns of the runs table for sorting and bar charts;
    - entries evaluated under a context extension (``eval.extension``) get the same keys one
      level down, ``eval/<split>/<length>/<extension>/...``: one group per extension.
    """

    def __init__(
        self,
        *,
        project: str,
        entity: str | None,
        name: str,
        group: str | None,
        tags: list[str],
        config: dict,
        dir: Path,
        mode: str,
        log: Log = print,
    ) -> None:
        self.mode = mode
        self.sync_dir: Path | None = None  # wandb/offline-run-* or wandb/run-* under dir
        self._log = log
        self._run: Any = None
        self._last_tokens: float | None = None
        init_args = dict(project=project, entity=entity, name=name, group=group, tags=tags,
                         config=config, dir=dir)
        self._start(init_args)

    @property
    def active(self) -> bool:
        return self._run is not None

    # -- lifecycle ---------------------------------------------------------------------------

    def _start(self, init_args: dict) -> None:
        try:
            self._run = wandb_init(mode=self.mode, **init_args)
        except Exception as e:
            if self.mode != "online":
                return self._disable("init", e)
            # Online failed (usually unreachable server after init_timeout). Offline needs no
            # network, keeps the data and can be uploaded later, so it beats logging nothing.
            note_unreachable()
            self._log(f"warning: W&B online init failed ({one_line(e)}); logging offline")
            self.mode = "offline"
            try:
                self._run = wandb_init(mode="offline", **init_args)
            except Exception as e2:
                return self._disable("init", e2)
        self._guard("init", self._define_metrics)
        if self._run is None:
            return
        self.sync_dir = Path(self._run.settings.sync_dir)
        if self.mode == "offline":
            self._log(f'W&B offline: run "wandb sync {self.sync_dir}" to upload')
        else:
            self._log(f"W&B run: {self._run.url}")

    def _define_metrics(self, run: Any) -> None:
        run.define_metric("train/tokens")
        run.define_metric("train/*", step_metric="train/tokens")
        run.define_metric("val/*", step_metric="train/tokens")
        run.define_metric("eval/position", hidden=True, summary="none")

    def finish(self, exit_code: int = 0) -> None:
        """Close the run; offline, also wait until its records are on disk (:func:`settle_offline`)."""
        run, self._run = self._run, None  # idempotent; nothing more is logged afterwards
        if run is not None:
            try:
                run.finish(exit_code=exit_code)
            except Exception as e:
                self._log(f"warning: W&B finish failed ({one_line(e)}); run data stays in {self.sync_dir}")
                return
            settle_offline(self.mode, exit_code, self._log)

    def _guard(self, op: str, fn: Callable[[Any], None]) -> None:
        """Run ``fn(run)``; on any error warn once and stop logging (training must go on)."""
        if self._run is None:
            return
        try:
            fn(self._run)
        except Exception as e:
            self._disable(op, e)

    def _disable(self, op: str, e: BaseException) -> None:
        # Not finishing the broken run on purpose: finish() could block on the network; wandb's
        # atexit hook (or the next run's reinit) closes it, and its local files stay usable.
        self._run = None
        self._log(f"warning: W&B {op} failed ({one_line(e)}); continuing without W&B logging")

    # -- logging -----------------------------------------------------------------------------

    def log_config(self, config: dict) -> None:
        self._guard("log_config", lambda run: run.config.update(_to_dict(config), allow_val_change=True))

    def log_metrics(self, metrics: dict, step: int) -> None:
        """Bare keys go under ``train/`` (``loss`` -> ``train/loss``), ``val_loss`` becomes
        ``val/loss``, keys with a ``/`` pass through. We never pass wandb's ``step=``: its step
        must only grow, and eval rows logged after training would be dropped; ``train/step`` is
        logged as a metric instead and charts use ``train/tokens`` as their x axis."""
        row: dict[str, Any] = {"train/step": int(step)}
        for key, value in metrics.items():
            if "/" in key:
                name = key
            elif key.startswith(("val_", "validation_")):
                name = "val/" + key.split("_", 1)[1]
            else:
                name = f"train/{key}"
            row[name] = _scalar(value)
        if "train/tokens" in row:
            self._last_tokens = row["train/tokens"]
        elif self._last_tokens is not None:
            row["train/tokens"] = self._last_tokens  # keep val/* rows on the tokens axis
        self._guard("log_metrics", lambda run: run.log(row))

    def log_eval(self, entries: list[dict], train_context: int) -> None:
        self._guard("log_eval", lambda run: self._log_eval(run, entries, train_context))

    def _log_eval(self, run: Any, entries: list[dict], train_context: int) -> None:
        import wandb

        curves: dict[str, list[float | None]] = {}
        summary: dict[str, float | None] = {}
        for entry in entries:
            prefix = f"eval/{entry['split']}/{entry['length']}"
            extension = entry_extension(entry)
            if extension != "none":  # one group per extension; the plain keys stay as they were
                prefix += f"/{extension}"
            of = f"(length {entry['length']}, trained at {train_context}" + \
                 ("" if extension == "none" else f", {extension}") + ")"
            # The full-context curve, and past C the like-for-like (windowed) curve and the cost
            # (full minus windowed) by position: each a table and chart, and a history curve.
            for name, column, values, what in (
                    ("loss", "loss", entry["loss_by_position"], "loss by position"),
                    ("windowed_loss", "loss", (entry.get("windowed") or {}).get("loss_by_position"),
                     "like-for-like loss by position (windows of the training context)"),
                    ("cost", "cost", (entry.get("cost") or {}).get("loss_by_position"),
                     "extrapolation cost by position (full minus windowed loss)")):
                if values is None:
                    continue
                losses = [_finite(x) for x in values]
                table = wandb.Table(columns=["position", column], data=[[p, v] for p, v in enumerate(losses)])
                chart = "loss_by_position" if name == "loss" else f"{name}_by_position"
                run.log({f"{prefix}/{chart}": wandb.plot.line(table, "position", column,
                                                              title=f"{entry['split']} {what} {of}")})
                # summary="none": the last position's value would be a misleading summary value.
                run.define_metric(f"{prefix}/{name}", step_metric="eval/position", summary="none")
                curves[f"{prefix}/{name}"] = losses
            for band, value in (entry.get("bands") or {}).items():
                summary[f"{prefix}/band_{band}"] = _finite(value)
            # The like-for-like extrapolation cost (full minus windowed loss), bands past C only.
            for band, value in ((entry.get("cost") or {}).get("bands") or {}).items():
                if not band.startswith("0-"):
                    summary[f"{prefix}/cost_{band}"] = _finite(value)

        # One history row per position holding every curve: standard W&B line panels then
        # overlay all runs' curves against eval/position.
        for pos in range(max((len(c) for c in curves.values()), default=0)):
            row: dict[str, Any] = {"eval/position": pos}
            row.update({k: c[pos] for k, c in curves.items() if pos < len(c) and c[pos] is not None})
            run.log(row)

        lo, hi = train_context, 2 * train_context
        for band, key in ((f"0-{lo}", f"headline/loss_0_{lo}"), (f"{lo}-{hi}", f"headline/loss_{lo}_{hi}")):
            entry = _headline_entry(entries, band, hi)
            if entry is not None:
                summary[key] = _finite(entry["bands"][band])
        run.summary.update(summary)

    def log_figures(self, paths: list[Path]) -> None:
        import wandb

        # A figure that was not written is not a W&B failure: skip it rather than disable logging.
        images = {f"figures/{Path(p).stem}": Path(p) for p in paths if Path(p).is_file()}
        self._guard("log_figures", lambda run: run.log({k: wandb.Image(str(p)) for k, p in images.items()}))

    def summary(self, values: dict) -> None:
        self._guard("summary", lambda run: run.summary.update({k: _scalar(v) for k, v in values.items()}))


def _headline_entry(entries: list[dict], band: str, length: int) -> dict | None:
    """The validation entry for a headline band: the one of ``length``, else the shortest having it."""
    found = [e for e in headline_entries(entries) if e.get("split") == "validation" and band in (e.get("bands") or {})]
    exact = [e for e in found if e.get("length") == length]
    return (exact or sorted(found, key=lambda e: e.get("length", 0)) or [None])[0]


def _to_dict(obj: Any) -> dict:
    """A plain dict from a dict or an OmegaConf DictConfig (resolved)."""
    if obj is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(obj, DictConfig):
            return OmegaConf.to_container(obj, resolve=True)  # type: ignore[return-value]
    except ImportError:
        pass
    return dict(obj)


def _scalar(value: Any) -> Any:
    """Python number from a 0-d/1-element tensor or numpy value, so wandb logs a scalar."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except Exception:  # several elements: leave it to wandb
            return value
    return value


def _finite(value: Any) -> float | None:
    """float, or None for NaN/inf (no data at a position) so tables stay valid JSON."""
    value = float(_scalar(value))
    return value if math.isfinite(value) else None
