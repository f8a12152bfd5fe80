"""Which path computes the serving engine's per-step array work: numba's compiled loops
(experiments/engine/row_kernels.py, the `fast` extra) or numpy, the reference.

`VllmRowScheduler(kernel=...)` and `CostModelExecutor(kernel=...)` each take one of
`KERNELS`: `numba`, `numpy`, or `auto` (numba where it is installed). Both paths make the
same decisions and the same floats (tests/test_vllm_rows.py runs both against the object
loop); `numpy` is there to check that, and for a machine without numba.
"""

from __future__ import annotations

from types import ModuleType

from cachelib.hashing import numba_installed

KERNELS = ("auto", "numba", "numpy")


def engine_kernels(kernel: str) -> ModuleType | None:
    """The compiled kernels for `kernel` (None: the numpy path), or a clear error for an
    unknown name, or for `numba` where it is not installed."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown engine kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel == "numpy" or (kernel == "auto" and not numba_installed()):
        return None
    if not numba_installed():
        raise ValueError("engine kernel 'numba' needs numba: pip install 'prefix-cache-lab[fast]'")
    from experiments.engine import row_kernels  # (imports numba: only here)

    return row_kernels


def kernel_name(kernels: ModuleType | None) -> str:
    """`numba` or `numpy`: the path `engine_kernels` chose."""
    return "numpy" if kernels is None else "numba"
