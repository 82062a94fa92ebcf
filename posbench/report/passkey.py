"""The passkey evaluation's figure: accuracy by depth x length, one heatmap per results.json entry.

Written into a run's ``figures/`` (``passkey.<fmt>``; ``passkey_<extension>.<fmt>`` for a context
extension) whenever its results.json holds ``passkey`` entries (``eval.probes=[passkey]``, see
:mod:`posbench.evaluation.probes.passkey`). Each cell shows the exact-match accuracy (colour and first line) and
the matched gain in nats over the control without the key (second line) and the mean distance
from the key to its answer (third line); the title names chance
(1e-5) and the control's accuracy, the best the model does without reading the key. A dotted
line separates the lengths inside the training context from those past it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
from matplotlib.figure import Figure

from posbench.report.figures import new_figure, save
from posbench.runs.results_types import Results


def passkey_figure(entry: dict[str, Any], title: str = "") -> Figure:
    """Heatmap of ``entry``'s accuracy: depths (rows) x lengths (columns)."""
    lengths, depths = list(entry["lengths"]), list(entry["depths"])
    cells = {(c["length"], c["depth"]): c for c in entry["cells"]}
    accuracy = np.full((len(depths), len(lengths)), np.nan)  # (depths, lengths)
    fig = new_figure(1.6 * len(lengths) + 2.5, 0.6 * len(depths) + 2.0)
    ax = fig.add_subplot()
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            c = cells.get((n, d))
            if c is None:
                continue
            accuracy[i, j] = c["accuracy"]
            ax.text(j, i, f"{c['accuracy']:.2f}\n{c['gain']:+.1f} nats\nd = {c['distance']:.0f}", ha="center",
                    va="center", fontsize=7,
                    color="white" if c["accuracy"] < 0.5 else "black")
    image = ax.imshow(accuracy, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    fig.colorbar(image, ax=ax, label="exact-match accuracy")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("window length L (tokens)")
    ax.set_ylabel("depth of the key (0 = window start)")
    inside = sum(n <= entry["train_context"] for n in lengths)
    if 0 < inside < len(lengths):
        ax.axvline(inside - 0.5, color="white", linestyle=":", linewidth=1.5)
    control = np.mean([c["control_accuracy"] for c in entry["cells"]])
    extension = "" if entry.get("extension", "none") == "none" else f", extension {entry['extension']}"
    ax.set_title(f"{title}passkey accuracy ({entry['num_windows']} windows per cell{extension}; "
                 f"C = {entry['train_context']})\nchance {entry['chance']:g}; control without the key "
                 f"{control:.2f}; in each cell: accuracy, gain over the control, distance key-answer", fontsize=9)
    return fig


def run_figures(results: Results | None, out_dir: Path, formats: Sequence[str], title: str = "") -> list[Path]:
    """The passkey evaluation's figure hook (:class:`posbench.evaluation.probes.Probe` ``report``):
    ``passkey[_<extension>].<fmt>`` in ``out_dir`` for each of the run's own passkey entries."""
    written: list[Path] = []
    for entry in (results or {}).get("passkey") or []:
        if "variant" in entry:
            continue
        extension = entry.get("extension", "none")
        stem = "passkey" if extension == "none" else f"passkey_{extension}"
        written += save(passkey_figure(entry, title), out_dir, stem, formats)
    return written


__all__ = ["passkey_figure", "run_figures"]
