"""The figure toolkit every picture of posbench is drawn with (``plot``, ``plot_extension``, ``viz``).

Figures are ``matplotlib.figure.Figure`` objects rendered by Agg (no pyplot, no display, no global
backend switch); every file is written atomically. A method keeps its colour in every figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from matplotlib import colormaps
from matplotlib.figure import Figure

from posbench.errors import PosbenchError
from posbench.io import atomic_path
from posbench.methods import list_methods

FORMATS = ("png", "pdf", "svg")


def check_formats(formats: Iterable[str]) -> list[str]:
    """Validated figure formats (png, pdf, svg), deduplicated in order."""
    formats = [str(f).lower().lstrip(".") for f in ([formats] if isinstance(formats, str) else formats)]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise PosbenchError(f"unsupported figure format(s) {bad or formats}; choose from {', '.join(FORMATS)}")
    return list(dict.fromkeys(formats))


def colour_of(label: str) -> Any:
    """A stable colour per group label: a method's registry index, so a method looks the same in
    every plot; labels of method variants (``rope[base=500]``) get a colour from their name."""
    known = list_methods()
    index = known.index(label) if label in known else len(known) + sum(map(ord, label)) % 10
    palette = colormaps["tab10" if len(known) <= 10 else "tab20"]
    return palette(index % palette.N)


def new_figure(width: float = 8.0, height: float = 5.0) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


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


__all__ = ["FORMATS", "check_formats", "colour_of", "new_figure", "no_data", "save"]
