"""The eval entries of a results.json: what identifies one, which are the run's headline, and how
``posbench eval`` merges new ones in without changing the headline (docs/results-schema.md)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from posbench.runs.results_types import LossEntry, Results, TaskEntry


def entry_extension(entry: LossEntry | TaskEntry) -> str:
    """The context extension an eval entry was measured under (``none``: the plain model;
    entries written before extensions existed have no key and are plain)."""
    return str(entry.get("extension", "none"))


def entry_key(entry: LossEntry) -> tuple[str, int, str]:
    """What identifies an eval entry: (split, length, extension)."""
    return entry["split"], entry["length"], entry_extension(entry)


def plain_entries(entries: Iterable[LossEntry]) -> list[LossEntry]:
    """The eval entries of the plain model (no context extension)."""
    return [e for e in entries if entry_extension(e) == "none"]


def headline_entries(entries: Iterable[LossEntry]) -> list[LossEntry]:
    """The plain entries a run's headline is read from: those of its training-time evaluation.

    ``posbench eval`` marks what it adds later (``"added": true``, e.g. a new length), so an
    added entry never becomes the headline; files from before the mark have none to skip."""
    plain = plain_entries(entries)
    return [e for e in plain if not e.get("added")] or plain


# The settings an eval entry was measured under, beyond its key: two entries of one key that
# differ in any of them were measured on other windows or otherwise, so neither replaces the other.
MEASUREMENT_FIELDS = ("num_sequences", "sequences_sha256", "window_stride", "extension_factor", "extension_options",
                      "extension_scope", "precision", "checkpoint_step")


def entry_measurement(entry: LossEntry, recorded: dict[str, Any] | None = None) -> dict[str, Any]:
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


def variant_label(new: LossEntry, reference: LossEntry, recorded: dict[str, Any] | None = None) -> str | None:
    """``name=value,...`` for the measurement settings where ``new`` differs from ``reference``
    (None when it differs in none): the key ``posbench eval`` files a non-headline entry under.
    A setting the reference does not record (older entries) does not count as a difference,
    and the extension factor counts only between entries of one extension."""
    ours, theirs = entry_measurement(new), entry_measurement(reference, recorded)
    if entry_extension(new) != entry_extension(reference):
        for name in ("extension_factor", "extension_options", "extension_scope"):
            ours.pop(name), theirs.pop(name)
    differs = [name for name in ours if theirs.get(name) is not None and ours[name] != theirs[name]]
    if "num_sequences" in differs and "sequences_sha256" in differs:  # other windows follow from another
        differs.remove("sequences_sha256")  # count: say the count (older entries record no checksum)
    return ",".join(f"windows={ours[name][:12]}" if name == "sequences_sha256" else f"{name}={shown_setting(ours[name])}"
                    for name in differs) or None


def merge_eval_entries(results: Results, entries: list[LossEntry], replace: bool,
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
