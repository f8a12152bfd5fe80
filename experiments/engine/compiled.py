"""The serving policy's array rules (experiments/engine/kernels.py), compiled or as written.

`engine_kernels(kernel)` returns the functions of `kernels.py` as one `Kernels` namespace:
compiled by numba (the `fast` extra) for `numba`, or for `auto` where numba is installed;
the very same functions, run by numpy, for `numpy` or where numba is missing. Either way the
policy calls the same code with the same values (tests/test_kernels.py runs both on random
rows and compares every output). Each compiled function has one explicit signature, so it
is compiled (or loaded from numba's on-disk cache) when first asked for, never inside a run.
"""

from __future__ import annotations

from types import SimpleNamespace

from cachelib.hashing import numba_installed
from experiments.engine import kernels as K

KERNELS = ("auto", "numba", "numpy")
#: the rules a `Kernels` namespace holds
RULES = (
    "plan_rows",
    "unproven_rows",
    "after_schedule",
    "deliver",
    "price_rows",
    "window_bound",
    "most_steps",
    "window_calls",
)

_compiled: SimpleNamespace | None = None
_plain = SimpleNamespace(name="numpy", **{rule: getattr(K, rule) for rule in RULES})


def engine_kernels(kernel: str) -> SimpleNamespace:
    """The rules for `kernel` (`name` says which path runs), or a clear error for an unknown
    name, or for `numba` where it is not installed."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown engine kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel == "numpy" or (kernel == "auto" and not numba_installed()):
        return _plain
    if not numba_installed():
        raise ValueError("engine kernel 'numba' needs numba: pip install 'prefix-cache-lab[fast]'")
    return _compile()


def _compile() -> SimpleNamespace:
    global _compiled
    if _compiled is None:
        from numba import njit, types  # (imports numba: only here)

        i64, f64, flag = types.int64, types.float64, types.boolean
        ints, floats, flags = (types.Array(t, 1, "C") for t in (i64, f64, flag))
        signatures = {
            "plan_rows": types.Tuple((ints, ints))(ints, ints, ints, ints, ints, ints, i64, i64, flag, flag),
            "unproven_rows": flags(ints, ints, i64, i64, i64, flags, flags),
            "after_schedule": ints(ints, ints, ints, ints, ints, flag),
            "deliver": types.Tuple((ints, ints, floats, i64))(
                ints, ints, ints, flags, flags, floats, ints, f64, f64, f64, flag
            ),
            "price_rows": types.Tuple((f64, i64, i64))(ints, ints, f64, f64),
            "window_bound": i64(ints, ints, ints, ints, ints, i64),
            "most_steps": i64(ints, ints, i64, i64, i64),
            "window_calls": flags(ints, ints, ints, i64, flag, flag),
        }
        _compiled = SimpleNamespace(
            name="numba", **{rule: njit(signatures[rule], cache=True)(getattr(K, rule)) for rule in RULES}
        )
    return _compiled


def kernel_name(kernels: SimpleNamespace) -> str:
    """`numba` or `numpy`: the path `engine_kernels` chose."""
    return kernels.name
