"""The figure toolkit every picture of posbench is drawn with (``plot``, ``plot_extension``, ``viz``).

Figures are ``matplotlib.figure.Figure`` objects rendered by Agg (no pyplot, no display, no global
backend switch); every file is written atomically. A method keeps its colour in every figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from matplotlib import colormaps
from matplotlib.figure import Figure

from posbench.core.errors import PosbenchError
from posbench.core.io import atomic_path
from posbench.report.listing import method_names

FORMATS = ("png", "pdf", "svg")


def check_formats(formats: Iterable[str]) -> list[str]:
    """Validated figure formats (png, pdf, svg), deduplicated in order."""
    formats = [str(f).lower().lstrip(".") for f in ([formats] if isinstance(formats, str) else formats)]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise PosbenchError(f"unsupported figure format(s) {bad or formats}; choose from {', '.join(FORMATS)}")
    return list(dict.fromkeys(formats))


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "-.", ":", (0, (3, 1, 1, 1, 1, 1)))
"""Line styles of the curves from 11 labels on (never ``--``: dashed marks the windowed curves)."""


def palette() -> list[Any]:
    """20 qualitative colours: tab20's ten strong ones first, then their light partners."""
    tab20 = colormaps["tab20"]
    return [tab20(i) for i in range(0, 20, 2)] + [tab20(i) for i in range(1, 20, 2)]


def line_styles(labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{label: {"color", "marker", "linestyle"}}`` for the curves of one figure, every label distinct.

    A method keeps its registry index as its colour in every figure; other labels (variants,
    ``rope[steps=60]``) take the first colour no label of the figure uses. 20 colours in all;
    from 11 labels on every curve also gets a marker and a line style (tab20's light partners
    resemble their strong colours, so they are drawn dash-dotted; a colour used again, past 20
    labels, takes the next style), chosen so that no two labels share colour and line style, nor
    colour and marker. Up to 10 labels every line is solid.
    """
    known, colours = list(method_names()), palette()
    labels = list(dict.fromkeys(labels))
    index: dict[str, int] = {}
    for label in labels:
        if label in known and known.index(label) < len(colours) and known.index(label) not in index.values():
            index[label] = known.index(label)
    for n, label in enumerate(labels):
        if label not in index:
            free = [i for i in range(len(colours)) if i not in index.values()]
            index[label] = free[0] if free else n % len(colours)
    styles, used, used_lines = {}, set(), set()
    for n, label in enumerate(labels):
        marker, linestyle = None, "-"
        if len(labels) > 10:
            m = n % len(MARKERS)
            while (index[label], m) in used and len(used) < len(colours) * len(MARKERS):
                m = (m + 1) % len(MARKERS)
            used.add((index[label], m))
            marker = MARKERS[m]
            k = 1 if index[label] >= 10 else 0  # the light partners: dash-dotted
            while (index[label] % 10, k) in used_lines and len(used_lines) < 10 * len(LINESTYLES):
                k = (k + 1) % len(LINESTYLES)
            used_lines.add((index[label] % 10, k))
            linestyle = LINESTYLES[k]
        styles[label] = {"color": colours[index[label]], "marker": marker, "linestyle": linestyle}
    return styles


def colour_of(label: str) -> Any:
    """A label's colour when it is drawn alone (one method's figure, the viz overview)."""
    return line_styles([label])[label]["color"]


def new_figure(width: float = 8.0, height: float = 5.0) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


LEGEND_ONE_COLUMN = 18
"""A legend of more entries than this takes two columns (:func:`legend_outside`)."""


def legend_outside(ax: Any, fontsize: float = 8, **kwargs: Any) -> Any:
    """The legend to the right of the axes, never over the data (None without labelled artists)."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles and "handles" not in kwargs:
        return None
    count = len(kwargs.get("handles", handles))
    return ax.legend(*(() if "handles" in kwargs else (handles, labels)), loc="upper left", bbox_to_anchor=(1.01, 1.0),
                     borderaxespad=0.0, fontsize=fontsize, ncols=1 if count <= LEGEND_ONE_COLUMN else 2, **kwargs)


def save(fig: Figure, out_dir: Path, stem: str, formats: Sequence[str]) -> list[Path]:
    """Write ``fig`` as ``<out_dir>/<stem>.<fmt>`` for every format, atomically."""
    written = []
    for fmt in formats:
        path = Path(out_dir) / f"{stem}.{fmt}"
        with atomic_path(path) as tmp:  # tmp has no suffix, hence the explicit format
            fig.savefig(tmp, format=fmt, dpi=150)
        written.append(path)
    return written


def no_data(fig: Figure, ax: Any, text: str) -> None:
    """An empty panel that says why."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


__all__ = ["FORMATS", "LEGEND_ONE_COLUMN", "LINESTYLES", "MARKERS", "check_formats", "colour_of", "legend_outside", "line_styles", "new_figure",
           "no_data", "palette", "save"]
