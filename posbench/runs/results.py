"""results.json, status.json and metrics.jsonl: writing, reading and finding runs.

A run directory (docs/run-directory.md) holds ``config.yaml``, ``metrics.jsonl``, ``status.json``,
``results.json`` (only when completed), ``checkpoints/`` and ``figures/``. Everything here that
reads runs is tolerant: a crashed, running or corrupt run becomes a *problem* with a reason, never
an exception, so one bad run cannot hide the results of the others.
"""

from __future__ import annotations

import datetime as _dt
import errno
import glob
import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from posbench import __version__
from posbench.config import method_option_names
from posbench.core.io import write_json_atomic

SCHEMA_VERSION = 1

RESULTS_FILE = "results.json"
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
# Written instead of status.json when a start was refused next to an earlier run's record
# (e.g. a resume under another config): the record stays, the sweep summary counts a failure.
REFUSED_FILE = "refused.json"
STATUSES = ("running", "completed", "failed", "interrupted")

_REQUIRED_TOP = ("schema_version", "method", "seed", "train_context", "train", "eval")
_REQUIRED_TRAIN = ("tokens", "steps", "final_loss", "tokens_per_second", "wall_seconds", "device")
_REQUIRED_EVAL = ("split", "length", "num_sequences", "loss_by_position", "bands")
# Folders inside a run (or a Hydra job) that never contain runs themselves.
_SKIP_DIRS = {"checkpoints", "figures", "comparison", "wandb", "__pycache__"}


def entry_extension(entry: dict[str, Any]) -> str:
    """The context extension an eval entry was measured under (``none``: the plain model;
    entries written before extensions existed have no key and are plain)."""
    return str(entry.get("extension", "none"))


def entry_key(entry: dict[str, Any]) -> tuple[str, int, str]:
    """What identifies an eval entry: (split, length, extension)."""
    return entry["split"], entry["length"], entry_extension(entry)


