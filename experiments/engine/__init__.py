"""The simulator's engine: serving policies, their drivers, one way to call a cache (docs/architecture.md).

- `vllm.VllmScheduler`: one replica scheduling as vLLM 0.33's V1 scheduler (the `vllm`
  policy): queues, token budget, chunked prefill, preemption, decode windows, async
  scheduling; its running requests are rows (`running.RunningRows`) and each per-step rule
  one function over them (`kernels.py`, compiled by numba where installed: `compiled.py`).
- `serving.serve`: the serving protocol, a driver stepping a policy on a `clock.VirtualClock`.
- `cluster.serve_cluster`: the serving protocol on N replicas (one policy, cache client
  and executor each) on one clock, a router (experiments/engine/routers/) choosing each request's.
- `replay.replay`: the replay protocol (sequential, exact; fidelity and bounds), a driver
  of its own over a cache client.
- `cache_client.CacheClient`: times every cache call and holds each sequence to the
  contract's call order; everything that calls a cache goes through it.
- `executors`: the `Executor` protocol (declared capabilities) and its implementations
  (cost model, fixed step, the real model, replay's).
- `transfers.TransferClock` and `tiered.TierSteps`: a tiered cache's transfers on the
  serving clock, and what a policy asks of them around its steps.
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
from experiments.engine.serving import serve
from experiments.engine.vllm import VllmScheduler
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
    "ServingConfig",
    "ServingResult",
    "VirtualClock",
    "VllmScheduler",
    "replay",
    "serve",
    "serve_cluster",
    "unlimited_pages",
]
