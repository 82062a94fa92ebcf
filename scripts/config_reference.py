"""docs/configuration.md's key tables of the settings groups, generated from their dataclasses.

    python scripts/config_reference.py            # rewrite the generated regions of docs/configuration.md
    python scripts/config_reference.py --check    # exit 1 when the page differs from what the code gives

A group whose settings are a dataclass (``posbench.config.settings_groups()``: ``trainer``, ``bench``,
``eval``) has its table rendered from the fields: the key (a nested settings dataclass, such as
``eval.rerope``, gives ``rerope.<field>`` rows; each registered probe's settings give
``<probe>.<field>`` rows), the default, and the field's docstring, which is the one place a key is
documented. A key whose values are a registry's names (``eval.extension``, ``eval.probes``) gets
the registry's names and one-line descriptions after its docstring, so no list is kept by hand.
The table sits between ``<!-- config-reference: <group> -->`` and
``<!-- config-reference: <group> end -->`` in the page; the rest of the page is written by hand.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import textwrap
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, get_type_hints

from posbench.commands.cli import run_script
from posbench.config import composed_groups, settings_groups
from posbench.core.errors import PosbenchError
from posbench.core.io import write_text_atomic

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (its attribute docstrings), by name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = after.value.value
    return docs


def default_of(f: Any) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


def registered(key: str) -> str:
    """The registry listing appended to ``key``'s docstring ("" for a key without one)."""
    from posbench.evaluation.probes import PROBES
    from posbench.model.extension import EXTENSIONS

    listing = {"eval.extension": ("Registered", [(e.name, e.summary) for e in EXTENSIONS.values()]),
               "eval.probes": ("Registered", [(p.name, p.description) for p in PROBES.values()])}.get(key)
    if listing is None:
        return ""
    return f" {listing[0]}: " + "; ".join(f"``{name}`` ({text})" if text else f"``{name}``" for name, text in listing[1]) + "."


def rows(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(key, default, docstring) of every leaf field; a nested settings dataclass adds its own,
    and the eval section's probe sections those of each registered probe's settings."""
    from posbench.evaluation.settings import PROBE_SETTINGS

    docs, types = field_docs(cls), get_type_hints(cls)
    for f in fields(cls):
        if f.metadata.get("sections"):
            for name, settings in PROBE_SETTINGS.items():
                yield from rows(settings, f"{prefix}{name}.")
        elif is_dataclass(types[f.name]):
            yield from rows(types[f.name], f"{prefix}{f.name}.")
        elif f.name not in docs:
            raise PosbenchError(f"{cls.__name__}.{f.name} has no docstring; document it under the field")
        else:
            yield f"{prefix}{f.name}", default_of(f), docs[f.name]


def value_text(value: Any) -> str:
    """A default as the config writes it: null, true/false, `[a, b]`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(map(str, value)) + "]`"
    return str(value)


def meaning_text(doc: str) -> str:
    """A docstring as one table cell: one line, None as the config's null, ``code`` as `code`,
    docs/<page>.md as a link, ``|`` escaped."""
    text = re.sub(r"\bNone\b", "null", " ".join(doc.split())).replace("``", "`").replace("|", "\\|")
    return re.sub(r"\bdocs/([\w./-]+\.md)(#[\w-]+)?", lambda m: f"[{m.group(1)}]({m.group(1)}{m.group(2) or ''})", text)


def table(group: str, cls: type) -> str:
    """The generated region of ``group``: its heading and key table."""
    module = cls.__module__.replace(".", "/") + ".py"
    title = f"**`{group}`**" if group in composed_groups("train") else f"**posbench {group}**"  # a command's own keys
    lines = [f"{title} (`{module}`: `{cls.__name__}`)", "",
             "| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {value_text(default)} | {meaning_text(doc + registered(f'{group}.{key}'))} |"
              for key, default, doc in rows(cls)]
    return "\n".join(lines)


def marks(group: str) -> tuple[str, str]:
    return f"<!-- config-reference: {group} -->", f"<!-- config-reference: {group} end -->"


def replace_region(page: str, begin: str, end: str, body: str, name: str) -> str:
    """``page`` with the text between its one ``begin`` and ``end`` marks replaced by ``body``."""
    if page.count(begin) != 1 or page.count(end) != 1:
        raise PosbenchError(f"{name} needs one '{begin}' ... '{end}' region")
    head, rest = page.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render(page: str) -> str:
    """``page`` with every settings group's region replaced by the table its dataclass gives."""
    importlib.import_module("posbench.evaluation.probes")  # registers the probes and their eval.<name> sections
    for group, cls in settings_groups().items():
        page = replace_region(page, *marks(group), table(group, cls), f"{PAGE.name} (group {group})")
    return page


def write_or_check(path: Path, render: Callable[[str], str], argv: list[str], script: str, source: str) -> int:
    """Rewrite the generated regions of ``path`` (no argument), or, with ``--check``, exit 1 when
    the page differs from what ``render`` gives from ``source``."""
    if argv not in ([], ["--check"]):
        raise PosbenchError(f"usage: python scripts/{script} [--check]")
    page = path.read_text()
    generated = render(page)
    if argv == ["--check"]:
        if generated != page:
            print(f"{path} differs from {source}; run python scripts/{script}", file=sys.stderr)
            return 1
        return 0
    if generated != page:
        write_text_atomic(path, generated)
        print(f"wrote {path}")
    return 0


def main(argv: list[str]) -> int:
    return write_or_check(PAGE, render, argv, "config_reference.py", "the settings dataclasses")


if __name__ == "__main__":
    run_script("config_reference.py", main)
