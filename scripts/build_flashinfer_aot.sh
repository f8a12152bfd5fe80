#!/usr/bin/env bash
# Build, here with this machine's nvcc, the FlashInfer modules the project's two wrappers load
# on an H200 (sm_90a, bf16, int32 indices, head dim 128; which and why: scripts/flashinfer_aot.py),
# put them into the trimmed flashinfer wheel at flashinfer/data/aot/<name>/<name>.so (where
# FlashInfer looks before it compiles), and check them. The device then runs them with
# FLASHINFER_DISABLE_JIT=1: no nvcc, no toolkit pieces, no minutes of compiling there.
#
#   fa2: batch prefill whose longest query is <= 64 tokens, and decode (tensor cores);
#   fa3: batch prefill whose longest query is > 64 tokens (Hopper kernels, CUTLASS).
#
# Output: .whl/ (gitignored, carried by the device tool): flashinfer_python-<v>-py3-none-any.whl
# (trimmed + the modules), apache_tvm_ffi-<pinned>-cp312-*.whl (the version the modules were
# built against), flashinfer_aot_manifest.json (names, sizes, sha256, build seconds).
# Work files: build/flashinfer-aot/ (gitignored; downloads, the build tree, a --target site).
#
# Toolkit gaps filled here (CUDA 13 from pip wheels: no lib64/stubs, no curand):
#   -lcuda    FlashInfer's link line names it; build/flashinfer-aot/stubs/libcuda.so is a linker
#             script `INPUT(AS_NEEDED(libcuda.so.1))` over an empty stub: linked only if a driver
#             symbol were used (none is: --verify checks every undefined symbol);
#   curand    fa3 includes curand_kernel.h through CUTLASS: headers from the nvidia-curand wheel.
#
# Usage: scripts/build_flashinfer_aot.sh [--verify | --verify-only] [--dest DIR] [--jobs N]
#   (no flag)      download, trim, build, package into .whl/
#   --verify       the same, then the load test
#   --verify-only  only the load test, on the wheels already in .whl/ (seconds)
#   --dry-run      print the plan, do nothing
# Env: PY (build interpreter, one with torch: default .venv/bin/python, else python3), PY312 (CPython 3.12 for the
# device-ABI load check; default: python3.12 on PATH or pyenv's, else skipped with a note),
# CUDA_HOME (default: nvcc's), MAX_JOBS (default 2), NICE (default 15).
# Measured on 2 cores shared with other work (load 4-12): fa2 ~6 min, fa3 ~20-36 min wall
# (both ~18 CPU-minutes). Rebuilds are incremental (ninja; the build site is reinstalled, and so
# everything recompiled, only when the trimmed wheel changes).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

FLASHINFER_VERSION=0.7.4
TVM_FFI_VERSION=0.1.15.post2   # pinned: the modules link tvm-ffi's C ABI of this version
CURAND_VERSION=10.4.0.35       # CUDA 13.0's curand, headers only
ARCH=9.0a
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if [ -z "${PY312:-}" ]; then  # the first candidate that really runs CPython 3.12 (a pyenv shim may not)
  for cand in "$(command -v python3.12 || true)" $(ls "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 2>/dev/null); do
    if [ -n "$cand" ] && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
      PY312=$cand; break
    fi
  done
fi
PY312=${PY312:-}
NICE=${NICE:-15}
export MAX_JOBS=${MAX_JOBS:-2}
LIMIT_MB=${LIMIT_MB:-60}
B=$ROOT/build/flashinfer-aot
DEST=.whl
MODE=build
VERIFY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --verify) VERIFY=1 ;;
    --verify-only) MODE=none; VERIFY=1 ;;
    --dry-run) MODE=dry ;;
    --dest) DEST=$2; shift ;;
    --jobs) MAX_JOBS=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)

if [ "$MODE" = dry ]; then
  echo "would download: flashinfer-python==$FLASHINFER_VERSION, apache-tvm-ffi==$TVM_FFI_VERSION (cp312 for the device and the build interpreter's), nvidia-curand==$CURAND_VERSION (headers), einops tabulate nvidia-ml-py typing-extensions (import here)"
  echo "would trim with scripts/prepare_gpu_wheels.sh, build fa2 and fa3 for sm_$ARCH with nvcc (nice -n $NICE, MAX_JOBS=$MAX_JOBS),"
  echo "put them into flashinfer/data/aot/<name>/<name>.so in the wheel, and write $DEST/"
  exit 0
fi

