"""Compare the numbers of two results.json files bitwise (timings, paths and dates excluded).

    python scripts/compare_results.py <before results.json or run dir> <after ...> [...pairs]

For run directories, the rows of metrics.jsonl (losses, learning rates, validation) too.

Every number (and string, list length, key) reachable in both files is compared exactly; keys
that measure time or name places (``*seconds*``, ``*per_second*``, ``created``, ``versions``,
``resumed_from_step``) are skipped. Exit 1 on any difference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

from posbench.commands.cli import run_script
from posbench.core.errors import PosbenchError

SKIP = {"created", "versions", "resumed_from_step"}


def skipped(key: str) -> bool:
    return key in SKIP or "seconds" in key or "per_second" in key


def walk(a: Any, b: Any, path: str = "") -> Iterator[tuple[str, Any, Any, bool]]:
    """(path, before, after, equal) for every leaf."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if skipped(key):
                continue
            if key not in a or key not in b:
                yield f"{path}.{key}", a.get(key, "<missing>"), b.get(key, "<missing>"), False
            else:
                yield from walk(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path}[len]", len(a), len(b), False
        for i, (x, y) in enumerate(zip(a, b)):
            yield from walk(x, y, f"{path}[{i}]")
    else:
        same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
        yield path, a, b, same and type(a) is type(b)


def load(path: str) -> dict[str, Any]:
    """results.json, plus the rows of metrics.jsonl when ``path`` is a run directory."""
    p = Path(path)
    record = {"results": read_json(p / "results.json" if p.is_dir() else p)}
    if p.is_dir() and (p / "metrics.jsonl").is_file():
        record["metrics"] = [read_json(p / "metrics.jsonl", line) for line in read_text(p / "metrics.jsonl").splitlines()
                             if line]
    return record


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        reason = "does not exist" if isinstance(err, FileNotFoundError) else f"cannot be read ({err})"
        raise PosbenchError(f"{path} {reason}; give results.json files or run directories made by posbench train") from None


def read_json(path: Path, text: str | None = None) -> Any:
    """``text`` (else the file's) as JSON; one line naming the file when it is not."""
    try:
        return json.loads(read_text(path) if text is None else text)
    except json.JSONDecodeError as err:
        raise PosbenchError(f"{path} is not valid JSON ({err}); it was cut short or edited: compare another "
                            "copy, or re-run posbench eval on its run to write it again") from None


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) < 2 or len(argv) % 2:
        raise PosbenchError(f"give pairs of results.json files or run directories (got {len(argv)} argument(s)): "
                            "python scripts/compare_results.py <before> <after> [<before> <after> ...]")
    failed = False
    for before, after in zip(argv[::2], argv[1::2]):
        leaves = list(walk(load(before), load(after)))
        numbers = sum(isinstance(x, (int, float)) and not isinstance(x, bool) for _, x, _, _ in leaves)
        bad = [(p, x, y) for p, x, y, same in leaves if not same]
        print(f"{before} vs {after}: {len(leaves)} values ({numbers} numbers) compared, {len(bad)} differ")
        for p, x, y in bad[:20]:
            print(f"  {p}: {x!r} != {y!r}")
        failed |= bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    run_script("compare_results", main)
