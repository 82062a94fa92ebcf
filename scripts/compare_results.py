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
import sys
from pathlib import Path
from typing import Any, Iterator

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
    record = {"results": json.loads((p / "results.json" if p.is_dir() else p).read_text())}
    if p.is_dir() and (p / "metrics.jsonl").is_file():
        record["metrics"] = [json.loads(line) for line in (p / "metrics.jsonl").read_text().splitlines() if line]
    return record


def main(argv: list[str]) -> int:
    if len(argv) < 2 or len(argv) % 2:
        print(__doc__)
        return 2
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
    raise SystemExit(main(sys.argv[1:]))
