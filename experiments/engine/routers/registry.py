"""The routers by name (`ROUTERS`) and how one is built (`make_router`); their options as
the command line gives them are experiments/runs/router_options.py's."""

from __future__ import annotations

from typing import Any

from experiments.engine.routers.affinity import ConsistentHash, Session
from experiments.engine.routers.base import Router
from experiments.engine.routers.cache_aware import CacheAware
from experiments.engine.routers.kv_cost import KvCost
from experiments.engine.routers.load import LeastLoad, PowerOfTwo, RandomRouter, RoundRobin
from experiments.engine.routers.precise import Precise
from experiments.errors import InputError

#: every router, by `--router` name, in the order `--router` lists default to
ROUTERS: dict[str, type[Router]] = {
    cls.name: cls
    for cls in (RoundRobin, RandomRouter, LeastLoad, PowerOfTwo, ConsistentHash, Session, CacheAware, Precise, KvCost)
}


def router_class(name: str) -> type[Router]:
    try:
        return ROUTERS[name]
    except KeyError:
        raise InputError(f"unknown router {name!r}; choose one of: {', '.join(ROUTERS)}") from None


def make_router(name: str, num_replicas: int, options: dict[str, Any] | None = None) -> Router:
    """Router `name` for `num_replicas` replicas; a refused option is an `InputError`."""
    cls = router_class(name)
    try:
        return cls(num_replicas, **(options or {}))
    except ValueError as exc:
        raise InputError(f"router {name!r}: {exc}") from None
