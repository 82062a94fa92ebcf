"""The import graph of ``posbench/``: cycles, imports from a lower layer up, function-local imports.

    python scripts/import_graph.py            # prints the report; exit 1 on a cycle
    python scripts/import_graph.py --edges    # also every edge
    python scripts/import_graph.py --root <checkout>/posbench   # another checkout

Every ``import posbench...`` / ``from posbench... import`` counts, at module top or inside a
function (a lazy import is still a dependency). A module ``posbench.a.b`` is the node ``a.b``; a
package is its ``__init__``. Layers run bottom-up as the data flows (configs -> data -> model ->
train -> eval -> results -> plot); :data:`LAYERS` names them. The package ``__init__`` (the
Python API re-exporting models and runs) is the one module allowed to import upwards.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "posbench"

# Bottom-up; a module may import its own layer and those below. Modules of a package not listed
# take the package's layer (methods.rope -> methods). A package's ``settings`` module (the typed
# settings it owns) sits in layer 1 beside ``config``: the run spec and lower layers build them.
LAYERS: list[tuple[str, ...]] = [
    ("core", "configs"),
    ("config", "runtime", "train.settings", "evaluation.settings", "bench.settings", "viz.settings"),
    ("methods",),
    ("model",),
    ("data", "tasks"),
    ("runs",),
    ("evaluation",),
    ("report",),
    ("train",),
    ("viz", "bench", "commands.eval", "commands.export", "commands.sweep"),
    ("commands.cli",),
]
API = "__init__"  # posbench/__init__.py: the Python API


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or API


def layer_of(module: str) -> int | None:
    for depth in range(module.count(".") + 1, 0, -1):
        prefix = ".".join(module.split(".")[:depth])
        for index, names in enumerate(LAYERS):
            if prefix in names:
                return index
    return None


def resolve(target: str, modules: set[str]) -> str | None:
    """``posbench.a.b.c`` (module or attribute) -> the longest known module prefix."""
    parts = target.split(".")[1:]
    for depth in range(len(parts), 0, -1):
        name = ".".join(parts[:depth])
        if name in modules:
            return name
    return API if target == "posbench" else None


def imports(path: Path, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every posbench import of ``path``."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                targets = [f"{child.module}.{a.name}" for a in child.names]
            for target in targets:
                if target == "posbench" or target.startswith("posbench."):
                    name = resolve(target, modules)
                    if name is not None:
                        found.append((name, child.lineno, local))
            visit(child, inner)

    visit(tree, False)
    return found


def graph() -> tuple[dict[str, set[str]], list[tuple[str, str, int, bool]]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    edges: dict[str, set[str]] = defaultdict(set)
    rows = []
    for name, path in sorted(files.items()):
        for target, line, local in imports(path, modules):
            if target != name and not name.startswith(target + ".") and not (name == API):
                edges[name].add(target)
            if target != name:
                rows.append((name, target, line, local))
    return edges, rows


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            strong(v)
    return out


def upward(rows: list[tuple[str, str, int, bool]]) -> list[tuple[str, str, int]]:
    """Imports from a lower layer to a higher one (the API ``__init__`` included, listed once)."""
    found = []
    for source, target, line, _ in rows:
        if source == API:
            continue
        a, b = layer_of(source), layer_of(target)
        if a is not None and b is not None and b > a:
            found.append((source, target, line))
    return found


def unlayered(rows: list[tuple[str, str, int, bool]]) -> list[str]:
    names = {m for row in rows for m in row[:2] if m != API}
    return sorted(m for m in names if layer_of(m) is None)


def main(argv: list[str]) -> int:
    global ROOT
    if "--root" in argv:
        ROOT = Path(argv[argv.index("--root") + 1]).resolve()
    edges, rows = graph()
    found = cycles(edges)
    ups = upward(rows)
    local = [r for r in rows if r[3]]
    print(f"posbench import graph: {len({r[0] for r in rows})} modules, {len(rows)} imports, "
          f"{len(local)} inside functions")
    print(f"cycles: {len(found)}")
    for component in found:
        print("  " + " <-> ".join(component))
    api_up = sorted({t for s, t, _, _ in rows if s == API})
    print(f"upward imports: {len(ups)} (+ the package __init__, the Python API: {', '.join(api_up) or 'none'})")
    for source, target, line in ups:
        print(f"  {source}:{line} -> {target}")
    missing = unlayered(rows)
    if missing:
        print(f"modules in no layer (add them to LAYERS): {', '.join(missing)}")
    by_module: dict[str, int] = defaultdict(int)
    for source, *_ in local:
        by_module[source] += 1
    if local:
        print("imports inside functions: " + ", ".join(f"{m} {n}" for m, n in sorted(by_module.items(), key=lambda x: -x[1])))
    if "--edges" in argv:
        for source, target, line, is_local in rows:
            print(f"  {source}:{line} -> {target}{' (in a function)' if is_local else ''}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
