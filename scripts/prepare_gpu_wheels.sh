#!/usr/bin/env bash
# Prepare what travels to the GPU machine: flashinfer-python (trimmed) and apache-tvm-ffi as
# wheels for CPython 3.12 manylinux x86_64, in .whl/ (gitignored). Normally called by
# scripts/build_flashinfer_aot.sh, which then adds the prebuilt kernel modules to the trimmed
# wheel; scripts/gpu_check.sh installs the result there with
# `pip install --no-index --no-deps --target /tmp/site`.
#
# Why trim: flashinfer-python 0.7.x is ~100 MB, over the 64 MiB that may travel. It is a JIT
# package. The two wrappers we use (attention/flashinfer_backend.py) both load *batch prefill*
# modules: the prefill wrapper picks fa3 (batch_prefill_sm90*.cu) on sm90a when the batch's
# longest query exceeds 64 tokens and fa2 (batch_prefill*.cu) otherwise; the decode wrapper
# with use_tensor_cores=True runs the fa2 prefill module with one query row, so batch_decode.cu
# is never compiled. Those are compiled from top-level files of flashinfer/data/csrc plus
# data/include, data/cutlass, data/cccl, data/spdlog. We drop the per-feature source trees
# (flashinfer/data/csrc/<dir>/, */csrc/, */kernel_src/ of other kernel families: MoE, FP4/FP8
# GEMM, Mamba, ...): ~100 MB -> ~39 MB. Every Python file stays, so `import flashinfer` works
# unchanged, and the kept sources let the device fall back to JIT (ALLOW_JIT=1 in gpu_check.sh)
# if a prebuilt module were missing.
#
# Needs at import time (checked: `import flashinfer` with only these on a CPU box): torch,
# numpy, tvm_ffi (carried), requests, einops, click, tqdm, tabulate, packaging, ninja,
# nvidia-ml-py (all in the GPU image, see the device tool's KINDS.md). cuda-python,
# cuda-tile, nvidia-cutlass-dsl, nvidia-cudnn-frontend, nccl4py serve other kernel
# families and are not carried.
#
# tvm-ffi is pinned (TVM_FFI_SPEC): the prebuilt modules link its C ABI, so the wheel that
# travels must be the version they were built against (build_flashinfer_aot.sh passes its pin).
#
# Usage: scripts/prepare_gpu_wheels.sh [--dry-run] [--from DIR] [--dest DIR]
#   --dry-run  print what would be downloaded and kept; download nothing
#   --from DIR use wheels already downloaded in DIR (no network)
#   --dest DIR write the wheels there (default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."

FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.7.4}
TVM_FFI_SPEC=${TVM_FFI_SPEC:-apache-tvm-ffi==0.1.15.post2}
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
LIMIT_MB=${LIMIT_MB:-60}
DRY=0; FROM=""; DEST=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --from) FROM=$2; shift ;;
    --dest) DEST=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

PLATFORM_FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

if [ "$DRY" = 1 ]; then
  echo "would run: $PY -m pip download --no-deps ${PLATFORM_FLAGS[*]} -d <tmp> flashinfer-python==$FLASHINFER_VERSION '$TVM_FFI_SPEC'"
  echo "would keep in $DEST/: apache_tvm_ffi-*.whl and flashinfer_python-$FLASHINFER_VERSION-py3-none-any.whl trimmed to"
  echo "  all *.py, flashinfer/data/{include,cutlass,cccl,spdlog}, top-level flashinfer/data/csrc/* files"
  echo "and drop: flashinfer/data/csrc/<subdir>/**, flashinfer/**/csrc/**, flashinfer/**/kernel_src/**"
  echo "limit: ${LIMIT_MB} MB in all"
  exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -n "$FROM" ]; then
  cp "$FROM"/flashinfer_python-"$FLASHINFER_VERSION"-*.whl "$FROM"/apache_tvm_ffi-*cp312*.whl "$WORK"/
else
  "$PY" -m pip download -q --no-deps "${PLATFORM_FLAGS[@]}" -d "$WORK" \
    "flashinfer-python==$FLASHINFER_VERSION" "$TVM_FFI_SPEC"
fi
mkdir -p "$DEST"
rm -f "$DEST"/flashinfer_python-*.whl "$DEST"/apache_tvm_ffi-*.whl  # one version of each

"$PY" - "$WORK" "$DEST" <<'PYEOF'
"""Rewrite the flashinfer wheel without the source trees the two wrappers never compile."""
import base64, hashlib, re, shutil, sys, zipfile
from pathlib import Path

work, dest = Path(sys.argv[1]), Path(sys.argv[2])
DROP = re.compile(r"^flashinfer/(data/csrc/[^/]+/|(?!data/)(?:[^/]+/)*(csrc|kernel_src)/)")
for whl in work.glob("apache_tvm_ffi-*.whl"):
    shutil.copy(whl, dest / whl.name)
(src,) = work.glob("flashinfer_python-*.whl")
out = dest / src.name
kept, dropped, record_name, record = 0, 0, None, []
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        name = info.filename
        if name.endswith(".dist-info/RECORD"):
            record_name, record_info = name, info  # rewritten below, with the original's timestamp
            continue
        if DROP.match(name) and not name.endswith(".py"):
            dropped += info.file_size
            continue
        data = zin.read(info)
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
        kept += info.file_size
    record.append(f"{record_name},,")
    # the original entry's date: the same input gives the same bytes (build_flashinfer_aot.sh
    # reinstalls its build site, and so recompiles, only when the trimmed wheel changed)
    zout.writestr(record_info, "\n".join(record) + "\n", compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
# the sources of the fa2 and fa3 batch-prefill modules (the JIT fallback), and the wrappers
for needed in ("flashinfer/data/csrc/batch_prefill.cu", "flashinfer/data/csrc/batch_prefill_jit_binding.cu",
               "flashinfer/data/csrc/batch_prefill_sm90.cu", "flashinfer/data/csrc/batch_prefill_sm90_jit_binding.cu",
               "flashinfer/prefill.py", "flashinfer/decode.py"):
    if needed not in {r.split(",")[0] for r in record}:
        raise SystemExit(f"trimmed wheel lacks {needed}: the wheel layout changed, check the trim rule")
print(f"{out.name}: kept {kept / 1e6:.0f} MB uncompressed, dropped {dropped / 1e6:.0f} MB; wheel {out.stat().st_size / 1e6:.1f} MB")
PYEOF

TOTAL=$(du -cm "$DEST"/*.whl | tail -1 | cut -f1)
ls -l "$DEST"/*.whl
if [ "$TOTAL" -gt "$LIMIT_MB" ]; then
  echo "wheels total ${TOTAL} MB > ${LIMIT_MB} MB: they will not travel (64 MiB limit)" >&2
  exit 1
fi
echo "ok: ${TOTAL} MB in $DEST (carry it with: run(..., carry=[\"$DEST\"]))"
