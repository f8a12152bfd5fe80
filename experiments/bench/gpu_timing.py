"""Timing and provenance for the GPU benchmark and tests; no flashinfer import, CPU-testable.

Why not `perf_counter` around each synchronized call: for a ~0.3 ms decode kernel the
wrapper's Python (argument checks, output allocation) and the launch are a visible share of
the interval, so bandwidth read low. Here a sample is `inner` back-to-back calls between two
clock marks (CUDA events on the stream: the device timeline, not the host's), and the
per-call time is the interval / `inner`; host-side work that is done once per batch
(metadata building, `plan`) is timed separately by the caller and reported apart.

Which FlashInfer kernel ran is `FlashInferAttention.resolved_backend()` (attention/flashinfer_backend.py).
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any, ClassVar


class WallClock:
    """Host clock: for CPU runs (and the tests of this module); nothing to synchronize."""

    method: ClassVar[str] = "perf_counter"

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def synchronize(self) -> None:
        pass


class CudaEventClock:
    """CUDA events recorded on the current stream: elapsed device time between two marks."""

    method: ClassVar[str] = "cuda_events"

    def __init__(self) -> None:
        import torch  # noqa: PLC0415 - only where CUDA is used

        self._torch = torch

    def mark(self):
        ev = self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end)

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()


def time_calls(fn: Callable[[], object], clock, *, warmup: int, repeat: int, inner: int) -> dict[str, Any]:
    """Per-call milliseconds of `fn`: `repeat` samples of `inner` back-to-back calls each.

    Returns median / min / max per call over the samples, with the method and counts, so a
    reader knows what the number is.
    """
    if warmup < 0 or repeat < 1 or inner < 1:
        raise ValueError(f"need warmup >= 0, repeat >= 1, inner >= 1; got {warmup}, {repeat}, {inner}")
    for _ in range(warmup):
        fn()
    clock.synchronize()
    per_call = []
    for _ in range(repeat):
        start = clock.mark()
        for _ in range(inner):
            fn()
        end = clock.mark()
        per_call.append(clock.elapsed_ms(start, end) / inner)
    clock.synchronize()
    return {
        "median_ms": statistics.median(per_call),
        "min_ms": min(per_call),
        "max_ms": max(per_call),
        "repeat": repeat,
        "inner": inner,
        "method": clock.method,
    }


def time_host(fn: Callable[[], object], *, repeat: int, sync: Callable[[], None]) -> dict[str, Any]:
    """Host wall time of `fn` (metadata building, plan), device synchronized before and after
    each call so queued kernels are not counted; median / min / max ms."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "repeat": repeat}


def driver_versions() -> dict[str, Any]:
    """The NVIDIA driver's version (nvidia-smi) and the CUDA version its libcuda supports."""
    out: dict[str, Any] = {"driver": None, "driver_cuda": None}
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        out["driver"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    try:
        v = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0:
            out["driver_cuda"] = f"{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return out
