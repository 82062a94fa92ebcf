"""Grouping runs for the comparison tables: a group is the runs of one experiment, one per seed.

A group holds the runs that differ only by seed (:func:`run_facets` lists what else must agree):
method and options, model, training context, training budget (steps, tokens) and the trainer
settings that change a result (``posbench.train.settings.RESULT_SETTINGS``), the resolved precision
(``bf16``/``fp32``; ``unknown`` for results.json files from before posbench recorded it), the
data (tokenizer and token streams by checksum) and the evaluation windows (``sequences_sha256``
of every training-time entry). Seeds of one group are pooled; groups that differ in anything
else stay apart and are labelled by what differs (``rope[steps=60]``, ``rope[base=500]``), so a
table never averages two different experiments into one row. Two runs of one group with the
same seed are the same experiment twice, never two seeds: the repeat goes to a group of its own,
labelled ``copy 2`` (by path order), and :func:`grouping_notes` says so.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from posbench.report.listing import method_order
from posbench.runs.entries import plain_entries
from posbench.runs.run_record import RunRecord
from posbench.train.settings import RESULT_SETTINGS

# Model keys that are results, not settings (they differ when the vocabulary does, which the
# vocab_size key already says).
_MODEL_RESULT_KEYS = {"parameters", "non_embedding_parameters"}


@dataclass
class Group:
    """Runs that differ only by seed (see :func:`run_facets`), one run per seed."""

    label: str
    method: str
    facets: dict[str, Any]
    runs: list[RunRecord] = field(default_factory=list)
    copy: int = 1
    """1, or n for the n-th run of a seed already in the group (the same experiment repeated)."""


class _Absent:
    """A facet a run does not record at all (older results.json, no config.yaml): shown as
    ``unknown``; a value recorded as null is None, shown as ``none``."""

    def __repr__(self) -> str:
        return "unknown"

    __str__ = __repr__


ABSENT = _Absent()


def _digest(value: Any) -> Any:
    """A short, stable checksum of ``value`` (None: not recorded, ABSENT)."""
    if value is None:
        return ABSENT
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _data_identity(run: RunRecord) -> dict[str, Any] | None:
    """The tokenizer and token streams by checksum (None when results.json does not say)."""
    meta = (run.results.get("data") or {}).get("meta") or {}
    splits = {name: (info or {}).get("sha256") for name, info in (meta.get("splits") or {}).items()}
    tokenizer = (meta.get("tokenizer") or {}).get("sha256")
    return {"tokenizer": tokenizer, **splits} if tokenizer or splits else None


def _windows(run: RunRecord) -> dict[str, Any] | None:
    """``split@length`` -> checksum of the evaluated windows of the training-time entries (the
    entry's count where it has no checksum); entries ``posbench eval`` added later are left out."""
    entries = [e for e in plain_entries(run.results["eval"]) if not e.get("added")]
    windows = {f"{e['split']}@{e['length']}": e.get("sequences_sha256") or f"n={e['num_sequences']}"
               for e in entries}
    return windows or None


def run_facets(run: RunRecord) -> dict[str, Any]:
    """What identifies a run's experiment besides its seed, flattened to ``name: value``: two
    runs belong to one group exactly when these agree. A value a run does not record is
    ``ABSENT`` (shown as ``unknown``), a value recorded as null is None (shown as ``none``)."""
    # Options the run does not record take the value they had then (t5's bias_scale before it existed: 1.0).
    options = run.method_options
    model = {k: v for k, v in (run.results.get("model") or {}).items() if k not in _MODEL_RESULT_KEYS}
    facets: dict[str, Any] = {str(k): v for k, v in sorted(options.items())}
    facets.update({f"model.{k}": v for k, v in sorted(model.items())})
    # A run that records no mixer is an attention model (every run from before mixers existed).
    facets.setdefault("model.mixer", "attention")
    facets.setdefault("model.mixer_options", None)
    facets["C"] = run.train_context
    train = run.results["train"]
    facets["steps"], facets["tokens"] = train.get("steps", ABSENT), train.get("tokens", ABSENT)
    if train.get("state_passing"):  # a recurrent model trained from carried or noised states
        passing = train["state_passing"]
        facets["trainer.state_passing"] = passing["mode"] + (f"({passing['noise']})" if "noise" in passing else "")
    trainer = run.config.get("trainer") or {}
    facets.update({f"trainer.{name}": trainer.get(name, ABSENT) for name in RESULT_SETTINGS
                   if name not in ("context", "precision")})  # the context is C; precision resolved:
    facets["precision"] = run.precision
    facets["data"] = _digest(_data_identity(run))
    retrieval = (run.results.get("data") or {}).get("retrieval")
    if retrieval and retrieval.get("rate"):  # training text with retrievable content (data.retrieval)
        facets["data.retrieval"] = ",".join(f"{k}={v}" for k, v in sorted(retrieval.items()))
    facets["windows"] = _digest(_windows(run))
    return facets


def _shown(value: Any) -> str:
    return "none" if value is None else str(value)


def _encoded(value: Any) -> str:
    """``value`` as JSON, ABSENT apart from every recorded value (None included)."""
    return json.dumps(value, sort_keys=True, default=lambda v: "\0absent" if v is ABSENT else str(v))


def _differing(facets: Sequence[dict[str, Any]]) -> list[str]:
    """The facet names whose values are not the same in all of ``facets`` (same keys each)."""
    return [n for n in facets[0] if len({_encoded(f[n]) for f in facets}) > 1] if facets else []


def _label_facets(facets: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Candidate lists of facet names to label groups with ``facets`` (one dict per group),
    shortest first; the caller takes the first that keeps every label unique. A model preset
    that differs stands for the model settings that follow from it (``model.flavour``, plus
    the model settings that still differ within one preset), the tokens for the steps."""
    differ = _differing(facets)
    full = list(differ)
    if "model.flavour" in differ:
        by_flavour: dict[str, list[dict[str, Any]]] = {}
        for f in facets:
            by_flavour.setdefault(_encoded(f["model.flavour"]), []).append(f)
        within = {n for same in by_flavour.values() for n in _differing(same) if n.startswith("model.")}
        differ = [n for n in differ if not n.startswith("model.") or n in within] + ["model.flavour"]
    if "model.mixer" in differ and "model.mixer_options" in differ:  # the mixer stands for its options
        by_mixer: dict[str, list[dict[str, Any]]] = {}
        for f in facets:
            by_mixer.setdefault(_encoded(f["model.mixer"]), []).append(f)
        if not any("model.mixer_options" in _differing(same) for same in by_mixer.values()):
            differ.remove("model.mixer_options")
    if "steps" in differ:  # the tokens follow from the steps (and the batch, named when it differs)
        differ = [n for n in differ if n != "tokens"]
    return [differ, full]


SHOWN_FACETS = ("model.attention_window", "model.mixer", "trainer.state_passing", "data.retrieval")
"""Facets a label always shows when set (not None, not attention), whatever the other groups: a
windowed run is another model (the window baseline), never just ``rope`` because no plain rope run
is beside it; a recurrent or hybrid model (``model.mixer``) is never named as its method alone
(``nope[model.mixer=mamba2]``), nor one trained with state passing as one without; a run trained with retrievable content (``data.retrieval``) is never
pooled or named as plain."""
_NOT_SET = (None, ABSENT, "attention")

OFF_WHEN_ABSENT = ("data.retrieval", "trainer.state_passing")
"""Facets a run without them has switched off (None, shown ``none``), rather than not recorded."""


def group_runs(runs: Sequence[RunRecord]) -> dict[str, Group]:
    """Groups keyed by label, in method registry order: runs that differ only by seed (see
    :func:`run_facets`). A method with one group is labelled by its name; otherwise each label
    lists the facets that differ between that method's groups (``model.flavour`` for the model
    settings that follow from the preset, as long as the labels stay apart), and a repeated
    seed's group ``copy n``. A :data:`SHOWN_FACETS` facet that is set is always in the label.
    Labels are unique: a group never replaces another."""
    all_facets = [run_facets(run) for run in runs]
    names = sorted({n for f in all_facets for n in f})  # every run gets every key (ABSENT: not recorded)
    by_key: dict[tuple[str, str], list[RunRecord]] = {}
    facets_of: dict[tuple[str, str], dict[str, Any]] = {}
    for run, recorded in zip(runs, all_facets):
        facets = {n: recorded.get(n, None if n in OFF_WHEN_ABSENT else ABSENT) for n in names}
        key = (run.method, _encoded(facets))
        by_key.setdefault(key, []).append(run)
        facets_of[key] = facets
    split: dict[tuple[str, str], list[Group]] = {}
    for key, members in by_key.items():
        copies: list[Group] = []
        for run in sorted(members, key=lambda r: str(r.path)):
            # The n-th run of a seed goes to the n-th copy: a seed counts once per group.
            target = next((g for g in copies if all(str(r.seed) != str(run.seed) for r in g.runs)), None)
            if target is None:
                target = Group(key[0], key[0], facets_of[key], copy=len(copies) + 1)
                copies.append(target)
            target.runs.append(run)
        split[key] = copies
    groups: dict[str, Group] = {}
    for method in method_order({m for m, _ in by_key}):
        keys = [k for k in by_key if k[0] == method]
        mine = [g for k in keys for g in split[k]]
        candidates = _label_facets([facets_of[k] for k in keys]) if len(keys) > 1 else [[]]
        for differ in candidates:
            for g in mine:
                shown = [*differ, *(n for n in SHOWN_FACETS if n not in differ and g.facets.get(n) not in _NOT_SET)]
                parts = [f"{n}={_shown(g.facets[n])}" for n in shown] + ([f"copy {g.copy}"] if g.copy > 1 else [])
                g.label = f"{method}[{','.join(parts)}]" if parts else method
            if len({g.label for g in mine}) == len(mine):
                break
        for g in sorted(mine, key=lambda g: g.label):
            g.runs.sort(key=lambda r: str(r.seed))
            label, n = g.label, 1
            while g.label in groups:  # values that print alike (2 and "2"): never overwrite a group
                n += 1
                g.label = f"{label}#{n}"
            groups[g.label] = g
    return groups


def grouping_notes(groups: dict[str, Group]) -> list[str]:
    """One line per thing a reader of the grouped tables must know: methods whose runs differ in
    more than the seed (kept apart), repeated seeds (shown apart as copies), runs whose precision
    was not recorded."""
    notes = []
    methods = [m for m in method_order({g.method for g in groups.values()})
               if sum(g.method == m for g in groups.values()) > 1]
    for method in methods:
        labels = [label for label, g in groups.items() if g.method == method]
        notes.append(f"note: runs of {method} differ in more than the seed; they are kept apart as {', '.join(labels)}")
    for label, g in groups.items():
        if g.copy > 1:
            paths = ", ".join(str(r.path) for r in g.runs)
            notes.append(f"note: {label} repeats seed(s) {', '.join(str(r.seed) for r in g.runs)} of an identical "
                         f"experiment ({paths}); shown apart, never counted as more seeds")
    unknown = sum(r.precision == "unknown" for g in groups.values() for r in g.runs)
    if unknown:
        notes.append(f"note: {unknown} run(s) do not record the precision they trained in (results.json from before "
                     "posbench recorded it, trainer.precision=auto): shown as precision=unknown, never pooled with "
                     "runs that record it")
    return notes
