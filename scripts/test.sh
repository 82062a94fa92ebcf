#!/usr/bin/env bash
# The test suite, from a fresh clone: creates .venv, installs posbench with its test extra
# (CPU torch), runs pytest. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k rope`.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${POSBENCH_VENV:-.venv}
# torch first and pinned: an unpinned torch pulls several GB of CUDA wheels on Linux.
TORCH_SPEC=${POSBENCH_TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
"$VENV/bin/python" -m pip install -q -e ".[dev]"

export MPLBACKEND=Agg WANDB_SILENT=true
exec "$VENV/bin/python" -m pytest -q "$@"
