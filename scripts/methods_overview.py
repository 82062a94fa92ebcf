"""docs/methods-overview.md's tables of every position method, generated from the method classes.

    python scripts/methods_overview.py            # rewrite the generated regions of docs/methods-overview.md
    python scripts/methods_overview.py --check    # exit 1 when the page differs from what the code gives

Each registered method's class owns its row: ``enters``, ``source``, ``past_context`` and
``backend_note`` (class attributes of :class:`posbench.methods.PositionMethod`), and the backends
``model.attention=auto`` picks on the CPU and on CUDA are computed by the model's own rule
(:func:`posbench.model.transformer.attention_backends`, the method with its default options in a
4-layer model). One table per layout, between ``<!-- methods-overview: <layout> -->`` and
``<!-- methods-overview: <layout> end -->``; the rest of the page is written by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from config_reference import meaning_text, replace_region, write_or_check

from posbench.commands.cli import run_script
from posbench.core.errors import PosbenchError
from posbench.methods import ModelDims, build_method, list_methods, method_class
from posbench.model.transformer import ModelConfig, attention_backends

PAGE = Path(__file__).resolve().parent.parent / "docs" / "methods-overview.md"
LAYOUTS = {"sequence": "past C", "grid": "past the training grid"}
MODEL = ModelConfig(d_model=64, n_layers=4, n_heads=4)  # 4 heads: lookhere needs a multiple of 4


def methods(layout: str) -> list[str]:
    """The methods of ``layout``'s table, in registry order; a method made for both layouts (nope)
    is listed with the sequence methods."""
    return [name for name in list_methods(layout) if layout == "sequence" or "sequence" not in method_class(name).layouts]


def backends(name: str) -> str:
    """``<cpu> / <cuda>``: what ``model.attention=auto`` runs, with the method's note."""
    method = build_method(name, ModelDims(d_model=MODEL.d_model, n_heads=MODEL.n_heads, n_layers=MODEL.n_layers))
    cpu, cuda = (attention_backends(MODEL, method, torch.device(d)) for d in ("cpu", "cuda"))
    note = type(method).backend_note
    return f"{cpu} / {cuda}" + (f" ({note})" if note else "")


def row(name: str) -> str:
    cls = method_class(name)
    missing = [a for a in ("enters", "source", "past_context") if not getattr(cls, a)]
    if missing:
        raise PosbenchError(f"method {name} ({cls.__module__}) sets no {', '.join(missing)}; "
                            "describe it in its class attributes (docs/adding-a-method.md)")
    cells = [f"`{name}`", cls.enters, cls.source, cls.past_context, backends(name)]
    return "| " + " | ".join(meaning_text(c) for c in cells) + " |"


def table(layout: str) -> str:
    lines = [f"| method | enters | reference | {LAYOUTS[layout]} | `model.attention=auto`: CPU / CUDA |",
             "|---|---|---|---|---|"]
    return "\n".join(lines + [row(name) for name in methods(layout)])


def recipes() -> list[str]:
    """The methods that are a released model's recipe (:class:`posbench.methods.recipes.Recipe`)."""
    from posbench.methods.recipes import Recipe

    return [name for name in list_methods() if issubclass(method_class(name), Recipe)]


def recipe_row(name: str) -> str:
    """``| recipe | release | layers: what each gets | departures |``, from the recipe's class and
    the pattern it builds (its defaults)."""
    cls = method_class(name)
    recipe = build_method(name, ModelDims(d_model=MODEL.d_model, n_heads=MODEL.n_heads, n_layers=MODEL.n_layers))
    cells = [f"`{name}`", f"{cls.source}; checked against `{cls.release}`", "; ".join(recipe.layer_summary()), cls.departures]
    return "| " + " | ".join(meaning_text(c) for c in cells) + " |"


def recipe_table() -> str:
    lines = ["| recipe | release; reference | layers (l mod period): type (mask; what it gets) | departures from the "
             "release (besides those every recipe shares) |", "|---|---|---|---|"]
    return "\n".join(lines + [recipe_row(name) for name in recipes()])


def marks(layout: str) -> tuple[str, str]:
    return f"<!-- methods-overview: {layout} -->", f"<!-- methods-overview: {layout} end -->"


def render(page: str) -> str:
    """``page`` with each layout's region replaced by the table the method classes give, and the
    recipes' region by the recipe table."""
    for layout in LAYOUTS:
        page = replace_region(page, *marks(layout), table(layout), PAGE.name)
    return replace_region(page, *marks("recipes"), recipe_table(), PAGE.name)


def main(argv: list[str]) -> int:
    return write_or_check(PAGE, render, argv, "methods_overview.py", "the method classes")


if __name__ == "__main__":
    run_script("methods_overview.py", main)
