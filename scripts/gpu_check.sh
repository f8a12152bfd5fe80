#!/usr/bin/env bash
# The GPU check, in one call on a machine with CUDA (the device tool's `run`):
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# after scripts/build_flashinfer_aot.sh has filled .whl/ here (the trimmed flashinfer wheel with
# the prebuilt fa2/fa3 modules, and the pinned apache-tvm-ffi wheel for CPython 3.12).
#   1. install the carried wheels with --no-deps into a --target dir (the device has torch and
#      no package index);
#   2. resolve: FlashInfer's own loader finds the prebuilt fa2 and fa3 modules, JIT disabled
#      (seconds; a name mismatch shows here, not as a failure in every test);
#   3. pytest -m gpu (tests/test_gpu.py): fa2 and fa3 paths against the reference on every
#      backend's page tables, greedy tokens with and without caching, copy-on-write pages;
#      measured errors go to gpu_measurements_*.json;
#   4. the benchmark (experiments/bench/gpu_attention_bench.py): decode 64 x 4k at page sizes
#      1/16/64, llama3-8b prefill of 8k tokens with 0/50/90 % cached; CUDA-event timing, the
#      FlashInfer backend each wrapper resolved, device/driver/CUDA versions; JSON.
#   5. a step profile of the GPU (experiments/timing/measure.py): llama3-8b's layer outside
#      attention by token count, a table --executor profile --profile FILE reads.
# Results go to $OUT (the device tool brings them back; 5 files) or reports/gpu/.
# Env: PYTHON (default python3), BENCH_ARGS (extra benchmark flags, e.g. "--no-model"),
#      SKIP_TESTS=1 / SKIP_BENCH=1 / SKIP_PROFILE=1, GPU_NAME (the profile's device, default h200), ALLOW_JIT=1 (let FlashInfer compile what is not prebuilt:
#      needs nvcc, minutes), SITE (install dir, default /tmp/site), DRY_RUN=1 (print the
#      steps, run nothing; what CI runs).
# Uses the machine's own torch (the project's CPU pin is not installed there). Nothing here
# imports flashinfer on a machine without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-reports/gpu}
SITE=${SITE:-/tmp/site}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo nogit)
export PYTHONUNBUFFERED=1
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}  # Hopper only, if anything is compiled
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-jit}
if [ "${ALLOW_JIT:-0}" = 1 ]; then
  unset FLASHINFER_DISABLE_JIT
else
  export FLASHINFER_DISABLE_JIT=1  # the prebuilt modules or a clear error, never minutes of nvcc
fi
# The modules leave a few unreachable kernel instances unbound (scripts/flashinfer_aot.py,
# UNREACHABLE_UNDEFINED; FlashInfer's own JIT builds do the same): they load with lazy binding only.
unset LD_BIND_NOW
mkdir -p "$DEST"
LOG="$DEST/gpu_check_${STAMP}_${COMMIT}.log"

step() { echo "== $*" | tee -a "$LOG"; }
run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "DRY: $*" | tee -a "$LOG"; return 0; fi
  "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"
}

step "gpu_check $STAMP commit $COMMIT -> $DEST (FLASHINFER_DISABLE_JIT=${FLASHINFER_DISABLE_JIT:-unset})"
run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

if compgen -G ".whl/flashinfer_python-*.whl" >/dev/null; then
  step "installing carried wheels (--no-deps) into $SITE: $(cd .whl && ls ./*.whl | tr '\n' ' ')"
  run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "wheel install failed" | tee -a "$LOG"; exit 1; }
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
elif ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('flashinfer') is None)" >/dev/null 2>&1; then
  echo "flashinfer is missing and .whl/ holds no flashinfer wheel: run scripts/build_flashinfer_aot.sh and carry .whl" | tee -a "$LOG"
  [ "${DRY_RUN:-0}" = 1 ] || exit 2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# tvm-ffi passes torch tensors through torch's DLPack C exchange API; a torch without it makes
# tvm-ffi compile an addon against torch at import (time not planned for): plain DLPack instead.
if [ "${DRY_RUN:-0}" != 1 ] && ! "$PY" -c "import sys, torch; sys.exit(not hasattr(torch.Tensor, '__dlpack_c_exchange_api__'))" 2>/dev/null; then
  export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
  step "this torch has no DLPack C exchange API: TVM_FFI_DISABLE_TORCH_C_DLPACK=1 (no addon compile)"
fi
run "$PY" -c "import torch, flashinfer, tvm_ffi; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flashinfer', flashinfer.__version__, 'tvm-ffi', tvm_ffi.__version__, torch.cuda.get_device_name())"

status=0
step "resolve the prebuilt modules (fa2, fa3)"
run "$PY" scripts/flashinfer_aot.py resolve || status=1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step "pytest -m gpu"
  export GPU_MEASUREMENTS="$DEST/gpu_measurements_${STAMP}_${COMMIT}.json"  # the tests' measured errors
  run "$PY" -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider -rs --junitxml="$DEST/gpu_tests_${STAMP}_${COMMIT}.xml" || status=1
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  step "benchmark"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
  run "$PY" experiments/bench/gpu_attention_bench.py --output "$DEST/gpu_attention_bench_${STAMP}_${COMMIT}.json" ${BENCH_ARGS:-} || status=1
fi
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  # 5. a step profile of this GPU in the shipped format (experiments/timing/measure.py): one
  #    llama3-8b layer's linear work by token count, CUDA events; GPU_NAME is the zoo's name
  step "profile ${GPU_NAME:-h200}"
  run "$PY" -m experiments.timing.measure --model llama3-8b --device "${GPU_NAME:-h200}" \
    --output "$DEST/llama3-8b__${GPU_NAME:-h200}_${STAMP}_${COMMIT}.csv" || status=1
fi
step "done: status $status; files in $DEST"
ls -l "$DEST" | tee -a "$LOG"
exit $status
