"""How tables, plots, the CSV and errors name a cell: its backend variant and, for a cluster,
its size and router (`apc ×8 cache_aware[cache_threshold=0.5]`). Read from a cell's
`config` dict, so a document renders without the engine."""

from __future__ import annotations

from typing import Any

from experiments.runs.backend_options import variant_label
from experiments.runs.router_options import router_label


def cell_label_of(config: dict[str, Any]) -> str:
    """A cell's label from its `config`: `radix[eviction_policy=lfu]`, or for a cluster
    `apc ×8 cache_aware` (a one-replica config has no `replicas` key: see `CellConfig.as_dict`)."""
    backend = variant_label(config["backend"], config.get("backend_options") or {})
    if config.get("replicas", 1) == 1:
        return backend
    return f"{backend} ×{config['replicas']} {router_label(config['router'], config.get('router_options') or {})}"
