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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attention.config import PRESETS as MODEL_PRESETS
from cachelib import available_backends, create_cache, get_backend
from cachelib.interface import PrefixCache
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
from experiments.engine.request import SCHEDULERS
from experiments.engine.routers.registry import make_router
from experiments.errors import InputError
from experiments.report.labels import cell_label_of
from experiments.report.metrics import Slos, latency_section, serving_metrics
from experiments.runs import defaults
from experiments.runs.backend_options import variant_label
from experiments.runs.model_fit import check_memory, check_torch, check_vocabulary
from experiments.runs.retiming import retime
from experiments.runs.router_options import router_label
from experiments.runs.sizing import (
    KvSizing,
    check_fits_device,
    check_weights_fit,
    fraction_tokens,
    model_shape,
    working_set_pages,
)
from experiments.timing.profile import StepProfile, load_profile, shipped_profile
from experiments.timing.profile_executor import ProfileExecutor
from experiments.workloads.generators import Workload
from experiments.workloads.registry import make_workload
from experiments.workloads.spec import RequestSpec

if TYPE_CHECKING:  # the bounds module is imported where bounds are computed (the functions below)
    from experiments.bounds.oracle import PageKeys

PROTOCOLS = ("replay", "serving", "both")
#: cost: the roofline cost model; model: the real model; fixed: a constant `step_ms` per non-empty
#: step; profile: measured operator times (experiments/timing/profile_executor.py)
EXECUTORS = ("cost", "model", "fixed", "profile")
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
    model), or settings that contradict each other (a step time without the fixed executor
    or its lack)."""


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
    #: serving's scheduling policy (`SCHEDULERS`)
    scheduler: str = defaults.SCHEDULER
    #: vLLM's async scheduling, two batches in flight (vllm scheduler only)
    async_scheduling: bool = False
    #: milliseconds per non-empty step of the fixed executor; required with it, refused otherwise
    step_ms: float | None = None
    #: the backend's non-default constructor options (experiments/runs/backend_options.py)
    backend_options: dict[str, Any] = field(default_factory=dict)
    #: serving replicas, each with its own cache of `capacity_tokens` and its own executor,
    #: behind `router` (experiments/engine/cluster.py); 1 is single-replica serving
    replicas: int = 1
    #: the router of a cluster (`experiments.engine.routers.ROUTERS`); None with one replica
    router: str | None = None
    #: the router's non-default constructor options (experiments/engine/routers/registry.py)
    router_options: dict[str, Any] = field(default_factory=dict)
    #: how `capacity_tokens` was given, when not in tokens (experiments/runs/sizing.py): GB of KV
    #: per replica, or vLLM's share of the device's memory (at most one of the two)
    capacity_gb: float | None = None
    gpu_memory_utilization: float | None = None
    #: or a share of the workload's working set (distinct pages), as libCacheSim sizes caches
    capacity_fraction: float | None = None
    #: serving's arrivals re-timed (experiments/runs/retiming.py): every time x `time_scale`, or a
    #: seeded Poisson process at `request_rate` requests/s (inf: all at 0); at most one
    time_scale: float | None = None
    request_rate: float | None = None
    #: goodput's service-level objectives in ms (`vllm bench serve --goodput`): a request is
    #: good when its TTFT and TPOT are within every one given
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    #: GPUs of one replica's tensor-parallel group (None: one); and the profile executor's
    #: table (None: the one shipped for the model and device)
    tp: int | None = None
    profile: str | None = None
    #: what the numbers depend on beyond the settings (experiments/runs/provenance.py): the code
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
        self._check_sizing_and_timing()
        self._check_parallel_and_profile()

    def _check_parallel_and_profile(self) -> None:
        """A tensor-parallel degree the model's heads allow, on a timed executor; a profile
        only for the profile executor (its table is read when the executor is made)."""
        tp = self.tp
        if tp is not None:
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise ConfigError(f"tp (--tp) must be an integer >= 1, got {tp!r}")
            if tp > 1 and self.executor not in ("cost", "profile"):
                raise ConfigError(
                    f"--tp {tp} is for the timed executors (cost, profile); executor {self.executor!r} runs one device"
                )
            try:
                model_shape(self.model, tp)
            except InputError as exc:  # (an unknown model, or heads the degree does not divide)
                raise ConfigError(str(exc)) from None
        if self.profile is not None and self.executor != "profile":
            raise ConfigError(
                f"a profile table (--profile {self.profile}) is for --executor profile, not {self.executor!r}"
            )

    def _check_serving(self) -> None:
        """The scheduler and step settings agree with each other (before any work: a cell's
        `ServingConfig` would refuse them only once it runs)."""
        if self.scheduler == "legacy":
            raise ConfigError(
                "the legacy scheduler was retired (issue 31): serving runs vLLM 0.33's policy (--scheduler vllm); "
                "results made with it stay readable, and the code that made them is in the project's history"
            )
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
        if not isinstance(self.async_scheduling, bool):
            raise ConfigError(f"async_scheduling is true or false, got {self.async_scheduling!r}")

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
        router = make_router(self.router, n, self.router_options)  # an unknown router or a refused option fails here
        if router.subscribes_kv_events and self.backend in available_backends():
            if not get_backend(self.backend).emits_kv_events:
                raise ConfigError(
                    f"router {self.router!r} needs KV events, which backend {self.backend!r} does not publish "
                    "(emits_kv_events is False): pair it with apc or radix, or choose another router"
                )
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

    def _check_sizing_and_timing(self) -> None:
        """Capacity given one way, arrivals re-timed one way, every value in range, and
        timing and SLOs only where a clock runs (before any work)."""
        for name, allow_inf, at_most_one in _ADDED_RANGES:
            value = getattr(self, name)
            if value is None:
                continue
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
            ok = ok and (math.isfinite(value) or (allow_inf and value == math.inf)) and (not at_most_one or value <= 1)
            if not ok:
                bound = " and at most 1" if at_most_one else (" (or inf)" if allow_inf else " and finite")
                raise ConfigError(
                    f"{name} (--{name.replace('_', '-')}) must be a positive number{bound}, got {value!r}"
                )
        for a, b, why in _ONE_OF:
            if getattr(self, a) is not None and getattr(self, b) is not None:
                raise ConfigError(f"--{a.replace('_', '-')} and --{b.replace('_', '-')} both given: {why}")
        timed = [
            n for n in ("time_scale", "request_rate", "slo_ttft_ms", "slo_tpot_ms") if getattr(self, n) is not None
        ]
        if timed and self.protocol == "replay":
            raise ConfigError(
                f"--{timed[0].replace('_', '-')} is about the serving protocol's clock; --protocol replay has none "
                "(use --protocol serving or both)"
            )

    @property
    def plain(self) -> bool:
        """One replica and none of the settings added with clusters (sizing, re-timing,
        SLOs): a cell that reads and is keyed exactly as before them."""
        return self.replicas == 1 and all(getattr(self, name) is None for name in ADDED)

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
        for name in ADDED:
            if out[name] is None:
                out.pop(name)
        return out

    def key(self) -> str:
        blob = json.dumps(self.as_dict(), sort_keys=True, default=str).encode()
        return f"{self.workload}-{self.backend}-c{self.capacity_tokens}-p{self.page_size}-{hashlib.sha1(blob).hexdigest()[:10]}"


#: the cluster fields of a `CellConfig` and their single-replica values, left out of
#: `as_dict` for one replica (and filled back in by readers of older documents)
SINGLE_REPLICA: dict[str, Any] = {"replicas": 1, "router": None, "router_options": {}}
#: fields added with sizing, re-timing and SLOs: left out of `as_dict` while None, so a cell
#: without them reads (and is keyed) as before they existed
ADDED = (
    "capacity_gb",
    "gpu_memory_utilization",
    "capacity_fraction",
    "time_scale",
    "request_rate",
    "slo_ttft_ms",
    "slo_tpot_ms",
    "tp",
    "profile",
)
#: (field, inf allowed, at most 1) of each added number
_ADDED_RANGES = (
    ("capacity_gb", False, False),
    ("gpu_memory_utilization", False, True),
    ("capacity_fraction", False, True),
    ("time_scale", False, False),
    ("request_rate", True, False),
    ("slo_ttft_ms", False, False),
    ("slo_tpot_ms", False, False),
)
#: pairs of settings that exclude each other, and why
_ONE_OF = (
    ("capacity_gb", "gpu_memory_utilization", "each sets the KV capacity per replica; give one"),
    ("capacity_gb", "capacity_fraction", "each sets the KV capacity per replica; give one"),
    ("gpu_memory_utilization", "capacity_fraction", "each sets the KV capacity per replica; give one"),
    (
        "time_scale",
        "request_rate",
        "a request rate replaces the arrival times (a Poisson process), leaving none to scale "
        "(vllm bench serve has the rate alone); give one",
    ),
)


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
        device = DEVICE_PROFILES[cfg.device]
        if cfg.device_calibration:
            device = device.calibrated(cfg.device_calibration)
        return CostModelExecutor(model_shape(cfg.model, cfg.tp or 1), device)
    if cfg.executor == "profile":
        return ProfileExecutor(step_profile(cfg), DEVICE_PROFILES[cfg.device], cfg.tp or 1, model=cfg.model)
    from attention.model import PRESETS, LlamaModel

    if cfg.model not in PRESETS:
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of {', '.join(PRESETS)}")
    model = LlamaModel(PRESETS[cfg.model], seed=cfg.seed, device=model_device(cfg), attention=cfg.attention)
    return ModelExecutor(model, num_pages, cfg.page_size)


def check_timing(cfg: CellConfig, capacities: Sequence[int], force_capacity: bool = False) -> None:
    """Before any work: the profile executor's table loads and can time the run (model,
    device, degree), and on a GPU the largest capacity fits beside the weights unless forced."""
    if cfg.executor == "profile":
        ProfileExecutor(step_profile(cfg), DEVICE_PROFILES[cfg.device], cfg.tp or 1, model=cfg.model)
    if cfg.executor == "model":
        return  # (the model executor checks the memory of the device it runs on: check_model_run)
    check_weights_fit(cfg.model, cfg.device, cfg.tp or 1)
    if not force_capacity and capacities:
        check_fits_device(cfg.model, cfg.device, cfg.tp or 1, max(capacities), cfg.page_size)


def step_profile(cfg: CellConfig) -> StepProfile:
    """The profile executor's table: the cell's `profile`, or the one shipped for its model and device."""
    return load_profile(cfg.profile) if cfg.profile is not None else shipped_profile(cfg.model, cfg.device)


def model_device(cfg: CellConfig) -> str:
    """Where the model executor runs: CUDA when present, unless `--attention torch` asks for the CPU."""
    import torch

    return "cuda" if cfg.attention != "torch" and torch.cuda.is_available() else "cpu"


def check_model_run(cfg: CellConfig, workload: Workload, capacities: Sequence[int], models_at_once: int) -> None:
    """`--executor model` refused before any work when it cannot run (experiments/runs/model_fit.py):
    no torch, ids past the model's vocabulary, or `models_at_once` models (cells run at once x
    replicas) with their KV caches too large for the device."""
    if cfg.executor != "model":
        return
    check_torch()
    if cfg.model not in MODEL_PRESETS:
        raise ConfigError(f"unknown model {cfg.model!r}; choose one of {', '.join(MODEL_PRESETS)}")
    check_vocabulary(cfg.model, workload)
    check_memory(cfg.model, model_device(cfg), capacities, cfg.page_size, models_at_once)


def run_cell(cfg: CellConfig, workload: Workload | None = None, *, progress: bool = False) -> dict[str, Any]:
    """Run one cell; returns config, metrics and the series the plots need, and under the
    serving protocol every request's record (`PER_REQUEST`: the engine's per-request dicts,
    for per_request.jsonl; the results document leaves them out)."""
    if os.environ.get(KILL_CELL_ENV) == f"{cfg.backend}@{cfg.capacity_tokens}":
        os.kill(os.getpid(), signal.SIGKILL)
    workload = workload or build_workload(cfg)
    sizing = kv_capacity(cfg, workload)
    num_pages = check_capacity(workload, cfg.capacity_tokens, cfg.page_size)
    out: dict[str, Any] = {
        "config": cfg.as_dict(),
        "workload_config": workload.config,
        "num_pages": num_pages,
        "kv_capacity": sizing,
    }
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
            res = serve(cache, retimed(cfg, requests), executor, _serving_config(cfg), progress=progress)
            out["serving"] = serving_metrics(res, cache.stats(), setup_seconds=setup)
            out["serving"]["latency"] = latency_section(res.requests, res.itl, res.makespan, slos_of(cfg))
            out[PER_REQUEST] = res.requests
    out["wall_seconds"] = time.perf_counter() - started
    return out


def kv_capacity(cfg: CellConfig, workload: Workload | None = None) -> dict[str, Any]:
    """The cell's KV capacity per replica in tokens, pages, bytes and GB (experiments/runs/sizing.py);
    a `ConfigError` when `capacity_tokens` is not what `capacity_gb`,
    `gpu_memory_utilization` or `capacity_fraction` gives (a cell built by hand with both,
    before any work). A fraction is checked, and its working set recorded, given the `workload`."""
    sizing = KvSizing(model_shape(cfg.model, cfg.tp or 1), cfg.page_size)
    named = ("capacity_gb", "gpu_memory_utilization", "capacity_fraction")
    given: dict[str, Any] = {n: v for n in named if (v := getattr(cfg, n)) is not None}
    if cfg.capacity_fraction is not None and workload is not None:
        pages = working_set_pages(workload, cfg.page_size)
        given["working_set_pages"] = pages
        given["working_set_tokens"] = pages * cfg.page_size
    if given and (cfg.capacity_fraction is None or workload is not None):
        if cfg.capacity_fraction is not None:
            want = fraction_tokens(cfg.capacity_fraction, given["working_set_pages"], cfg.page_size)
        elif cfg.capacity_gb is not None:
            want = sizing.tokens_for_gb(cfg.capacity_gb)
        else:
            want = sizing.tokens_on(cfg.device, cfg.gpu_memory_utilization)  # type: ignore[arg-type]
        if want != cfg.capacity_tokens:
            name, value = next(iter(given.items()))
            raise ConfigError(
                f"capacity_tokens {cfg.capacity_tokens:,} is not what {name} {value:g} gives "
                f"({want:,} tokens for {cfg.model} on {cfg.device}, pages of {cfg.page_size}): set one of them"
            )
    return sizing.describe(cfg.capacity_tokens, cfg.device, given)


def retimed(cfg: CellConfig, requests: list[RequestSpec]) -> list[RequestSpec]:
    """Serving's requests re-timed by the cell's `time_scale` or `request_rate` (experiments/runs/retiming.py)."""
    return retime(requests, time_scale=cfg.time_scale, request_rate=cfg.request_rate, seed=cfg.seed)


def slos_of(cfg: CellConfig) -> Slos:
    return Slos(cfg.slo_ttft_ms, cfg.slo_tpot_ms)


def _serving_config(cfg: CellConfig) -> ServingConfig:
    return ServingConfig(
        cfg.token_budget, cfg.max_running, scheduler=cfg.scheduler, async_scheduling=cfg.async_scheduling
    )


def _serve_cluster(cfg: CellConfig, workload: Workload, num_pages: int, progress: bool) -> dict[str, Any]:
    """The serving protocol on `cfg.replicas` replicas, each with a cache of `num_pages` and
    its own executor, behind `cfg.router`: the cluster as one `serving` section, the
    `cluster` section (each replica's numbers, the router's) and every request's record
    with its `replica`. Each replica sets up the declared prefixes in its own cache."""
    from experiments.engine.cluster import serve_cluster
    from experiments.report.cluster_metrics import cluster_section, merged_result, summed_stats

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
    res = serve_cluster(caches, retimed(cfg, requests), executors, router, _serving_config(cfg), progress=progress)
    stats = [c.stats() for c in caches]
    setup = max(seconds for _, seconds in declared)  # the replicas set up side by side
    merged = merged_result(res)
    serving = serving_metrics(merged, summed_stats(stats), setup_seconds=setup)
    serving["latency"] = latency_section(merged.requests, merged.itl, merged.makespan, slos_of(cfg))
    return {
        "serving": serving,
        "cluster": cluster_section(res, stats, dict(cfg.router_options), slos_of(cfg)),
        PER_REQUEST: res.requests,
    }


def bounds(
    workload: Workload, page_size: int, capacities: list[int], cells: Sequence[CellConfig] = ()
) -> dict[str, Any]:
    """Infinite-capacity and Belady hit rates (replay protocol) for each capacity; with
    cluster cells among `cells` their pooled caches (`pooled_bounds`), and with tiered
    cells among them Belady at their tiers' total capacity (`tiered_bounds`)."""
    from experiments.bounds.oracle import belady_hits, infinite_hits, page_keys

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
    clusters = [c for c in cells if c.replicas > 1]
    if clusters:
        out["pooled"] = pooled_bounds(workload, clusters, keys)
    tiered = tiered_bounds(workload, cells, keys)
    if tiered:
        out["tiered"] = tiered
    return out