def plain_entries(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eval entries of the plain model (no context extension)."""
    return [e for e in entries if entry_extension(e) == "none"]


def headline_entries(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The plain entries a run's headline is read from: those of its training-time evaluation.

    ``posbench eval`` marks what it adds later (``"added": true``, e.g. a new length), so an
    added entry never becomes the headline; files from before the mark have none to skip."""
    plain = plain_entries(entries)
    return [e for e in plain if not e.get("added")] or plain


# The settings an eval entry was measured under, beyond its key: two entries of one key that
# differ in any of them were measured on other windows or otherwise, so neither replaces the other.
MEASUREMENT_FIELDS = ("num_sequences", "sequences_sha256", "window_stride", "extension_factor", "extension_options",
                      "precision", "checkpoint_step")


def entry_measurement(entry: dict[str, Any], recorded: dict[str, Any] | None = None) -> dict[str, Any]:
    """What an entry was measured on and how (see ``MEASUREMENT_FIELDS``); a field the entry
    lacks is taken from ``recorded`` (what the run records for all its entries), else None."""
    values = {name: entry.get(name, (recorded or {}).get(name)) for name in MEASUREMENT_FIELDS}
    values["window_stride"] = (entry.get("windowed") or {}).get("stride")
    return values


def shown_setting(value: Any) -> str:
    """A measurement setting in a variant label: lists as ``a/b``, mappings (an extension's
    settings) as ``key:value/key:value``, anything else as ``str``."""
    if isinstance(value, dict):
        return "/".join(f"{k}:{v}" for k, v in value.items())
    return "/".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def variant_label(new: dict[str, Any], reference: dict[str, Any], recorded: dict[str, Any] | None = None) -> str | None:
    """``name=value,...`` for the measurement settings where ``new`` differs from ``reference``
    (None when it differs in none): the key ``posbench eval`` files a non-headline entry under.
    A setting the reference does not record (older entries) does not count as a difference,
    and the extension factor counts only between entries of one extension."""
    ours, theirs = entry_measurement(new), entry_measurement(reference, recorded)
    if entry_extension(new) != entry_extension(reference):
        for name in ("extension_factor", "extension_options"):
            ours.pop(name), theirs.pop(name)
    differs = [name for name in ours if theirs.get(name) is not None and ours[name] != theirs[name]]
    if "num_sequences" in differs and "sequences_sha256" in differs:  # other windows follow from another
        differs.remove("sequences_sha256")  # count: say the count (older entries record no checksum)
    return ",".join(f"windows={ours[name][:12]}" if name == "sequences_sha256" else f"{name}={shown_setting(ours[name])}"
                    for name in differs) or None


def merge_eval_entries(results: dict[str, Any], entries: list[dict[str, Any]], replace: bool,
                       log: Callable[[str], None], recorded: dict[str, Any] | None = None) -> None:
    """Merge ``posbench eval``'s new ``entries`` into ``results`` (in place) without ever
    changing the run's headline behind the user's back. ``recorded``: measurement settings
    the run's own entries do not carry (its precision), see :func:`entry_measurement`.

    Each new entry is compared with the run's entry of the same key (split, length, extension),
    else with its plain entry of that split and length (the windows its other entries share):
    - measured the same way (same windows, count, stride, precision...): the run's entry is kept
      as it is and the new one dropped (``replace``: the new one replaces it);
    - measured otherwise: it goes to ``results["eval_variants"]`` with ``variant`` = what
      differs (``num_sequences=64``...), replacing only a variant of the same key and label
      (``replace``: it replaces the run's entry, which moves to the variants as ``replaced``);
    - nothing to compare with (a new split or length): added to ``eval``, marked ``added`` so
      the headline stays the training-time one (``replace``: unmarked).
    """
    current = list(results.get("eval", []))
    variants = list(results.get("eval_variants", []))
    index = {entry_key(e): e for e in current}
    plain = {(e["split"], e["length"]): e for e in plain_entries(current)}
    for entry in entries:
        reference = index.get(entry_key(entry)) or plain.get((entry["split"], entry["length"]))
        label = None if reference is None else variant_label(entry, reference, recorded)
        same_key = index.get(entry_key(entry))
        described = f"{entry['split']} length {entry['length']} extension {entry_extension(entry)}"
        if replace:
            if same_key is not None:
                current.remove(same_key)
                variants = [v for v in variants if (entry_key(v), v.get("variant")) != (entry_key(same_key), "replaced")]
                variants.append({**same_key, "variant": "replaced"})
                log(f"eval.replace=true: {described} replaces the run's entry (kept in eval_variants as 'replaced')")
            current.append(entry)
        elif label is not None:
            variants = [v for v in variants if (entry_key(v), v.get("variant")) != (entry_key(entry), label)]
            variants.append({**entry, "variant": label})
            log(f"kept the run's {described}; the new one ({label}) is stored in eval_variants under that label "
                "(eval.replace=true makes it the run's entry instead)")
        elif same_key is not None:
            log(f"kept the run's {described}: measured on the same windows (eval.replace=true overwrites it)")
        else:
            current.append({**entry, "added": True})
    order = lambda e: (e["split"] != "validation", e["length"], entry_extension(e) != "none", str(e.get("variant")))  # noqa: E731
    results["eval"] = sorted(current, key=order)
    if variants:
        results["eval_variants"] = sorted(variants, key=order)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def versions() -> dict[str, str]:
    """Software and device the results were produced with."""
    import torch  # here: reading results needs no torch

    return {"posbench": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda or "",
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()}


def build_results(
    *,
    method: str,
    seed: int,
    train_context: int,
    train: dict[str, Any],
    eval: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """Assemble a results.json dict (schema ``SCHEMA_VERSION``) and validate it.

    ``extra`` keys (``run_name``, ``model``, ``data``, ``config``...) are stored as given;
    ``created`` and ``versions`` are filled in unless passed.
    """
    results = {
        "schema_version": SCHEMA_VERSION,
        "method": method,
        "seed": seed,
        "train_context": train_context,
        "train": dict(train),
        "eval": list(eval),
    }
    extra.setdefault("created", _now())
    extra.setdefault("versions", versions())
    results.update(extra)
    validate_results(results)
    return results


def validate_results(results: Any) -> dict[str, Any]:
    """Check the results.json schema; raise ``ValueError`` naming the first problem found."""
    if not isinstance(results, dict):
        raise ValueError(f"results must be a JSON object, got {type(results).__name__}")
    for key in _REQUIRED_TOP:
        if key not in results:
            raise ValueError(f"missing key {key!r}")
    version = results["schema_version"]
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(f"schema_version {version!r} is not supported (this posbench reads <= {SCHEMA_VERSION})")
    train = results["train"]
    if not isinstance(train, dict):
        raise ValueError("'train' must be an object")
    for key in _REQUIRED_TRAIN:
        if key not in train:
            raise ValueError(f"missing key 'train.{key}'")
    for section in ("eval", "eval_variants"):  # eval_variants: optional (see merge_eval_entries)
        if section == "eval_variants" and section not in results:
            continue
        if not isinstance(results[section], list):
            raise ValueError(f"'{section}' must be a list")
        for i, entry in enumerate(results[section]):
            _validate_entry(f"{section}[{i}]", entry)
    return results


def _validate_entry(where: str, entry: Any) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"'{where}' must be an object")
    for key in _REQUIRED_EVAL:
        if key not in entry:
            raise ValueError(f"missing key '{where}.{key}'")
    if len(entry["loss_by_position"]) != entry["length"]:
        raise ValueError(
            f"{where}.loss_by_position has {len(entry['loss_by_position'])} values for length {entry['length']}"
        )
    if not isinstance(entry["bands"], dict):
        raise ValueError(f"'{where}.bands' must be an object")
    for block in ("windowed", "cost"):  # optional (older files lack them), but whole when present
        if block in entry and len(entry[block].get("loss_by_position", ())) != entry["length"]:
            raise ValueError(f"{where}.{block}.loss_by_position must have {entry['length']} values")


def write_results(run_dir: str | os.PathLike, results: dict[str, Any]) -> Path:
    """Validate and atomically write ``<run_dir>/results.json``; returns its path."""
    validate_results(results)
    path = Path(run_dir) / RESULTS_FILE
    write_json_atomic(path, results)
    return path


def read_results(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a results.json (``path`` may be the file or its run directory).

    Raises ``OSError`` / ``json.JSONDecodeError`` / ``ValueError`` for missing, corrupt or
    invalid files.
    """
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    with open(path) as f:
        return validate_results(json.load(f))


def quarantine(path: str | os.PathLike, why: str, log: Callable[[str], None], copy: bool = False) -> Path:
    """Set a damaged record aside as ``<name>.corrupt`` (kept for inspection; ``copy`` keeps the
    original in place for the caller to rewrite) and say so in one line."""
    import shutil

    path = Path(path)
    aside = path.with_name(path.name + ".corrupt")
    if copy:
        shutil.copyfile(path, aside)
    else:
        os.replace(path, aside)
    log(f"{path} {why}; moved it aside to {aside.name} and recomputing it from the last good checkpoint")
    return aside


def read_results_or_quarantine(run_dir: str | os.PathLike, log: Callable[[str], None]) -> dict[str, Any] | None:
    """A run's results.json, or None when it is missing or damaged. A damaged one (not JSON,
    not valid results) is quarantined, so the run's final checkpoint can recompute it."""
    path = Path(run_dir) / RESULTS_FILE
    try:
        return read_results(path)
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError) as err:  # json.JSONDecodeError is a ValueError
        quarantine(path, f"is damaged ({str(err).splitlines()[0][:120]})", log)
        return None


