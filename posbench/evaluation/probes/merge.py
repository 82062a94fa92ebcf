"""Merging ``posbench eval``'s probe entries into a run's results.json, for every probe.

An entry is identified by (probe, split, extension) (:func:`probe_key`); the settings it was
measured under (:data:`PROBE_MEASUREMENT_FIELDS`) say whether a new entry of the same key measured
the same thing (it replaces the run's) or something else (kept beside it as a ``variant``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from posbench.runs.entries import shown_setting


def probe_key(entry: dict[str, Any]) -> tuple[str, str, str]:
    """What identifies a probe entry in results.json: (probe, split, extension)."""
    return str(entry.get("probe")), str(entry.get("split")), str(entry.get("extension", "none"))


# The settings a probe entry was measured under, beyond its key: two entries of one key that
# differ in any of them measured something else (other windows, cells, precision or checkpoint).
# An entry without ``matched_sha256`` (written before the matched control existed) differs in none
# of it: a new entry of the same windows and settings replaces it.
PROBE_MEASUREMENT_FIELDS = ("num_windows", "span", "seed", "kinds", "distances", "windows_sha256", "matched_sha256",
                            "extension_options", "precision", "checkpoint_step")


def probe_variant_label(new: dict[str, Any], reference: dict[str, Any],
                        recorded: dict[str, Any] | None = None) -> str | None:
    """``name=value,...`` for the settings (``PROBE_MEASUREMENT_FIELDS``) where ``new`` differs
    from ``reference``, None when it differs in none. A setting the reference does not record
    (``recorded`` fills in the run's own, e.g. its precision) is no difference; other windows
    that follow from another count, span, seed or kinds are not named twice."""
    theirs = {name: reference.get(name, (recorded or {}).get(name)) for name in PROBE_MEASUREMENT_FIELDS}
    differs = [name for name in PROBE_MEASUREMENT_FIELDS
               if theirs[name] is not None and new.get(name) != theirs[name]]
    if "windows_sha256" in differs and set(differs) & {"num_windows", "span", "seed", "kinds"}:
        differs.remove("windows_sha256")
    if "matched_sha256" in differs and set(differs) & {"num_windows", "span", "seed", "kinds", "windows_sha256"}:
        differs.remove("matched_sha256")  # other windows draw other matched spans
    return ",".join(f"windows={str(new.get(name))[:12]}" if name == "windows_sha256"
                    else f"matched={str(new.get(name))[:12]}" if name == "matched_sha256"
                    else f"{name}={shown_setting(new.get(name))}" for name in differs) or None


def merge_probe_entries(old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]], replace: bool = False,
                        log: Callable[[str], Any] = lambda _: None,
                        recorded: dict[str, Any] | None = None,
                        note: Callable[[dict[str, Any], dict[str, Any]], str] = lambda new, own: "") -> list[dict[str, Any]]:
    """``posbench eval``'s probe entries ``new`` merged into a run's ``old`` ones, like
    :func:`posbench.runs.entries.merge_eval_entries`: each new entry is compared with the run's own
    entry of its :func:`probe_key` (the one without ``variant``):
    - none (another split or extension): added;
    - measured the same way (same windows, cells, precision...): the new one replaces it (the
      same measurement at the run's checkpoint: nothing the run reported changes);
    - measured otherwise (:func:`probe_variant_label`, e.g. ``num_windows=8``): kept beside it
      with ``variant`` = that label, replacing only a variant of the same key and label
      (``replace``: it becomes the run's entry, the old one is kept as variant ``replaced``).
    ``recorded``: settings the run's own entries do not carry (its precision); ``note(new, own)``:
    what a replacing entry adds, for the log line."""
    current = list(old)
    for entry in new:
        key = probe_key(entry)
        own = next((e for e in current if probe_key(e) == key and "variant" not in e), None)
        label = None if own is None else probe_variant_label(entry, own, recorded)
        described = f"{key[0]} probe {key[1]} extension {key[2]}"
        if own is None:
            current.append(entry)
        elif label is None:
            current = [e for e in current if e is not own] + [entry]
            log(f"the {described} replaces the run's entry: measured the same way{note(entry, own)}")
        elif replace:
            current = [e for e in current if e is not own and (probe_key(e), e.get("variant")) != (key, "replaced")]
            current += [{**own, "variant": "replaced"}, entry]
            log(f"eval.replace=true: the {described} replaces the run's entry (kept as variant 'replaced')")
        else:
            current = [e for e in current if (probe_key(e), e.get("variant")) != (key, label)]
            current.append({**entry, "variant": label})
            log(f"kept the run's {described}; the new one ({label}) is stored beside it under that variant "
                "(eval.replace=true makes it the run's entry instead)")
    return current


__all__ = ["PROBE_MEASUREMENT_FIELDS", "merge_probe_entries", "probe_key", "probe_variant_label"]
