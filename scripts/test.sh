#!/usr/bin/env bash
# The test suite, from a fresh clone: makes (or reuses) a virtual environment, installs torch and
# posbench with its test extra there, says which torch it got, runs ruff, then pytest. Extra
# arguments go to pytest, e.g. `bash scripts/test.sh -k rope`.
#
#   bash scripts/test.sh           # ruff, then the whole suite (about 14 minutes on 2 idle cores)
#   bash scripts/test.sh --fast    # ruff, then the fast lane: every test not marked slow (under 2 minutes idle)
#   bash scripts/test.sh --reuse   # no install when the environment already runs this checkout's posbench
#
# The install is the README's, from whatever package index pip is configured with:
#   pip install torch==2.13.0
#   pip install -e ".[dev]"
# On plain PyPI for Linux x86_64 that torch is the CUDA build (several GB; it also runs on a CPU).
# The CPU-only wheel (about 200 MB) comes from PyTorch's own index, only when asked for:
#   POSBENCH_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/test.sh
#
# Environment: POSBENCH_VENV (the environment's folder, default .venv; created when missing),
# POSBENCH_TORCH_INDEX (an index for torch alone), POSBENCH_TORCH_SPEC (default torch==2.13.0),
# POSBENCH_REUSE=1 (as --reuse).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${POSBENCH_VENV:-.venv}
# torch first and pinned: an unpinned torch may pull another CUDA build on Linux.
TORCH_SPEC=${POSBENCH_TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${POSBENCH_TORCH_INDEX:-}
REUSE=${POSBENCH_REUSE:-0}

lane=all
while [ $# -gt 0 ]; do
  case "$1" in
    --fast) lane=fast; shift ;;
    --reuse) REUSE=1; shift ;;
    *) break ;;
  esac
done

if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# --reuse: the environment already has torch, pytest, ruff and this checkout's posbench (editable).
ready() {
  "$PY" -I - <<'EOF' >/dev/null 2>&1
import os, importlib.util
import torch, pytest, posbench  # noqa: F401
assert importlib.util.find_spec("ruff") is not None
assert os.path.dirname(os.path.dirname(os.path.realpath(posbench.__file__))) == os.path.realpath(os.getcwd())
EOF
}

if [ "$REUSE" = 1 ] && ready; then
  echo "test.sh: reusing $VENV (no install)"
else
  "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if [ -n "$TORCH_INDEX" ]; then
    "$PY" -m pip install -q "$TORCH_SPEC" --index-url "$TORCH_INDEX"
  else
    "$PY" -m pip install -q "$TORCH_SPEC"
  fi
  "$PY" -m pip install -q -e ".[dev]"
fi

# What was installed, in one line: a CUDA build on a CPU machine is several GB, but it works.
"$PY" -c '
import torch
cuda = torch.version.cuda
if cuda is None:
    print(f"test.sh: torch {torch.__version__}, the CPU-only build")
else:
    where = "a CUDA device is visible" if torch.cuda.is_available() else "no CUDA device here, so the tests run on the CPU"
    print(f"test.sh: torch {torch.__version__}, a CUDA {cuda} build ({where})")
'

"$PY" -m ruff check .

export MPLBACKEND=Agg WANDB_SILENT=true
# pytest caches its rewritten test modules as bytecode; where the environment forbids bytecode
# (PYTHONDONTWRITEBYTECODE, common in containers) every run would rewrite all of them again.
unset PYTHONDONTWRITEBYTECODE
case "$lane" in
  fast) exec "$PY" -m pytest -q -m "not slow" "$@" ;;
  *) exec "$PY" -m pytest -q "$@" ;;
esac