PIP_PLATFORM=(--only-binary=:all: --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pip_dl() { "$PY" -m pip download -q --no-deps "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }

if [ "$MODE" = build ]; then
  started=$(date +%s)
  CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
  [ -x "$CUDA_HOME/bin/nvcc" ] || { echo "no nvcc under CUDA_HOME=$CUDA_HOME" >&2; exit 1; }
  # the nvcc wrapper on PATH may point elsewhere: take the real toolkit root
  if [ "$(head -c2 "$CUDA_HOME/bin/nvcc")" = "#!" ]; then
    real=$(grep -o '/[^ ]*/bin/nvcc' "$CUDA_HOME/bin/nvcc" | head -1)
    [ -n "$real" ] && CUDA_HOME=$(dirname "$(dirname "$real")")
  fi
  echo "== toolkit: $CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | tail -1))"
  PYV=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  mkdir -p "$B/dl" "$B/dl/builddeps" "$B/stubs" "$B/curand"

  echo "== downloads (cached in $B/dl)"
  compgen -G "$B/dl/flashinfer_python-$FLASHINFER_VERSION-*.whl" >/dev/null \
    || pip_dl -d "$B/dl" "${PIP_PLATFORM[@]}" --python-version 3.12 --implementation cp "flashinfer-python==$FLASHINFER_VERSION"
  for v in 3.12 "$PYV"; do
    tag=cp${v/./}
    compgen -G "$B/dl/apache_tvm_ffi-$TVM_FFI_VERSION-$tag-*.whl" >/dev/null \
      || pip_dl -d "$B/dl" "${PIP_PLATFORM[@]}" --python-version "$v" --implementation cp "apache-tvm-ffi==$TVM_FFI_VERSION"
  done
  compgen -G "$B/dl/nvidia_curand-$CURAND_VERSION-*.whl" >/dev/null \
    || pip_dl -d "$B/dl" "${PIP_PLATFORM[@]}" "nvidia-curand==$CURAND_VERSION"
  # pure-Python packages `import flashinfer` / `import tvm_ffi` need here (the GPU image has them)
  for dep in einops tabulate nvidia_ml_py typing_extensions; do
    compgen -G "$B/dl/builddeps/$dep-*.whl" >/dev/null || pip_dl -d "$B/dl/builddeps" --only-binary=:all: "${dep//_/-}"
  done

  echo "== trim (scripts/prepare_gpu_wheels.sh)"
  PY=$PY TVM_FFI_SPEC="apache-tvm-ffi==$TVM_FFI_VERSION" scripts/prepare_gpu_wheels.sh --from "$B/dl" --dest "$B/trim" >/dev/null
  TRIMMED=$(ls "$B"/trim/flashinfer_python-"$FLASHINFER_VERSION"-*.whl)

  echo "== build site: the trimmed wheel (its sources are what gets compiled) + tvm-ffi for $PYV"
  # reinstalled only when the trimmed wheel changed: fresh header mtimes would make ninja
  # recompile everything
  STAMP="$(sha256sum "$TRIMMED" | cut -c1-16) tvm-ffi $TVM_FFI_VERSION py$PYV"
  if [ "$(cat "$B/site/.stamp" 2>/dev/null)" != "$STAMP" ]; then
    rm -rf "$B/site"
    "$PY" -m pip install -q --no-deps --no-compile --target "$B/site" "$TRIMMED" \
      "$B"/dl/apache_tvm_ffi-"$TVM_FFI_VERSION"-cp${PYV/./}-*.whl "$B"/dl/builddeps/*.whl 2>&1 | grep -v "is ignored" || true
    echo "$STAMP" >"$B/site/.stamp"
  fi

  # -lcuda without a driver library: see the header. Made once: headers and stubs keep their
  # mtimes, so ninja's rebuild stays incremental.
  if [ ! -f "$B/stubs/libcuda.so" ]; then
    printf 'int flashinfer_aot_libcuda_stub;\n' >"$B/stubs/stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$B/stubs/libcuda.so.1" "$B/stubs/stub.c"
    printf '/* build-time stand-in for the driver library: linked only if a symbol is used */\nINPUT ( AS_NEEDED ( %s ) )\n' \
      "$B/stubs/libcuda.so.1" >"$B/stubs/libcuda.so"
  fi
  CURAND_INC=$B/curand/nvidia/cu13/include
  [ -f "$CURAND_INC/curand_kernel.h" ] \
    || (cd "$B/curand" && unzip -q -o "$B"/dl/nvidia_curand-"$CURAND_VERSION"-*.whl 'nvidia/cu13/include/*')
  [ -f "$CURAND_INC/curand_kernel.h" ] || { echo "no curand_kernel.h in the nvidia-curand wheel" >&2; exit 1; }

  echo "== compile (nice -n $NICE, MAX_JOBS=$MAX_JOBS; log: $B/build.log)"
  (cd /tmp && env CUDA_HOME="$CUDA_HOME" FLASHINFER_CUDA_ARCH_LIST=$ARCH FLASHINFER_WORKSPACE_BASE="$B/ws" \
    FLASHINFER_EXTRA_LDFLAGS="-L$B/stubs" FLASHINFER_EXTRA_CUDAFLAGS="-isystem $CURAND_INC" \
    PYTHONPATH="$B/site" nice -n "$NICE" "$PY" "$ROOT/scripts/flashinfer_aot.py" build --out "$B/aot" --verbose) \
    >"$B/build.log" 2>&1 || { tail -40 "$B/build.log" >&2; echo "build failed: $B/build.log" >&2; exit 1; }
  grep -E '^   fa[23]:' "$B/build.log"

  echo "== package into $DEST/"
  rm -f "$DEST"/flashinfer_python-*.whl "$DEST"/apache_tvm_ffi-*.whl  # one version of each
  (cd /tmp && PYTHONPATH="$B/site" "$PY" "$ROOT/scripts/flashinfer_aot.py" package --aot "$B/aot" --wheel "$TRIMMED" --dest "$DEST")
  cp "$B"/dl/apache_tvm_ffi-"$TVM_FFI_VERSION"-cp312-*.whl "$DEST"/
  ls -l "$DEST"
  TOTAL=$(du -cm "$DEST"/*.whl | tail -1 | cut -f1)
  REPO=$(git ls-files -z | du -cm --files0-from=- | tail -1 | cut -f1)
  echo "wheels ${TOTAL} MB + tracked files ${REPO} MB (limit 64 MiB for a device call); build $(( $(date +%s) - started )) s"
  if [ "$TOTAL" -gt "$LIMIT_MB" ]; then echo "wheels over ${LIMIT_MB} MB: they will not travel" >&2; exit 1; fi
fi

if [ "$VERIFY" = 1 ]; then
  PYV=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")")}
  [ -d "$CUDA_HOME/lib64" ] || CUDA_HOME=/usr/local/cuda
  FI_WHL=$(ls "$DEST"/flashinfer_python-*.whl)
  V=$(mktemp -d)
  trap 'rm -rf "$V"' EXIT
  echo "== verify: fresh --target install of $DEST wheels (--no-deps), FLASHINFER_DISABLE_JIT=1"
  # The build interpreter takes the same pinned tvm-ffi built for its own CPython (the modules
  # use only tvm-ffi's C ABI, so the device's cp312 wheel and this one serve the same .so files).
  TVM_HERE=$(ls "$B"/dl/apache_tvm_ffi-"$TVM_FFI_VERSION"-cp${PYV/./}-*.whl 2>/dev/null || true)
  [ -n "$TVM_HERE" ] || { echo "no apache-tvm-ffi $TVM_FFI_VERSION wheel for Python $PYV in $B/dl: run the build first" >&2; exit 1; }
  "$PY" -m pip install -q --no-deps --no-compile --target "$V/site" "$FI_WHL" "$TVM_HERE" "$B"/dl/builddeps/*.whl 2>&1 | grep -v "is ignored" || true
  # libcudart.so.13 from the toolkit (on the device torch has loaded it before flashinfer dlopens a module)
  (cd /tmp && env -u PYTHONPATH FLASHINFER_DISABLE_JIT=1 FLASHINFER_WORKSPACE_BASE="$V/ws" FLASHINFER_CUDA_ARCH_LIST=$ARCH \
    LD_LIBRARY_PATH="$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONPATH="$V/site" \
    "$PY" "$ROOT/scripts/flashinfer_aot.py" verify --manifest "$DEST/flashinfer_aot_manifest.json" --expect-site "$V/site")
  if [ -n "$PY312" ] && [ -x "$PY312" ]; then
    echo "== verify: the device's wheels as they are ($($PY312 --version), no torch): tvm_ffi.load_module"
    "$PY312" -m pip install -q --no-deps --no-compile --target "$V/site312" "$DEST"/*.whl "$B"/dl/builddeps/typing_extensions-*.whl 2>&1 \
      | grep -v -e "is ignored" -e "Running pip as the 'root' user" || true
    (cd /tmp && env -u PYTHONPATH LD_LIBRARY_PATH="$CUDA_HOME/lib64" PYTHONPATH="$V/site312" \
      "$PY312" "$ROOT/scripts/flashinfer_aot.py" load --site "$V/site312")
  else
    echo "== note: no CPython 3.12 here (PY312): the cp312 wheel was not load-tested"
  fi
  echo "verify: ok"
fi