def tier_capacities(cfg: CellConfig) -> dict[str, int]:
    """The tokens each memory tier of `cfg`'s cache holds (`PrefixCache.tier_capacities`),
    read off the cache the cell builds, so options such as the host tier's default size
    (twice the GPU) resolve exactly as they do in the run."""
    cache = create_cache(
        cfg.backend, num_pages=cfg.capacity_tokens // cfg.page_size, page_size=cfg.page_size, **cfg.backend_options
    )
    return cache.tier_capacities()


def tiered_bounds(workload: Workload, cells: Sequence[CellConfig], keys: PageKeys) -> dict[str, Any]:
    """Belady at the total capacity of all tiers of each tiered cell (per replica) among
    `cells`: a policy that moves KV between GPU, host and storage keeps at most that many
    tokens and, under the replay protocol, reuses no more than one cache of that size run
    by Belady. Keyed by the total in tokens (str), whole pages, with the cells' labels and
    their tiers' capacities (at the keys' page size)."""
    from experiments.bounds.oracle import belady_hits, infinite_hits

    page_size = keys.page_size
    out: dict[str, Any] = {}
    for cfg in cells:
        caps = tier_capacities(cfg)
        if len(caps) < 2:
            continue
        # an uncapped tier (0) makes the total unbounded: keyed "unbounded", the infinite cache
        total = 0 if 0 in caps.values() else sum(caps.values()) // page_size * page_size
        entry = out.setdefault(str(total or "unbounded"), {"capacity_tokens": total or None, "cells": {}})
        entry["cells"].setdefault(cfg.backend_label, caps)
    for entry in out.values():
        total = entry["capacity_tokens"]
        if total is None:
            b = infinite_hits(workload.requests, page_size, keys=keys)
        else:
            b = belady_hits(workload.requests, page_size, total // page_size, keys=keys)
        entry["belady"] = {"hit_rate": b["hit_rate"], "hit_tokens": b["hit_tokens"]}
    return out


def pooled_bounds(workload: Workload, clusters: Sequence[CellConfig], keys: PageKeys) -> dict[str, Any]:
    """Each cluster's pooled cache, under the replay protocol: one cache of replicas x the
    pages of one replica (the ideal of a KV store the replicas share, as Mooncake's): the
    replay hit rate of the cell's backend variant there, and Belady's there. Keyed by the
    pooled capacity in tokens (str), with the (replicas, tokens per replica) shapes it pools
    (at the keys' page size)."""
    from experiments.bounds.oracle import belady_hits

    page_size = keys.page_size
    out: dict[str, Any] = {}
    for cfg in clusters:
        total = cfg.replicas * (cfg.capacity_tokens // page_size) * page_size
        entry = out.setdefault(str(total), {"capacity_tokens": total, "shapes": [], "replay": {}})
        if [cfg.replicas, cfg.capacity_tokens] not in entry["shapes"]:
            entry["shapes"].append([cfg.replicas, cfg.capacity_tokens])
        if cfg.backend_label not in entry["replay"]:
            r = run_cell(pooled_cell(cfg, total), workload)["replay"]
            entry["replay"][cfg.backend_label] = {"hit_rate": r["hit_rate"], "hit_tokens": r["hit_tokens"]}
    for entry in out.values():
        b = belady_hits(workload.requests, page_size, entry["capacity_tokens"] // page_size, keys=keys)
        entry["belady"] = {"hit_rate": b["hit_rate"], "hit_tokens": b["hit_tokens"]}
    return out


def pooled_cell(cfg: CellConfig, capacity_tokens: int) -> CellConfig:
    """`cfg`'s backend variant alone at `capacity_tokens`, under the replay protocol (no
    cluster, no clock: re-timing and SLOs do not apply; the capacity is given in tokens)."""
    cleared = dict.fromkeys(ADDED)
    return dataclasses.replace(
        cfg,
        **SINGLE_REPLICA,
        **cleared,
        protocol="replay",
        capacity_tokens=capacity_tokens,  # type: ignore[arg-type]
    )
