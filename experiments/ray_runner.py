"""Run sweep cells on a Ray cluster (`sweep --ray ADDRESS`; `local` starts one in-process).

Ray is an optional extra (`pip install -e '.[ray]'`); nothing else imports this module.
"""

from __future__ import annotations

from typing import Any

from experiments.runner import CellConfig, run_cell


def run_on_ray(cells: list[CellConfig], address: str) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs the ray extra: pip install -e '.[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=None if address == "local" else address, ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(run_cell)
    return ray.get([remote.remote(cfg) for cfg in cells])
