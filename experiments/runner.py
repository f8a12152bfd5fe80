"""One cell of an experiment: a backend at a capacity and page size on a workload.

A cell runs two protocols on the same cache geometry:
- the replay protocol (sequential, exact; the one the bounds are defined for): hit rate,
  evictions, cache-manager µs per request;
- the serving protocol (continuous batching on a virtual clock) through an executor: TTFT,
  TPOT, throughput, preemptions, peak pages, and the hit rate under concurrency.
Its result is a JSON-able dict holding the full configuration, so `report` can redraw
every figure from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from cachelib import create_cache
from cachelib.interface import PrefixCache
from experiments import defaults
from experiments.backend_options import variant_label
from experiments.engine import (
    CacheClient,
    CostModelExecutor,
    Executor,
    FixedStepExecutor,
    ModelExecutor,
    ServingConfig,
    replay,
    serve,
)
from experiments.engine.executors import DEVICE_PROFILES
from experiments.engine.request import ORDERINGS, SCHEDULERS
from experiments.errors import InputError
from experiments.labels import cell_label_of
from experiments.metrics import serving_metrics
from experiments.routers.registry import make_router, router_label
from experiments.workloads.generators import Workload
from experiments.workloads.registry import make_workload

PROTOCOLS = ("replay", "serving", "both")
#: cost: the roofline cost model; model: the real model; fixed: a constant `step_ms` per non-empty step
EXECUTORS = ("cost", "model", "fixed")
#: where a cell's per-request serving records travel, beside its summary (`run_cell`); the
#: results document leaves them out, `results.write_per_request` writes them as JSON lines
PER_REQUEST = "per_request"
#: Test seam, declared: when this environment variable is `<backend>@<capacity_tokens>`,
#: `run_cell` kills its own process with SIGKILL as that cell starts, which is what an
#: out-of-memory kill looks like to the parent. tests/test_outputs.py uses it to check that
#: a dead worker is named and the finished cells are kept. Never set otherwise.
KILL_CELL_ENV = "PCL_TEST_KILL_CELL"


class CapacityError(InputError, ValueError):
    """The capacity cannot hold even one request of the workload."""


class ConfigError(InputError, ValueError):
    """A cell setting that names nothing known (a protocol, executor, device, scheduler or
    model), or settings that contradict each other (`--ordering lpf` with the vllm scheduler,
    async scheduling with the legacy one, a step time without the fixed executor or its lack)."""


class WorkloadInputError(InputError, ValueError):
    """The workload refused its knobs or input files (raised by `build_workload`)."""


@dataclass(frozen=True)
class CellConfig:
    """Everything that defines a cell; `key()` names its result file in a sweep."""

    backend: str
    workload: str
    capacity_tokens: int
    page_size: int = defaults.PAGE_SIZE
    knobs: dict[str, Any] = field(default_factory=dict)
    seed: int = defaults.SEED
    protocol: str = defaults.PROTOCOL
    executor: str = defaults.EXECUTOR
    device: str = defaults.DEVICE
    model: str = defaults.MODEL
    attention: str = defaults.ATTENTION  # model executor: auto | torch | flashinfer
    device_calibration: str | None = None  # GPU benchmark JSON the cost model calibrates from
    token_budget: int = defaults.TOKEN_BUDGET
    max_running: int = defaults.MAX_RUNNING
    ordering: str = defaults.ORDERING
    #: serving's scheduling policy (`SCHEDULERS`): vllm | legacy (the only one taking ordering lpf)
    scheduler: str = defaults.SCHEDULER
    #: vLLM's async scheduling, two batches in flight (vllm scheduler only)
    async_scheduling: bool = False
    #: milliseconds per non-empty step of the fixed executor; required with it, refused otherwise
    step_ms: float | None = None
    #: the backend's non-default constructor options (experiments/backend_options.py)
    backend_options: dict[str, Any] = field(default_factory=dict)
    #: serving replicas, each with its own cache of `capacity_tokens` and its own executor,
    #: behind `router` (experiments/engine/cluster.py); 1 is single-replica serving
    replicas: int = 1
    #: the router of a cluster (`experiments.routers.ROUTERS`); None with one replica
    router: str | None = None
    #: the router's non-default constructor options (experiments/routers/registry.py)
    router_options: dict[str, Any] = field(default_factory=dict)
    #: what the numbers depend on beyond the settings (experiments/provenance.py): the code
    #: version and input file digests; part of `key()`, so stale cells are never reused
    provenance: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"unknown protocol {self.protocol!r}; choose one of {', '.join(PROTOCOLS)}")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"unknown executor {self.executor!r}; choose one of {', '.join(EXECUTORS)}")
        if self.device not in DEVICE_PROFILES:
            raise ConfigError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICE_PROFILES)}")
        self._check_serving()
        self._check_cluster()

    def _check_serving(self) -> None:
        """The scheduler and step settings agree with each other (before any work: a cell's
        `ServingConfig` would refuse them only once it runs)."""
        if self.ordering not in ORDERINGS:
            raise ConfigError(f"unknown ordering {self.ordering!r}; choose one of {', '.join(ORDERINGS)}")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"unknown scheduler {self.scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
        if self.executor == "fixed":
            step = self.step_ms
            if step is None:
                raise ConfigError("executor 'fixed' needs --step-ms MS, the milliseconds each non-empty step takes")
            if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step) or step <= 0:
                raise ConfigError(f"executor 'fixed' needs a positive, finite step time (--step-ms MS), got {step!r}")
        elif self.step_ms is not None:
            raise ConfigError(
                f"a step time (--step-ms {self.step_ms!r}) is for executor 'fixed' only; "
                f"executor {self.executor!r} times its steps itself (add --executor fixed, or drop --step-ms)"
            )
        if self.scheduler == "vllm" and self.ordering != "fcfs":
            raise ConfigError(
                f"ordering {self.ordering!r} needs --scheduler legacy: the vllm scheduler is FCFS, as vLLM's default policy"
            )
        if not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling is true or false, got {self.async_scheduling!r}")
        if self.async_scheduling and self.scheduler != "vllm":
            raise ConfigError(
                f"async scheduling (--async-scheduling) is vLLM's engine loop: it needs --scheduler vllm, "
                f"not {self.scheduler!r}"
            )

    def _check_cluster(self) -> None:
        """A cluster has at least one replica, a router exactly when it has more than one,
        and the synchronous engine loop (before any work)."""
        n = self.replicas
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"replicas (--replicas) must be an integer >= 1, got {n!r}")
        if n == 1:
            if self.router is not None or self.router_options:
                raise ConfigError(f"a router (--router {self.router}) needs a cluster: --replicas N with N > 1")
            return
        if self.router is None:
            raise ConfigError(f"a cluster of {n} replicas needs a router (--router NAME)")
        make_router(self.router, n, self.router_options)  # an unknown router or a refused option fails here
        if self.protocol != "serving":
            raise ConfigError(
                f"a cluster of {n} replicas runs the serving protocol only (--protocol serving); the replay "
                f"protocol replays one cache, not {self.protocol!r}"
            )
        if self.async_scheduling:
            raise ConfigError(
                f"async scheduling (--async-scheduling) runs one replica's engine loop; a cluster of {n} replicas "
                "runs the synchronous loop (drop it, or use --replicas 1)"
            )

    @property
    def router_label(self) -> str | None:
        """The router and its non-default options, as `--router` takes it (None: one replica)."""
        return None if self.router is None else router_label(self.router, self.router_options)

    @property
    def label(self) -> str:
        """The cell as tables and plots name it: its backend label, and for a cluster its
        size and router: `apc ×8 cache_aware`."""
        return cell_label_of(self.as_dict())

    @property
    def backend_label(self) -> str:
        """The backend and its non-default options, as tables name it: `radix[eviction_policy=lfu]`."""
        return variant_label(self.backend, self.backend_options)

    def as_dict(self) -> dict[str, Any]:
        """Every field, except the cluster's for a single replica: a one-replica cell reads
        (and is keyed, `key()`) exactly as before clusters existed."""
        out = dataclasses.asdict(self)
        if self.replicas == 1:
            for name in SINGLE_REPLICA:
                out.pop(name)
        return out

    def key(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str).encode()
        return f"{self.workload}-{self.backend}-c{self.capacity_tokens}-p{self.page_size}-{hashlib.sha1(blob).hexdigest()[:10]}"


#: the cluster fields of a `CellConfig` and their single-replica values, left out of
#: `as_dict` for one replica (and filled back in by readers of older documents)
SINGLE_REPLICA: dict[str, Any] = {"replicas": 1, "router": None, "router_options": {}}


def build_workload(cfg: CellConfig) -> Workload:
    """The cell's workload. The workloads refuse bad knobs, traces and tokenizers with a
    `ValueError` or `FileNotFoundError`; those are bad input, a `WorkloadInputError`."""
    try:
        return make_workload(cfg.workload, seed=cfg.seed, **cfg.knobs)
    except InputError:
        raise
    except (ValueError, FileNotFoundError) as exc:
        raise WorkloadInputError(str(exc)) from exc


def check_capacity(workload: Workload, capacity_tokens: int, page_size: int) -> int:
    """Pages at this capacity; `CapacityError` if the largest request does not fit alone."""
    num_pages = capacity_tokens // page_size
    worst = max(workload.requests, key=lambda s: s.prompt_len + s.output_len)
    need = -(-(worst.prompt_len + worst.output_len) // page_size)
    if num_pages < need:
        raise CapacityError(
            f"capacity {capacity_tokens} tokens ({num_pages} pages of {page_size}) is smaller than request "
            f"{worst.request_id!r}, which needs {need * page_size} tokens"
        )
    return num_pages


def _declare_prefixes(cache: PrefixCache, workload: Workload, executor: Executor) -> tuple[list, float]:
    """Register the workload's declared prefixes on a backend that shares only what is
    declared, compute their KV once, and remap the requests' prefix ids to the backend's."""
    requests = workload.requests
    if not workload.declared_prefixes:
        return requests, 0.0
    if not cache.declares_prefixes:
        # automatic backends find the prefix themselves; the ids mean nothing to them
        return [dataclasses.replace(s, prefix_id=None) for s in requests], 0.0
    # a client of its own: the call order is checked, and set-up is not the run's cache time
    client = CacheClient(cache)
    mapping: dict[int, int] = {}
    seconds = 0.0
    for wid, tokens in workload.declared_prefixes.items():
        declared = client.register_prefix(tokens, workload.extra_of_prefix(wid))
        if declared is None:
            raise CapacityError(f"declared prefix {wid} ({len(tokens)} tokens) does not fit the capacity")
        pid, pseq = declared
        step_seconds, _ = executor.step([(pseq, len(pseq), 0)])
        seconds += step_seconds
        client.commit(pseq, len(pseq))
        mapping[wid] = pid
    remapped = [s if s.prefix_id is None else dataclasses.replace(s, prefix_id=mapping[s.prefix_id]) for s in requests]
    return remapped, seconds


def make_executor(cfg: CellConfig, num_pages: int):
    if cfg.executor == "fixed":
        return FixedStepExecutor(cfg.step_ms / 1000)  # type: ignore[operator]  # checked in CellConfig
    if cfg.executor == "cost":
        from experiments.engine.executors import ModelShape, llama3_8b_shape

        device = DEVICE_PROFILES[cfg.device]
        if cfg.device_calibration:
            device = device.calibrated(cfg.device_calibration)
        if cfg.model == "llama3-8b":
            return CostModelExecutor(llama3_8b_shape(), device)
        from attention.model import PRESETS

        return CostModelExecutor(ModelShape.from_config(PRESETS[cfg.model]), device)
    from attention.model import PRESETS, LlamaModel

    if cfg.model not in PRESETS:
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of {', '.join(PRESETS)}")
    device = "cuda" if cfg.attention != "torch" and _cuda() else "cpu"
    model = LlamaModel(PRESETS[cfg.model], seed=cfg.seed, device=device, attention=cfg.attention)
    return ModelExecutor(model, num_pages, cfg.page_size)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_cell(cfg: CellConfig, workload: Workload | None = None, *, progress: bool = False) -> dict[str, Any]:
    """Run one cell; returns config, metrics and the series the plots need, and under the
    serving protocol every request's record (`PER_REQUEST`: the engine's per-request dicts,
    for per_request.jsonl; the results document leaves them out)."""
    if os.environ.get(KILL_CELL_ENV) == f"{cfg.backend}@{cfg.capacity_tokens}":
        os.kill(os.getpid(), signal.SIGKILL)
    workload = workload or build_workload(cfg)
    num_pages = check_capacity(workload, cfg.capacity_tokens, cfg.page_size)
    out: dict[str, Any] = {"config": cfg.as_dict(), "workload_config": workload.config, "num_pages": num_pages}
    started = time.perf_counter()
    if cfg.protocol != "replay" and any(s.beam_width > 1 for s in workload.requests):
        raise ConfigError(
            "beam search runs under the replay protocol only (--protocol replay); the serving engine forks parallel samples"
        )
    if cfg.protocol in ("replay", "both"):
        cache = create_cache(cfg.backend, num_pages=num_pages, page_size=cfg.page_size, **cfg.backend_options)
        executor = CostModelExecutor()  # replay needs no timing; only prefix set-up runs through it
        requests, _ = _declare_prefixes(cache, workload, executor)
        r = replay(cache, requests, progress=progress)
        r.pop("per_request_hits")
        out["replay"] = r
    if cfg.protocol in ("serving", "both"):
        if cfg.replicas > 1:
            out.update(_serve_cluster(cfg, workload, num_pages, progress))
        else:
            cache = create_cache(cfg.backend, num_pages=num_pages, page_size=cfg.page_size, **cfg.backend_options)
            executor = make_executor(cfg, num_pages)
            requests, setup = _declare_prefixes(cache, workload, executor)
            res = serve(cache, requests, executor, _serving_config(cfg), progress=progress)
            out["serving"] = serving_metrics(res, cache.stats(), setup_seconds=setup)
            out[PER_REQUEST] = res.requests
    out["wall_seconds"] = time.perf_counter() - started
    return out


def _serving_config(cfg: CellConfig) -> ServingConfig:
    return ServingConfig(
        cfg.token_budget, cfg.max_running, cfg.ordering, scheduler=cfg.scheduler, async_scheduling=cfg.async_scheduling
    )


def _serve_cluster(cfg: CellConfig, workload: Workload, num_pages: int, progress: bool) -> dict[str, Any]:
    """The serving protocol on `cfg.replicas` replicas, each with a cache of `num_pages` and
    its own executor, behind `cfg.router`: the cluster as one `serving` section, the
    `cluster` section (each replica's numbers, the router's) and every request's record
    with its `replica`. Each replica sets up the declared prefixes in its own cache."""
    from experiments.cluster_metrics import cluster_section, merged_result, summed_stats
    from experiments.engine.cluster import serve_cluster

    n = cfg.replicas
    caches = [
        create_cache(cfg.backend, num_pages=num_pages, page_size=cfg.page_size, **cfg.backend_options) for _ in range(n)
    ]
    executors = [make_executor(cfg, num_pages) for _ in range(n)]
    declared = [_declare_prefixes(c, workload, e) for c, e in zip(caches, executors, strict=True)]
    requests = declared[0][0]
    if any([s.prefix_id for s in r] != [s.prefix_id for s in requests] for r, _ in declared[1:]):
        raise RuntimeError("the replicas' caches numbered the declared prefixes differently")
    router = make_router(cfg.router, n, cfg.router_options)  # type: ignore[arg-type]  # a cluster has one (CellConfig)
    res = serve_cluster(caches, requests, executors, router, _serving_config(cfg), progress=progress)
    stats = [c.stats() for c in caches]
    setup = max(seconds for _, seconds in declared)  # the replicas set up side by side
    return {
        "serving": serving_metrics(merged_result(res), summed_stats(stats), setup_seconds=setup),
        "cluster": cluster_section(res, stats, dict(cfg.router_options)),
        PER_REQUEST: res.requests,
    }


def bounds(workload: Workload, page_size: int, capacities: list[int]) -> dict[str, Any]:
    """Infinite-capacity and Belady hit rates (replay protocol) for each capacity."""
    from experiments.oracle import belady_hits, infinite_hits, page_keys

    keys = page_keys(workload.requests, page_size)
    inf = infinite_hits(workload.requests, page_size, keys=keys)
    out = {
        "page_size": page_size,
        "infinite": {"hit_rate": inf["hit_rate"], "hit_tokens": inf["hit_tokens"]},
        "belady": {},
    }
    for cap in capacities:
        b = belady_hits(workload.requests, page_size, cap // page_size, keys=keys)
        out["belady"][str(cap)] = {"hit_rate": b["hit_rate"], "hit_tokens": b["hit_tokens"]}
    return out
