"""Markdown table of a run's context extensions with paired 95 % intervals against `none`.

    python scripts/extension_table.py <run dir> [<eval_variants label, e.g. num_sequences=64>]

For each extension and band (each band from the shortest evaluated length containing it), the
loss and the change against the plain model with a percentile-bootstrap 95 % interval over the
evaluated sequences, paired: every entry of one length scores the same windows (same
``sequences_sha256``), so the per-sequence differences are what is resampled. `*` marks an
interval that excludes 0. This is what the README's "Context extension" example shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from posbench.commands.cli import run_script
from posbench.core.errors import PosbenchError
from posbench.evaluation.stats import bootstrap_interval
from posbench.report.compare import band_key
from posbench.runs.entries import entry_extension
from posbench.runs.results import read_results
from posbench.runs.run_record import RunRecord


def load(run_dir: str, variant: str | None) -> list[dict]:
    """The run's validation entries (of ``variant``), or one line naming what is wrong."""
    try:
        results = read_results(run_dir)
    except (OSError, json.JSONDecodeError, ValueError) as err:
        raise PosbenchError(f"{run_dir} has no readable results.json ({type(err).__name__}); "
                            "give the directory of a finished run") from None
    if variant:  # the entries posbench eval kept under this eval_variants label
        try:
            results = RunRecord(Path(run_dir), results).variant(variant).results
        except (KeyError, ValueError, PosbenchError):
            known = ", ".join(sorted({e.get("variant", "") for e in results.get("eval_variants", [])})) or "none"
            raise PosbenchError(f"{run_dir} has no eval variant {variant!r} (it has: {known})") from None
    entries = [e for e in results["eval"] if e["split"] == "validation"]
    if not any(entry_extension(e) == "none" for e in entries):
        raise PosbenchError(f"{run_dir} has no plain (extension none) validation entry to compare against; "
                            "evaluate it with posbench eval run=<dir> 'eval.extension=[none,...]'")
    return entries


def main(run_dir: str, variant: str | None = None) -> str:
    entries = load(run_dir, variant)
    bands = sorted({b for e in entries for b in e["bands"]}, key=band_key)
    # band -> the shortest length containing it
    home = {b: min(e["length"] for e in entries if b in e["bands"]) for b in bands}
    names = list(dict.fromkeys(entry_extension(e) for e in entries))

    def entry(name: str, length: int) -> dict:
        return next(e for e in entries if entry_extension(e) == name and e["length"] == length)

    lines = ["| extension | " + " | ".join(bands) + " |", "|---|" + "---:|" * len(bands)]
    for name in names:
        cells = []
        for band in bands:
            mine, plain = entry(name, home[band]), entry("none", home[band])
            value = mine["bands"][band]
            if name == "none":
                cells.append(f"{value:.3f}")
                continue
            assert mine["sequences_sha256"] == plain["sequences_sha256"]
            diff = np.subtract(mine["sequence_bands"][band], plain["sequence_bands"][band])
            ci = bootstrap_interval(diff)
            star = "*" if ci.low > 0 or ci.high < 0 else ""
            cells.append(f"{value:.3f} ({ci.mean:+.3f} [{ci.low:+.3f}, {ci.high:+.3f}]{star})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cli(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        raise PosbenchError("usage: python scripts/extension_table.py <run dir> [<eval variant, e.g. num_sequences=64>]")
    print(main(*argv))
    return 0


if __name__ == "__main__":
    run_script("extension_table", cli)
