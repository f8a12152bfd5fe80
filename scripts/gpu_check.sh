#!/usr/bin/env bash
# The GPU check, in one call on a machine with CUDA (e.g. the device tool's `run`, with
# carry=[".whl"] after scripts/prepare_gpu_wheels.sh):
#   1. install the carried wheels from .whl/ when flashinfer is missing;
#   2. pytest -m gpu: FlashInfer vs the torch reference on every backend's page tables;
#   3. the benchmark: decode (64 x 4k, page sizes 1/16/64) and llama3-8b prefill
#      (8k prompt, 0/50/90 % cached); JSON.
# Results go to $OUT (the device tool brings them back) or reports/gpu/.
# Env: PYTHON (default python3), BENCH_ARGS (extra benchmark flags, e.g. "--no-model"),
#      SKIP_TESTS=1 / SKIP_BENCH=1, DRY_RUN=1 (print the steps, run nothing).
# Uses the machine's own torch (the project's CPU pin is not installed there).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-reports/gpu}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo nogit)
export PYTHONUNBUFFERED=1
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}  # JIT for Hopper only: halves compile time
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-jit}
mkdir -p "$DEST"
LOG="$DEST/gpu_check_${STAMP}_${COMMIT}.log"

step() { echo "== $*" | tee -a "$LOG"; }
run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "DRY: $*" | tee -a "$LOG"; return 0; fi
  "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"
}

step "gpu_check $STAMP commit $COMMIT -> $DEST"
run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

if ! "$PY" -c "import flashinfer" >/dev/null 2>&1; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    step "installing carried wheels: $(ls .whl | tr '\n' ' ')"
    run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed" | tee -a "$LOG"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "flashinfer is missing and .whl/ holds no wheels: run scripts/prepare_gpu_wheels.sh and carry .whl" | tee -a "$LOG"
    [ "${DRY_RUN:-0}" = 1 ] || exit 2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
run "$PY" -c "import torch, flashinfer; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())"

status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step "pytest -m gpu"
  run "$PY" -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider --junitxml="$DEST/gpu_tests_${STAMP}_${COMMIT}.xml" || status=1
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  step "benchmark"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  run "$PY" experiments/bench/gpu_attention_bench.py --output "$DEST/gpu_attention_bench_${STAMP}_${COMMIT}.json" ${BENCH_ARGS:-} || status=1
fi
step "done: status $status; files in $DEST"
ls -l "$DEST" | tee -a "$LOG"
exit $status
