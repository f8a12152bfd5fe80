"""Build FlashInfer's paged-attention modules ahead of time and check them (scripts/build_flashinfer_aot.sh).

Run by the build script with an interpreter that can import the trimmed flashinfer wheel (a
--target dir on PYTHONPATH): never imported by the project itself, so nothing on the CPU path
imports flashinfer.

Which modules. `attention/flashinfer_backend.py` plans two wrappers; FlashInfer 0.7.4 then
loads one module per (backend, argument tuple):
  * `BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")`, backend "auto": `plan()` calls
    `_determine_auto_backend`, which gives "fa3" on sm90a for bf16 / pos-encoding NONE / no
    custom mask / head dim 128, but "fa2" when the batch's longest query is <= 64 tokens
    (prefill.py, `_determine_auto_backend`); then `get_batch_prefill_module(backend, *args)`.
  * `BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)`: `plan()` resolves
    "auto" to "fa2" for a non-fp8 cache and calls the same `get_batch_prefill_module("fa2",
    *args)`; the CUDA-core `batch_decode` module is never built.
For fa2, `get_batch_prefill_module` loads `_gen_batch_prefill_primary_module` (K/V with equal
strides, name suffix `_kv_stride_equal`) and builds the unequal-stride module only lazily, on a
run whose K and V strides differ; ours never do (K and V are `kv_layer[:, 0]` and
`kv_layer[:, 1]` of one 5-D tensor). For fa3 it loads `gen_batch_prefill_module` (suffix `_sm90`).
The argument tuple is the one both `plan()`s build from our `plan` arguments (see ARGS).

FlashInfer looks for `flashinfer/data/aot/<name>/<name>.so` before it compiles
(jit/env.py `get_aot_artifacts`); with FLASHINFER_DISABLE_JIT=1 it raises instead of compiling.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# `get_batch_prefill_module(backend, *ARGS)`, as both plan()s build it for our calls:
# q/kv/o dtype bf16 (q_data_type=kv_data_type=dtype, o defaults to q), dtype_idx =
# kv_indptr.dtype (int32, attention/metadata.py), head_dim_qk = head_dim_vo = 128,
# PosEncodingMode.NONE = 0, use_sliding_window = (window_left >= 0) = False,
# use_logits_soft_cap = (0.0 > 0) = False, use_fp16_qk_reduction = False,
# use_token_head_sf = False.
ARG_NAMES = (
    "dtype_q",
    "dtype_kv",
    "dtype_o",
    "dtype_idx",
    "head_dim_qk",
    "head_dim_vo",
    "pos_encoding_mode",
    "use_sliding_window",
    "use_logits_soft_cap",
    "use_fp16_qk_reduction",
    "use_token_head_sf",
)
HEAD_DIM = 128

# backend -> (generator in flashinfer.jit.attention.modules, who calls it)
MODULES = {
    "fa2": ("_gen_batch_prefill_primary_module", "prefill with longest query <= 64 tokens; decode (tensor cores)"),
    "fa3": ("gen_batch_prefill_module", "prefill with longest query > 64 tokens (sm90a)"),
}
# Functions the wrappers call on each module (prefill.py get_batch_prefill_module, decode.py plan).
REQUIRED_FUNCTIONS = ("plan", "paged_run", "ragged_run")

# What a module may need from outside: the CUDA runtime, the C/C++ runtime, and tvm-ffi's C ABI
# (resolved from libtvm_ffi.so, which `import tvm_ffi` loads). Anything else (the driver's
# libcuda, libtorch, libpython) would fail on the device or tie us to one interpreter.
ALLOWED_NEEDED = re.compile(
    r"^(libcudart\.so\.\d+|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libm\.so\.6|libc\.so\.6|"
    r"libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|ld-linux-x86-64\.so\.2|libtvm_ffi\.so)$"
)


# Undefined on purpose: batch_prefill.cu's DISPATCH_CTA_TILE_Q has a case for a 32-row query
# tile, but the kernel templates (batch_prefill_*_kernel_inst.jinja) instantiate it only for
# head_dim_vo >= 512, where FA2DetermineCtaTileQ can pick it; at head dim 128 it picks 16, 64
# or 128, so these references are never called and stay unbound (lazy binding; FlashInfer's
# own JIT builds leave the same). Any other undefined symbol fails verify.
UNREACHABLE_UNDEFINED = re.compile(
    r"^_ZN10flashinfer\d+BatchPrefillWith(Paged|Ragged)KVCacheDispatchedI(Lb[01]E)?Lj32E"
)


def module_args():
    import torch

    return (
        torch.bfloat16,
        torch.bfloat16,
        torch.bfloat16,
        torch.int32,
        HEAD_DIM,
        HEAD_DIM,
        0,
        False,
        False,
        False,
        False,
    )


def specs():
    """{backend: JitSpec} computed by flashinfer's own generators (so the names are flashinfer's)."""
    from flashinfer.jit.attention import modules

    return {backend: getattr(modules, gen)(backend, *module_args()) for backend, (gen, _) in MODULES.items()}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cmd_names(_args) -> int:
    for backend, spec in specs().items():
        print(backend, spec.name)
    return 0


def cmd_build(args) -> int:
    """Compile each module with flashinfer's own ninja rules; copy the .so files to --out."""
    import flashinfer
    import tvm_ffi

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "flashinfer": flashinfer.__version__,
        "apache_tvm_ffi": tvm_ffi.__version__,
        "cuda_arch_list": os.environ.get("FLASHINFER_CUDA_ARCH_LIST"),
        "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1],
        "args": dict(zip(ARG_NAMES, map(str, module_args()), strict=True)),
        "modules": {},
    }
    for backend, spec in specs().items():
        if args.only and backend not in args.only:
            continue
        started = time.perf_counter()
        print(f"== building {backend}: {spec.name} ({len(spec.sources)} sources)", flush=True)
        spec.build(verbose=args.verbose)
        seconds = time.perf_counter() - started
        so = spec.jit_library_path
        dest = out / spec.name / f"{spec.name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, dest)
        manifest["modules"][backend] = {
            "name": spec.name,
            "generator": MODULES[backend][0],
            "used_for": MODULES[backend][1],
            "bytes": dest.stat().st_size,
            "sha256": sha256(dest),
            "build_seconds": round(seconds, 1),
        }
        print(f"   {backend}: {dest.stat().st_size / 1e6:.1f} MB in {seconds:.0f} s", flush=True)
    old = out / "manifest.json"
    if old.exists():
        kept = json.loads(old.read_text())["modules"]
        for backend, mod in manifest["modules"].items():  # ninja had nothing to do: keep the real build time
            if kept.get(backend, {}).get("sha256") == mod["sha256"]:
                mod["build_seconds"] = kept[backend]["build_seconds"]
        if args.only:  # a partial rebuild keeps the other module's record
            manifest["modules"] = {**kept, **manifest["modules"]}
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(old)
    return 0


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def cmd_package(args) -> int:
    """Rewrite the trimmed flashinfer wheel with the AOT modules in flashinfer/data/aot/<name>/."""
    aot = Path(args.aot)
    manifest = json.loads((aot / "manifest.json").read_text())
    missing = [b for b in MODULES if b not in manifest["modules"]]
    if missing:
        raise SystemExit(f"no AOT module built for {missing}: run the build first")
    src, dest = Path(args.wheel), Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / src.name
    tmp = dest / (src.name + ".tmp")
    record_name, record = None, []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record_name, record_info = info.filename, info  # rewritten below, same timestamp
                continue
            if info.filename.startswith("flashinfer/data/aot/"):
                continue  # a previous packaging's modules: replaced below
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            record.append(_record_line(info.filename, data))
        for mod in manifest["modules"].values():
            name = f"flashinfer/data/aot/{mod['name']}/{mod['name']}.so"
            data = (aot / mod["name"] / f"{mod['name']}.so").read_bytes()
            if hashlib.sha256(data).hexdigest() != mod["sha256"]:
                raise SystemExit(f"{name} does not match the manifest's sha256: rebuild")
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = 0o755 << 16
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            record.append(_record_line(name, data))
        if record_name is None:
            raise SystemExit(f"{src} has no RECORD")
        record.append(f"{record_name},,")
        zout.writestr(record_info, "\n".join(record) + "\n", compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    tmp.replace(out)
    shutil.copy2(aot / "manifest.json", dest / "flashinfer_aot_manifest.json")
    print(f"{out}: {out.stat().st_size / 1e6:.1f} MB with {len(manifest['modules'])} AOT modules")
    return 0


# ---------------------------------------------------------------- verify


def _needed(so: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def _dynsyms(so: Path, *, undefined: bool) -> set[str]:
    flag = "--undefined-only" if undefined else "--defined-only"
    out = subprocess.run(["nm", "-D", flag, str(so)], capture_output=True, text=True, check=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        if not parts:
            continue
        sym = parts[-1].split("@")[0]
        if undefined or (len(parts) >= 3 and parts[1] not in ("U", "w", "v")):
            names.add(sym)
        if undefined:
            # weak undefined symbols ('w', 'v') may stay unresolved by design
            if parts[0] in ("w", "v"):
                names.discard(sym)
    return names


def _resolve_lib(name: str, search: list[Path]) -> Path | None:
    for d in search:
        p = d / name
        if p.exists():
            return p
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.strip().startswith(name + " ") and "x86-64" in line:
            return Path(line.split("=>")[-1].strip())
    return None


def cmd_verify(args) -> int:
    """With FLASHINFER_DISABLE_JIT=1: flashinfer finds each module in data/aot and loads it,
    the module exports what the wrappers call, and links nothing but the allowed libraries."""
    if os.environ.get("FLASHINFER_DISABLE_JIT") != "1":
        raise SystemExit("verify runs with FLASHINFER_DISABLE_JIT=1, so a missing module raises instead of compiling")
    import flashinfer
    import tvm_ffi
    from flashinfer.jit import env as jit_env

    failures: list[str] = []
    site = Path(flashinfer.__file__).resolve().parents[1]
    print(
        f"flashinfer {flashinfer.__version__} from {site}; tvm-ffi {tvm_ffi.__version__}; python {sys.version.split()[0]}"
    )
    if args.expect_site and Path(args.expect_site).resolve() != site:
        failures.append(f"flashinfer imported from {site}, not from the fresh install {args.expect_site}")
    tvm_lib = Path(tvm_ffi.__file__).resolve().parent / "lib" / "libtvm_ffi.so"
    tvm_syms = _dynsyms(tvm_lib, undefined=False) if tvm_lib.exists() else set()
    if not tvm_syms:
        failures.append(f"no libtvm_ffi.so at {tvm_lib}")
    search = [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    manifest = None
    if args.manifest:
        manifest = json.loads(Path(args.manifest).read_text())
        if manifest["apache_tvm_ffi"] != tvm_ffi.__version__:
            failures.append(
                f"modules built against tvm-ffi {manifest['apache_tvm_ffi']}, installed {tvm_ffi.__version__}"
            )
    for backend, spec in specs().items():
        artifacts = jit_env.get_aot_artifacts(spec.name)
        where = [str(a.path) for a in artifacts]
        expected = jit_env.FLASHINFER_AOT_DIR / spec.name / f"{spec.name}.so"
        print(f"-- {backend}: {spec.name}")
        if not artifacts or artifacts[0].path != expected:
            failures.append(f"{backend}: flashinfer does not find {expected} (found {where})")
            continue
        so = artifacts[0].path
        if manifest is not None and sha256(so) != manifest["modules"][backend]["sha256"]:
            failures.append(f"{backend}: installed {so.name} differs from the one built (sha256)")
        needed = _needed(so)
        bad = [n for n in needed if not ALLOWED_NEEDED.match(n)]
        print(f"   {so.stat().st_size / 1e6:.1f} MB; NEEDED {needed}")
        if bad:
            failures.append(f"{backend}: links {bad} (allowed: cudart, libstdc++, libgcc, glibc, tvm-ffi)")
        # every undefined symbol must come from a NEEDED library or from libtvm_ffi.so
        provided = set(tvm_syms)
        for n in needed:
            lib = _resolve_lib(n, search)
            if lib is None:
                failures.append(f"{backend}: cannot find {n} to check its symbols (set LD_LIBRARY_PATH)")
                continue
            provided |= _dynsyms(lib, undefined=False)
        undefined = _dynsyms(so, undefined=True)
        unresolved = sorted(undefined - provided)
        unreachable = [sym for sym in unresolved if UNREACHABLE_UNDEFINED.match(sym)]
        unresolved = [sym for sym in unresolved if not UNREACHABLE_UNDEFINED.match(sym)]
        from_tvm = sorted(sym for sym in undefined if sym in tvm_syms)
        print(
            f"   undefined symbols: {len(undefined)}; from tvm-ffi: {from_tvm}; "
            f"unreachable 32-row-tile kernel instances left unbound by design: {len(unreachable)}"
        )
        if unresolved:
            failures.append(f"{backend}: symbols no allowed library provides: {unresolved[:20]}")
        exported = _dynsyms(so, undefined=False)
        missing = [f for f in REQUIRED_FUNCTIONS if f"__tvm_ffi_{f}" not in exported]
        if missing:
            failures.append(
                f"{backend}: exports no {missing} (has {sorted(s for s in exported if s.startswith('__tvm_ffi_'))})"
            )
        # flashinfer's own loader, JIT disabled: a name mismatch raises MissingJITCacheError here
        try:
            module = spec.build_and_load()
            for f in REQUIRED_FUNCTIONS:
                getattr(module, f)
            print(
                f"   loaded by flashinfer (JIT disabled): {type(module).__name__}; {', '.join(REQUIRED_FUNCTIONS)} resolved"
            )
        except Exception as exc:  # noqa: BLE001 - report every module's failure, then fail
            failures.append(f"{backend}: flashinfer could not load it: {type(exc).__name__}: {exc}")
    # the exact entry point plan() uses, for both backends
    try:
        from flashinfer.prefill import get_batch_prefill_module

        for backend in MODULES:
            get_batch_prefill_module(backend, *module_args())
        print(f"get_batch_prefill_module({', '.join(MODULES)}, bf16, i32, 128, ...) resolved with JIT disabled")
    except Exception as exc:  # noqa: BLE001
        failures.append(f"get_batch_prefill_module: {type(exc).__name__}: {exc}")
    for f in failures:
        print("FAIL:", f)
    print("verify:", "FAILED" if failures else "ok")
    return 1 if failures else 0


def cmd_resolve(_args) -> int:
    """On the device, before the tests: `get_batch_prefill_module` for fa2 and fa3, the call both
    plan()s make, finds the prebuilt modules (fails fast, in seconds, if a name does not match
    and JIT is disabled) and says where each came from."""
    from flashinfer.jit import env as jit_env
    from flashinfer.prefill import get_batch_prefill_module

    failures = []
    for backend, spec in specs().items():
        artifacts = jit_env.get_aot_artifacts(spec.name)
        source = (
            str(artifacts[0].path) if artifacts else "none prebuilt: JIT (compiles unless FLASHINFER_DISABLE_JIT=1)"
        )
        try:
            get_batch_prefill_module(backend, *module_args())
            print(f"{backend}: {spec.name}\n     from {source}: ok")
        except Exception as exc:  # noqa: BLE001 - report both, then fail
            failures.append(f"{backend}: {type(exc).__name__}: {exc}")
    for f in failures:
        print("FAIL:", f)
    return 1 if failures else 0


def cmd_load(args) -> int:
    """Another interpreter (the device's CPython 3.12) without torch: tvm_ffi.load_module,
    the loader flashinfer uses, on each installed module."""
    import tvm_ffi

    failures = []
    for so in sorted(Path(args.site, "flashinfer", "data", "aot").glob("*/*.so")):
        try:
            mod = tvm_ffi.load_module(str(so))
            for f in REQUIRED_FUNCTIONS:
                getattr(mod, f)
            print(
                f"python {sys.version.split()[0]} tvm-ffi {tvm_ffi.__version__}: loaded {so.name}; {', '.join(REQUIRED_FUNCTIONS)} resolved"
            )
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{so.name}: {type(exc).__name__}: {exc}")
    if len(list(Path(args.site, "flashinfer", "data", "aot").glob("*/*.so"))) != len(MODULES):
        failures.append(f"expected {len(MODULES)} modules under {args.site}/flashinfer/data/aot")
    for f in failures:
        print("FAIL:", f)
    print("load:", "FAILED" if failures else "ok")
    return 1 if failures else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("names", help="print each backend's module name")
    b = sub.add_parser("build", help="compile the modules (FLASHINFER_* env set by the caller)")
    b.add_argument("--out", required=True)
    b.add_argument("--only", nargs="*", choices=sorted(MODULES))
    b.add_argument("--verbose", action="store_true")
    k = sub.add_parser("package", help="put the built modules into the trimmed wheel")
    k.add_argument("--aot", required=True)
    k.add_argument("--wheel", required=True)
    k.add_argument("--dest", required=True)
    v = sub.add_parser("verify", help="load test with FLASHINFER_DISABLE_JIT=1 from a fresh install")
    v.add_argument("--manifest")
    v.add_argument("--expect-site")
    sub.add_parser("resolve", help="get_batch_prefill_module for fa2 and fa3 (the device's first check)")
    ld = sub.add_parser("load", help="tvm_ffi.load_module on each installed module (no torch needed)")
    ld.add_argument("--site", required=True)
    args = p.parse_args(argv)
    return {
        "names": cmd_names,
        "build": cmd_build,
        "package": cmd_package,
        "verify": cmd_verify,
        "resolve": cmd_resolve,
        "load": cmd_load,
    }[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
