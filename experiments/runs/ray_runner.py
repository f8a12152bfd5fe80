"""Run sweep cells on Ray (`sweep --ray ADDRESS`).

`--ray local` starts a private local Ray instance for the run and shuts it down after;
any other value (`auto`, `ray://head:10001`, `head:6379`) connects to a running cluster.
Ray is an optional extra (`pip install -e '.[ray]'`); nothing else imports this module.

How workers find the project's code:
- a local instance runs its workers with the driver's interpreter, where the project is
  installed (`pip install -e .`), so they import it like the driver does;
- on a cluster the four packages (`cachelib`, `backends`, `attention`, `experiments`) are
  shipped with the job as `runtime_env={"py_modules": [...]}`, so the nodes need only the
  dependencies (numpy, xxhash, sortedcontainers, tqdm, matplotlib; torch for the model executor); set
  `PCL_RAY_SHIP_CODE=0` where the project is installed on every node.

A cell travels as `CellConfig.as_dict()` (plain JSON types) and comes back as the JSON-able
dict `run_cell` returns, so nothing but builtins crosses the wire. Results are handed to
`on_result` as each cell finishes (a sweep writes it to disk then), and a failing cell does
not stop the others: when all have ended, `CellFailed` names every cell that failed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.errors import InputError
from experiments.runs.runner import CellConfig

#: the project's top-level packages, shipped to a cluster's workers
PACKAGES = ("cachelib", "backends", "attention", "experiments")


class CellFailed(RuntimeError):
    """One or more cells raised on a Ray worker; `failures` maps cell key -> error text."""

    def __init__(self, failures: dict[str, str]):
        self.failures = failures
        lines = [f"{len(failures)} cell(s) failed on Ray:"] + [f"  {key}: {err}" for key, err in failures.items()]
        super().__init__("\n".join(lines))


def describe(cfg: CellConfig) -> str:
    return f"{cfg.key()} ({cfg.label} on {cfg.workload}, {cfg.capacity_tokens} tokens, page {cfg.page_size})"


def _run_cell_dict(config: dict[str, Any]) -> dict[str, Any]:
    """The remote task: rebuild the CellConfig from plain types and run it."""
    from experiments.runs.runner import CellConfig, run_cell

    return run_cell(CellConfig(**config))


def _runtime_env() -> dict[str, Any] | None:
    if os.environ.get("PCL_RAY_SHIP_CODE", "1") == "0":
        return None
    root = Path(__file__).resolve().parents[2]  # the checkout: experiments/runs/ is two levels down
    return {"py_modules": [str(root / p) for p in PACKAGES], "excludes": ["__pycache__", "*.pyc", "data/*.jsonl"]}


def _init(ray, address: str, num_cpus: int | None) -> bool:
    """Start or join Ray; True when this call started an instance it must shut down."""
    if ray.is_initialized():
        return False  # the caller owns the connection (a notebook, a test)
    common = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if address == "local":
        # address="local" always starts a new instance, even with RAY_ADDRESS set
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1, **common)
    else:
        ray.init(address=address, runtime_env=_runtime_env(), **common)
    return True


def _error_text(exc: BaseException) -> str:
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):  # wraps the worker's exception
        return f"{type(exc.cause).__name__}: {exc.cause}"
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"


def run_on_ray(
    cells: list[CellConfig],
    address: str,
    on_result: Callable[[CellConfig, dict[str, Any]], None] | None = None,
    *,
    num_cpus: int | None = None,
) -> list[dict[str, Any]]:
    """Run `cells` on Ray; results in input order. `on_result(cfg, result)` is called in the
    driver as each cell finishes. Raises `CellFailed` (after every cell has ended) if any
    cell raised, naming each one; the cells that succeeded were still given to `on_result`."""
    try:
        import ray
    except ImportError:
        raise InputError("--ray needs the ray extra: pip install -e '.[ray]'") from None
    if not cells:
        return []
    started = _init(ray, address, num_cpus)
    try:
        remote = ray.remote(num_cpus=1, max_retries=0)(_run_cell_dict)
        refs = {remote.remote(cfg.as_dict()): i for i, cfg in enumerate(cells)}
        results: list[dict[str, Any] | None] = [None] * len(cells)
        failures: dict[str, str] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = refs[ref]
                try:
                    res = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    failures[describe(cells[i])] = _error_text(exc)
                    continue
                results[i] = res
                if on_result is not None:
                    on_result(cells[i], res)
        if failures:
            raise CellFailed(failures)
        return results  # type: ignore[return-value]
    finally:
        if started:
            ray.shutdown()
