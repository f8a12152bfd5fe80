"""The engine: one scheduler, two drivers, one way to call a cache (docs/architecture.md).

- `scheduler.Scheduler`: one replica's queues, token budget, chunked prefill, preemption,
  ordering and decode windows; `step()` is one engine step on a shared `clock.VirtualClock`.
- `serving.serve`: the serving protocol, a driver stepping a scheduler on the clock.
- `cluster.serve_cluster`: the serving protocol on N replicas (one scheduler, cache client
  and executor each) on one clock, a router (experiments/routers/) choosing each request's.
- `replay.replay`: the replay protocol (sequential, exact; fidelity and bounds), a driver
  feeding a scheduler one request at a time (`Scheduler.admit_prompt`, `run_to_completion`,
  `finish_oldest`).
- `cache_client.CacheClient`: times every cache call and holds each sequence to the
  contract's call order; everything that calls a cache goes through it.
- `executors`: the `Executor` protocol (declared capabilities) and its two implementations.
"""

from __future__ import annotations

from experiments.engine.cache_client import CacheClient, CallOrderError
from experiments.engine.clock import VirtualClock
from experiments.engine.cluster import ClusterResult, serve_cluster
from experiments.engine.executors import (
    CostModelExecutor,
    Executor,
    FixedStepExecutor,
    FreshTokens,
    ModelExecutor,
    ReplayExecutor,
)
from experiments.engine.replay import Replay, replay, unlimited_pages
from experiments.engine.request import Request, ServingConfig, ServingResult
from experiments.engine.scheduler import Scheduler
from experiments.engine.serving import serve
from experiments.workloads.spec import GENERATED_TOKEN_BASE

__all__ = [
    "GENERATED_TOKEN_BASE",
    "CacheClient",
    "CallOrderError",
    "ClusterResult",
    "CostModelExecutor",
    "Executor",
    "FixedStepExecutor",
    "FreshTokens",
    "ModelExecutor",
    "Replay",
    "ReplayExecutor",
    "Request",
    "Scheduler",
    "ServingConfig",
    "ServingResult",
    "VirtualClock",
    "replay",
    "serve",
    "serve_cluster",
    "unlimited_pages",
]
