#!/usr/bin/env bash
# The test suite, from a fresh clone: creates .venv, installs posbench with its test extra
# (CPU torch), runs ruff, then pytest. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k rope`.
#
#   bash scripts/test.sh           # ruff, then the whole suite (about 14 minutes on 2 cores)
#   bash scripts/test.sh --fast    # ruff, then the fast lane: every test not marked slow (under 2 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${POSBENCH_VENV:-.venv}
# torch first and pinned: an unpinned torch pulls several GB of CUDA wheels on Linux.
TORCH_SPEC=${POSBENCH_TORCH_SPEC:-torch==2.13.0}

lane=all
case "${1:-}" in
  --fast) lane=fast; shift ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q -e ".[dev]"

"$VENV/bin/python" -m ruff check .

export MPLBACKEND=Agg WANDB_SILENT=true
# pytest caches its rewritten test modules as bytecode; where the environment forbids bytecode
# (PYTHONDONTWRITEBYTECODE, common in containers) every run would rewrite all of them again.
unset PYTHONDONTWRITEBYTECODE
case "$lane" in
  fast) exec "$VENV/bin/python" -m pytest -q -m "not slow" "$@" ;;
  *) exec "$VENV/bin/python" -m pytest -q "$@" ;;
esac