def read_refusal(run_dir: str | os.PathLike) -> str | None:
    """The error of a refused start in ``run_dir`` (see ``REFUSED_FILE``), or None."""
    try:
        record = json.loads((Path(run_dir) / REFUSED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return str(record.get("error")) if isinstance(record, dict) else "refused"


def finished_runs(runs: Iterable[RunRecord], problems: Iterable[tuple[str, str]]
                  ) -> tuple[list[RunRecord], list[tuple[str, str]]]:
    """The runs a comparison may show, and the rest as problems (sorted). Left out, beside what
    :func:`discover_runs` already leaves out (failed, running, interrupted, corrupt): a run whose
    last start was refused (its results.json is an earlier run's; see ``REFUSED_FILE``) and a
    results.json with no evaluation of the plain model (no final results)."""
    kept, dropped = [], []
    for run in runs:
        if (why := read_refusal(run.path)) is not None:
            dropped.append((str(run.path), f"refused (its earlier results are kept): {why}"))
        elif not plain_entries(run.results["eval"]) and not (run.results.get("task") or {}).get("entries"):
            dropped.append((str(run.path), "no final results: its results.json holds no evaluation of the model"))
        else:
            kept.append(run)
    problems = [(path, f"refused: {why}" if (why := read_refusal(path)) else reason) for path, reason in problems]
    return kept, sorted(problems + dropped)


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of ``<run_dir>/metrics.jsonl`` ([] when absent).

    Unparseable lines are skipped: the last line of a killed run is often cut mid-write.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``<run_dir>/config.yaml`` as a dict ({} when missing or unreadable)."""
    import yaml

    try:
        config = yaml.safe_load((Path(run_dir) / CONFIG_FILE).read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def write_status(run_dir: str | os.PathLike, status: str, error: str | None = None, **extra: Any) -> Path:
    """Atomically write ``<run_dir>/status.json`` = ``{"status", "error", **extra, "updated"}``.

    ``status`` is one of ``STATUSES``: running, completed, failed, interrupted (stopped by a
    signal or ``trainer.stop_after_steps`` with a checkpoint to resume from).
    """
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    path = Path(run_dir) / STATUS_FILE
    record = {"status": status, "error": error, **extra, "updated": _now()}
    try:
        write_json_atomic(path, record)
    except OSError as err:
        if err.errno != errno.ENOSPC or not path.is_file():
            raise
        # A full disk has no room for the temporary copy; a status is small enough to overwrite
        # in place (within the blocks the file has), so a failed run still says so.
        with open(path, "r+") as f:
            f.write(json.dumps(record, indent=2) + "\n")
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    return path


def read_status(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """``<run_dir>/status.json`` as a dict, or None when missing or unreadable."""
    try:
        with open(Path(run_dir) / STATUS_FILE) as f:
            status = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return status if isinstance(status, dict) else None


def recorded_precision(results: dict[str, Any], config: Any) -> str | None:
    """The precision a run trained and was evaluated in (``bf16``, ``fp32``): its results.json
    ``environment``, else its config's ``trainer.precision`` when that names one; None when
    unknown (``auto`` before posbench recorded what it resolved to)."""
    recorded = (results.get("environment") or {}).get("precision")
    if recorded:
        return str(recorded)
    configured = str((config.get("trainer") or {}).get("precision") or "auto")
    return configured if configured in ("fp32", "bf16") else None


@dataclass
class RunRecord:
    """A run with a valid results.json. ``metrics`` is read from metrics.jsonl on first use."""

    path: Path
    results: dict[str, Any]
    status: dict[str, Any] | None = None
    _metrics: list[dict[str, Any]] | None = field(default=None, repr=False)
    _config: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def method(self) -> str:
        return str(self.results["method"])

    @property
    def seed(self) -> Any:
        return self.results["seed"]

    @property
    def train_context(self) -> int:
        return int(self.results["train_context"])

    @property
    def method_options(self) -> dict[str, Any]:
        """The method options the run trained with: an option its results.json does not record
        takes the value it had before the option existed (the method's ``options_before``), not
        today's default. Only such a run's method module is imported to read that: a run that
        records every option of ``configs/method/<name>.yaml`` is read without it (or torch)."""
        recorded = dict(self.results.get("method_options") or {})
        shipped = method_option_names(self.method)
        if shipped is not None and shipped <= set(recorded):
            return recorded
        from posbench.methods import saved_options

        return saved_options(self.method, recorded)

    def plain(self) -> RunRecord:
        """The same run with only its plain eval entries (what the method comparisons read)."""
        results = {**self.results, "eval": plain_entries(self.results["eval"])}
        return RunRecord(self.path, results, self.status, self._metrics, self._config)

    @property
    def config(self) -> dict[str, Any]:
        """The run's resolved ``config.yaml`` ({} when absent or unreadable)."""
        if self._config is None:
            self._config = read_config(self.path)
        return self._config

    @property
    def precision(self) -> str:
        """The precision the run trained in (``bf16``, ``fp32``), or ``unknown`` for results.json
        files from before posbench recorded it (``environment``) under ``trainer.precision=auto``."""
        return recorded_precision(self.results, self.config) or "unknown"

    def variant(self, label: str) -> RunRecord:
        """The run as measured under ``label`` (an ``eval_variants`` label, e.g. ``num_sequences=64``,
        see :func:`merge_eval_entries`): those entries, plus the run's own at lengths the variant
        lacks (which ``posbench eval`` measured the same way, having nothing to compare them with).
        Raises ``KeyError`` when the run has no entry of that label."""
        chosen = [e for e in self.results.get("eval_variants", []) if e.get("variant") == label]
        if not chosen:
            raise KeyError(label)
        covered = {(e["split"], e["length"]) for e in chosen}
        own = [e for e in self.results["eval"] if (e["split"], e["length"]) not in covered]
        results = {**self.results, "eval": sorted(own + chosen, key=lambda e: (e["split"] != "validation", e["length"],
                                                                               entry_extension(e) != "none"))}
        return RunRecord(self.path, results, self.status, self._metrics)

    @property
    def name(self) -> str:
        return str(self.results.get("run_name") or self.path.name)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        if self._metrics is None:
            self._metrics = read_metrics(self.path)
        return self._metrics


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def _markers(directory: Path) -> tuple[bool, bool]:
    """(strong, weak): strong = results/status file; weak = config/metrics or a Hydra job dir."""
    strong = (directory / RESULTS_FILE).is_file() or (directory / STATUS_FILE).is_file()
    weak = (
        (directory / CONFIG_FILE).is_file()
        or (directory / METRICS_FILE).is_file()
        or (directory / ".hydra" / "config.yaml").is_file()
    )
    return strong, weak


def _run_dirs_under(root: Path) -> list[Path]:
    """Run directories at or below ``root`` (hidden folders and run sub-folders are skipped)."""
    strong_dirs, weak_dirs = [], []
    for current, subdirs, _files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d not in _SKIP_DIRS)
        here = Path(current)
        strong, weak = _markers(here)
        if strong:
            strong_dirs.append(here)
            subdirs[:] = []  # a run does not contain other runs
        elif weak:
            weak_dirs.append(here)
    # A dir with only weak markers (e.g. a Hydra job dir) that contains a real run is not a run.
    strong_set = set(strong_dirs)
    weak_dirs = [w for w in weak_dirs if not any(w in s.parents for s in strong_set)]
    return sorted(strong_dirs + weak_dirs)


def _problem_reason(run_dir: Path) -> str:
    status = read_status(run_dir)
    if status is None:
        if (run_dir / STATUS_FILE).exists():
            return "no results.json and unreadable status.json"
        return "no results.json (still running, or crashed before writing status.json?)"
    state = status.get("status")
    if state == "failed":
        return f"failed: {status.get('error') or 'no error message recorded'}"
    if state == "interrupted":
        return f"interrupted: {status.get('error') or 'stopped early'} (resume with trainer.resume=<this run dir>)"
    if state == "completed":
        return "status says completed but results.json is missing"
    return "no results.json (still running?)"


def discover_runs(patterns: Iterable[str | os.PathLike]) -> tuple[list[RunRecord], list[tuple[str, str]]]:
    """Find runs from run dirs, sweep dirs (searched recursively), results.json files or globs.

    Returns ``(ok, problems)``: ``ok`` holds a :class:`RunRecord` per valid results.json (sorted
    by path); ``problems`` a ``(path, reason)`` per run directory without a usable results.json
    (failed, running, corrupt) and per pattern that matched nothing. Never raises for bad runs.
    """
    problems: list[tuple[str, str]] = []
    run_dirs: list[Path] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        matches = sorted(glob.glob(pattern, recursive=True)) if _is_glob(pattern) else [pattern]
        matches = [m for m in matches if os.path.exists(m)]
        if not matches:
            problems.append((pattern, "no such file or directory"))
            continue
        found = []
        for match in map(Path, matches):
            if match.is_file():
                if match.name == RESULTS_FILE:
                    found.append(match.parent)
            else:
                found.extend(_run_dirs_under(match))
        if not found:
            problems.append((pattern, "no run directories found (no results.json, status.json or config.yaml)"))
        run_dirs.extend(found)

    ok: list[RunRecord] = []
    seen: set[Path] = set()
    for run_dir in run_dirs:
        key = run_dir.resolve()
        if key in seen:
            continue
        seen.add(key)
        results_path = run_dir / RESULTS_FILE
        status = read_status(run_dir)
        state = (status or {}).get("status")
        if not results_path.exists():
            problems.append((str(run_dir), _problem_reason(run_dir)))
            continue
        if state in ("running", "failed", "interrupted"):
            # A results.json beside such a status is from an earlier finish (the run is being
            # continued, or a later attempt failed): it does not describe the run as it is now.
            reason = "status.json says running (being continued, or killed)" if state == "running" else _problem_reason(run_dir)
            problems.append((str(run_dir), f"{reason}; its results.json is from an earlier finish"))
            continue
        try:
            results = read_results(results_path)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            problems.append((str(run_dir), f"corrupt results.json: {err}"))
        except ValueError as err:
            problems.append((str(run_dir), f"invalid results.json: {err}"))
        except OSError as err:
            problems.append((str(run_dir), f"unreadable results.json: {err}"))
        else:
            ok.append(RunRecord(path=run_dir, results=results, status=status))
    ok.sort(key=lambda r: str(r.path))
    return ok, problems
