"""Routers: which replica of a cluster serves each request (issue 13; docs/architecture.md).

- `base`: the contract, `Router.route(request, view) -> replica index`, and `ClusterView`,
  what a router can see (per replica: queue length, running count, outstanding tokens, KV
  usage; the request's tokens and session; the time).
- `load`: `round_robin`, `random`, `least_load`, `power_of_two`.
- `affinity`: `consistent_hash` (a prefix key, bounded loads), `session`.
- `cache_aware`: SGLang's cache-aware router over an approximate tree (`approx_tree`).
- `precise` (llm-d's precise prefix-cache scorer with its load scorers) and `kv_cost`
  (Dynamo's KV router cost): over each replica's exact cache, rebuilt from its KV events
  (`kv_index`).
- `registry`: the routers by name and their typed options (`--router`, `--router-opt`).

Nothing here imports the engine: the cluster driver (experiments/engine/cluster.py) calls
a router through this contract.
"""

from __future__ import annotations

from experiments.engine.routers.base import ClusterView, Router, RouterError, StaticView
from experiments.engine.routers.registry import ROUTERS, make_router

__all__ = [
    "ROUTERS",
    "ClusterView",
    "Router",
    "RouterError",
    "StaticView",
    "make_router",
]
