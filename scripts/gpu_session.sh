#!/usr/bin/env bash
# posbench's work on a GPU machine without network access (torch there, no Hydra): the CUDA tests and
# sweeps that run several jobs at once on the one GPU. Run from the repository root:
#
#   bash scripts/gpu_session.sh tests            # the CUDA-only tests (they skip on a CPU machine)
#   bash scripts/gpu_session.sh sweep NAME SECONDS -- <posbench train -m overrides>
#   bash scripts/gpu_session.sh pack NAME        # the small files of /tmp/sweeps/NAME into $OUT
#
# What it needs beside the checkout (both git-ignored, docs/gpu.md says how to make them):
#   .whl/       hydra-core, omegaconf and antlr4 wheels and posbench's own, built from this checkout
#               (pip wheel --no-deps . -w .whl), installed with pip install --target, no network
#   .gpucache/  POSBENCH_CACHE with the packaged sample already tokenized (data/sample-bpe8192-*),
#               so every machine trains on the same token files (same data checksums)
# A sweep is stopped with SIGTERM after SECONDS: each job writes a checkpoint and records itself
# as preempted, and the same command resumes it (finished jobs are left as they are).
set -u
cd "$(dirname "$0")/.."
if [ ! -d /tmp/site/hydra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site POSBENCH_CACHE=$PWD/.gpucache PYTHONUNBUFFERED=1
export WANDB_MODE=disabled MPLBACKEND=Agg OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/sweeps
posbench() { python3 -P -c "import sys; sys.argv[0] = 'posbench'; from posbench.commands.cli import main; main()" "$@"; }

case "${1:-}" in
  setup) ;;
  tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    # The CUDA-only tests (those that skip on a CPU machine), one line each as they finish.
    timeout "${2:-480}" python3 -P -m pytest -p no:cacheprovider -n 4 -v --tb=short -rfs -k \
      "cuda or flex_gradients or ssmax_flex_matches or pope_flex" \
      tests/unit/model/test_attention.py tests/unit/bench/test_command.py tests/unit/methods/test_layers.py \
      tests/unit/methods/test_pope.py tests/unit/methods/test_ssmax.py >"$OUT/tests.log" 2>&1
    echo "tests exit $?"; tail -5 "$OUT/tests.log"
    ;;
  sweep)
    name=$2 seconds=$3; shift 4
    start=$(date +%s)
    export -f posbench
    setsid bash -c 'posbench train -m "$@"' _ "$@" hydra.sweep.dir=/tmp/sweeps/"$name" >>"/tmp/sweeps/$name.log" 2>&1 &
    pid=$!
    while kill -0 $pid 2>/dev/null && [ $(( $(date +%s) - start )) -lt "$seconds" ]; do sleep 5; done
    if kill -0 $pid 2>/dev/null; then
      echo "sweep $name: stopping after ${seconds}s (jobs checkpoint and record 'preempted')"
      kill -TERM -- -$pid; sleep 25; kill -KILL -- -$pid 2>/dev/null
    fi
    wait $pid; echo "sweep $name exit $? after $(( $(date +%s) - start ))s"
    grep -h '"status"' /tmp/sweeps/"$name"/*/status.json 2>/dev/null | sed 's/.*"status": *"\([a-z_]*\)".*/\1/' | sort | uniq -c
    ;;
  pack)
    name=$2
    (cd /tmp/sweeps && tar czf "$OUT/$name.tgz" --exclude=checkpoints --exclude=figures --exclude=viz --exclude='*.lock' \
      --exclude='*.pid' "$name" "$name.log") && ls -la "$OUT/$name.tgz"
    ;;
  *) sed -n 2,14p "$0"; exit 2 ;;
esac
