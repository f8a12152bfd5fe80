"""The serving protocol on a cluster: N replicas behind a router, on one virtual clock.

Each replica is a serving `Scheduler` (the `--scheduler` policy: `vllm` by default) with its
own cache (through its own `CacheClient`) and its own executor, and runs vLLM's synchronous
engine loop on its own: `step()` computes one step (or a decode window) from `clock.now`
and says when it ends; a replica with nothing to do waits for its next routed request. The
driver is event-driven: a heap of the replicas' step ends and the clock's next arrival,
never a poll of an idle replica. At each event time t:

1. every arrival due by t is routed, in the clock's order (time, then trace order): the
   router sees the replicas (`ReplicaView`), picks one, and the request joins its waiting
   queue (`Scheduler.add`); a dependent conversation turn arrives through the clock once its
   predecessor finished on whichever replica served it (`VirtualClock.finished`);
2. every replica whose step ends at t, or that was idle and just got a request, steps (in
   replica order), when it has work.

With one replica this is `serve` exactly (same records, steps and makespan:
tests/test_cluster.py). A step is computed whole when it starts, so between a step's start
and its end a router sees the replica as it will be at the step's end (finished requests
gone, tokens computed): at most one step ahead, as a real router reading metrics lags by one.
Decode windows (k decode steps at once) stay exact: a replica's window ends before the next
arrival anywhere in the cluster (any arrival may be routed to it), and before the earliest
time a turn still waiting for its predecessor could arrive (`ClusterClock.horizon`).

A router that `subscribes_kv_events` (`precise`, `kv_cost`) is subscribed to every
replica's cache before the first request (`subscribe_router`): it learns how the replica
names its pages (`PrefixCache.page_keys`), then hears each "pages stored" / "pages removed"
as the cache call that causes it runs (`KvEventRelay`, tagging it with the replica). Like
the rest of the view, what it hears is at most one step ahead; a real router hears vLLM's
events batched per engine step and a network hop later. The time a router spends on events
is counted as the router's, not the cache's. A backend that publishes no events (`none`,
`paged`) is refused for such a router before any work.

A storage tier (L3) of `radix-hicache` given `storage_backend=shared` is one pool for the
whole cluster (`share_storage`, before the first request): every replica writes its host
backups into it and prefetches from it, as replicas sharing one Mooncake Store do, so a
prefix one replica computed is a storage hit on another. `storage_backend=file` stays
each replica's own local disk. A router does not see storage: SGLang's and the KV routers
route on device state (see cachelib/kv_events.py).

Async scheduling (two batches in flight, `serving.drive_async`) runs one replica only: the
async loop processes a step's output and schedules the next at the same instant, which the
event order above does not interleave with routing; `serve_cluster` refuses it for N > 1.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from cachelib.interface import PrefixCache
from cachelib.kv_events import KvEvent
from experiments.engine.cache_client import CPU_CLOCK, CacheClient
from experiments.engine.clock import VirtualClock
from experiments.engine.executors import Executor
from experiments.engine.request import ServingConfig, ServingResult
from experiments.engine.routers.base import Router, RouterError
from experiments.engine.serving import DEFAULT_CONFIG, finish_transfers, progress_bar, refuse_beams, scheduler_class
from experiments.engine.vllm import Loads, VllmScheduler
from experiments.workloads.spec import RequestSpec


class ClusterClock(VirtualClock):
    """The cluster's one clock. `next_arrival()` is what a replica's decode window must stop
    before: the next scheduled arrival or, sooner, `horizon`, set by the driver around each
    step to the earliest time a turn whose predecessor another replica may still finish
    could arrive. Outside a step the horizon is infinite and this is `VirtualClock`."""

    def __init__(self, requests: Seq[RequestSpec] = ()) -> None:
        super().__init__(requests)
        ids = {s.request_id for s in requests}
        #: the shortest think time of a turn that waits for another request (inf: none does)
        self.min_think = min(
            (s.think_time for s in requests if s.after is not None and s.after in ids), default=math.inf
        )
        self.horizon = math.inf

    def next_arrival(self) -> float | None:
        scheduled = super().next_arrival()
        if self.horizon == math.inf:
            return scheduled
        return self.horizon if scheduled is None else min(scheduled, self.horizon)

    def next_scheduled(self) -> float | None:
        """The next arrival on the heap (the driver's next arrival event)."""
        return super().next_arrival()


def session_ids(requests: Seq[RequestSpec]) -> dict[str, str]:
    """Request id -> its session id, for every request of a conversation (one that follows
    another, `RequestSpec.after`, or that another follows): the first request id of its
    chain, what a client would send as a session header. Requests alone have none."""
    by_id = {s.request_id: s for s in requests}
    followed = {s.after for s in requests if s.after in by_id}
    root: dict[str, str] = {}
    for s in requests:
        if s.after not in by_id and s.request_id not in followed:
            continue
        chain, cur = [], s
        while cur.request_id not in root and cur.after in by_id:
            chain.append(cur.request_id)
            cur = by_id[cur.after]
            if len(chain) > len(by_id):
                raise ValueError(f"request {s.request_id!r}: its `after` chain loops")
        first = root.get(cur.request_id, cur.request_id)
        for rid in [*chain, cur.request_id]:
            root[rid] = first
    return root


class ReplicaView:
    """The routers' `ClusterView` (experiments/engine/routers/base.py) over the live replicas.
    A replica's `Loads` are summed over its requests when first asked, and kept until the
    replica steps or gets a request (`invalidate`)."""

    def __init__(self, replicas: Seq[VllmScheduler], clock: VirtualClock, sessions: dict[str, str]) -> None:
        self.replicas = replicas
        self.clock = clock
        self.sessions = sessions
        self.num_replicas = len(replicas)
        self.page_size = replicas[0].cache.page_size
        self._loads: list[Loads | None] = [None] * len(replicas)

    @property
    def now(self) -> float:
        return self.clock.now

    def waiting(self, i: int) -> int:
        return len(self.replicas[i].waiting)

    def running(self, i: int) -> int:
        return len(self.replicas[i].running)

    def requests(self, i: int) -> int:
        s = self.replicas[i]
        return len(s.waiting) + len(s.running)

    def outstanding_tokens(self, i: int) -> int:
        return self.loads(i).outstanding

    def prefill_tokens(self, i: int) -> int:
        return self.loads(i).prefill

    def active_pages(self, i: int) -> int:
        return self.loads(i).pages

    def loads(self, i: int) -> Loads:
        cached = self._loads[i]
        if cached is None:
            cached = self._loads[i] = self.replicas[i].loads()
        return cached

    def kv_usage(self, i: int) -> float:
        cache = self.replicas[i].cache
        return cache.pages_pinned() / cache.num_pages

    def session(self, request: RequestSpec) -> str | None:
        return self.sessions.get(request.request_id)

    def invalidate(self, i: int) -> None:
        self._loads[i] = None


class KvEventRelay:
    """Subscribed to one replica's cache for a router that `subscribes_kv_events`: passes
    each event on tagged with the replica (`Router.on_kv_event(replica, event)`), and
    times it, since it runs inside a cache call that the replica's `CacheClient` times:
    the driver moves that time from the cache's account to the router's."""

    __slots__ = ("router", "replica", "seconds")

    def __init__(self, router: Router, replica: int) -> None:
        self.router = router
        self.replica = replica
        self.seconds = 0.0

    def on_kv_event(self, event: KvEvent) -> None:
        t0 = CPU_CLOCK()
        self.router.on_kv_event(self.replica, event)
        self.seconds += CPU_CLOCK() - t0


def subscribe_router(router: Router, caches: Seq[PrefixCache]) -> list[KvEventRelay]:
    """Subscribe a router that `subscribes_kv_events` to every replica's cache (none for
    another router): first how the replica names its pages, then its events."""
    if not router.subscribes_kv_events:
        return []
    relays = []
    for i, cache in enumerate(caches):
        router.on_kv_subscribed(i, cache.page_keys())
        relay = KvEventRelay(router, i)
        cache.subscribe(relay)
        relays.append(relay)
    return relays


@dataclass
class ClusterResult:
    """Each replica's `ServingResult` (its records carry `replica`), every record of the
    cluster, when the last step ended, and what the router cost and counted."""

    replicas: list[ServingResult]
    router: str
    makespan: float = 0.0
    router_seconds: float = 0.0
    decisions: int = 0
    router_stats: dict[str, int] = field(default_factory=dict)

    @property
    def requests(self) -> list[dict[str, Any]]:
        return [rec for res in self.replicas for rec in res.requests]


class Cluster:
    """The event loop of the module docstring over `replicas` (schedulers on `clock`)."""

    def __init__(
        self, replicas: Seq[VllmScheduler], clock: ClusterClock, router: Router, requests: Seq[RequestSpec]
    ) -> None:
        self.replicas = replicas
        self.clock = clock
        self.router = router
        self.view = ReplicaView(replicas, clock, session_ids(requests))
        self.index_of = {s.request_id: i for i, s in enumerate(requests)}
        self.ends: list[tuple[float, int]] = []  # heap: (when its step ends, replica)
        self.busy = [False] * len(replicas)  # a step in flight (an entry in `ends`)
        self.last = [0.0] * len(replicas)  # when each replica last stepped or finished a step
        self.router_seconds = 0.0
        self.decisions = 0

    def run(self, bar: Any = None) -> None:
        while True:
            t = self.next_event()
            if t is None:
                return
            self.clock.now = t
            due = self.route_arrivals()
            while self.ends and self.ends[0][0] <= t:
                due.add(heapq.heappop(self.ends)[1])
            for i in sorted(due):
                self.busy[i] = False
            for i in sorted(due):
                self.step(i, t, due)
            if bar is not None:
                bar.update(sum(len(s.result.requests) for s in self.replicas) - bar.n)

    def next_event(self) -> float | None:
        """The earliest step end or scheduled arrival; None when neither is left."""
        times = [self.ends[0][0]] if self.ends else []
        arrival = self.clock.next_scheduled()
        if arrival is not None:
            times.append(arrival)
        return min(times) if times else None

    def route_arrivals(self) -> set[int]:
        """Route every arrival due by now; the idle replicas that got one."""
        woken: set[int] = set()
        for arrival, spec in self.clock.arrived():
            i = self.decide(spec)
            self.replicas[i].add(spec, arrival, self.index_of.get(spec.request_id, -1))
            self.view.invalidate(i)
            if not self.busy[i]:
                woken.add(i)
        return woken

    def decide(self, spec: RequestSpec) -> int:
        """The router's replica for `spec`, timed; an answer out of range is a `RouterError`."""
        t0 = CPU_CLOCK()
        i = self.router.route(spec, self.view)
        self.router_seconds += CPU_CLOCK() - t0
        self.decisions += 1
        n = len(self.replicas)
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < n:
            raise RouterError(
                f"router {self.router.name!r} returned {i!r} for request {spec.request_id!r} at "
                f"t={self.clock.now:.6f} s; a replica index is an int in 0..{n - 1}"
            )
        return int(i)

    def step(self, i: int, t: float, due: set[int]) -> None:
        """Replica `i` takes its step at `t` (if it has work): its end goes on the heap; a
        replica with nothing it can run waits for its next request."""
        s = self.replicas[i]
        if not s.has_work:
            return
        self.clock.now = t
        self.clock.horizon = self.horizon(i, t, due)
        end = s.step()
        self.clock.horizon = math.inf
        self.view.invalidate(i)
        self.last[i] = max(self.last[i], t if end is None else end)
        if end is not None:
            heapq.heappush(self.ends, (end, i))
            self.busy[i] = True

    def horizon(self, i: int, t: float, due: set[int]) -> float:
        """The earliest a turn could arrive that the clock does not hold yet: another
        replica finishes its predecessor at the end of its next step (after its current
        one ends, or after now for one still due at t), plus the shortest think time."""
        if self.clock.min_think == math.inf or len(self.replicas) == 1:
            return math.inf
        others = [e for e, j in self.ends if j != i]
        if any(j != i and not self.busy[j] for j in due):
            others.append(t)
        return (min(others) if others else math.inf) + self.clock.min_think


def serve_cluster(
    caches: Seq[PrefixCache | CacheClient],
    requests: Seq[RequestSpec],
    executors: Seq[Executor],
    router: Router,
    config: ServingConfig = DEFAULT_CONFIG,
    *,
    progress: bool = False,
    keep_outputs: bool = False,
) -> ClusterResult:
    """Serve `requests` on one replica per cache (each with the executor at its position),
    `router` choosing each request's replica; see the module docstring."""
    n = len(caches)
    clients = [c if isinstance(c, CacheClient) else CacheClient(c) for c in caches]
    _check_cluster([c.cache for c in clients], executors, router, config)
    share_storage([c.cache for c in clients])
    refuse_beams(requests)
    relays = subscribe_router(router, [c.cache for c in clients])
    clock = ClusterClock(requests)
    policy = scheduler_class(config)
    replicas = [policy(c, e, config, clock, keep_outputs=keep_outputs) for c, e in zip(clients, executors, strict=True)]
    cluster = Cluster(replicas, clock, router, requests)
    bar = progress_bar(len(requests), f"serve {n} x {clients[0].cache.name} ({router.name})") if progress else None
    cluster.run(bar)
    if bar is not None:
        bar.close()
    events_seconds = [r.seconds for r in relays] or [0.0] * n
    for i, (s, c) in enumerate(zip(replicas, clients, strict=True)):
        s.result.makespan = cluster.last[i]
        finish_transfers(s, s.result)
        s.result.cache_seconds = c.seconds - events_seconds[i]
        for rec in s.result.requests:
            rec["replica"] = i
    return ClusterResult(
        [s.result for s in replicas],
        router.name,
        makespan=max(cluster.last),
        router_seconds=cluster.router_seconds + sum(events_seconds),
        decisions=cluster.decisions,
        router_stats=router.stats(),
    )


def share_storage(caches: Seq[PrefixCache]) -> None:
    """Every replica whose storage tier is `shared` (radix-hicache `storage_backend=shared`,
    Mooncake Store semantics) reads and writes the first such replica's pool from now on:
    one L3 for the cluster, where a page one replica stored is a hit for every other. A
    `file` tier stays each replica's own local disk. Refused (before any work) when the
    replicas describe their shared pools differently."""
    pool = None
    for cache in caches:
        tier = cache.storage_tier if "storage" in cache.memory_tiers else None
        if tier is None or not tier.shared:
            continue
        if pool is None:
            pool = tier
        else:
            cache.use_storage_pool(pool)


def _check_cluster(caches: Seq[PrefixCache], executors: Seq[Executor], router: Router, config: ServingConfig) -> None:
    """Refuse a cluster that cannot run, before any work."""
    n = len(caches)
    if n < 1:
        raise ValueError("a cluster needs at least one replica")
    if len(executors) != n or router.num_replicas != n:
        raise ValueError(
            f"{n} caches, {len(executors)} executors and a router for {router.num_replicas} replicas: "
            "a cluster needs one of each per replica"
        )
    if config.async_scheduling and n > 1:
        raise ValueError(
            "async scheduling runs one replica's engine loop (serving.drive_async); a cluster of "
            f"{n} replicas runs the synchronous loop: drop --async-scheduling or use --replicas 1"
        )
    if len({c.page_size for c in caches}) > 1:
        raise ValueError("every replica of a cluster must have the same page size")
    silent = sorted({c.name for c in caches if not c.emits_kv_events})
    if router.subscribes_kv_events and silent:
        raise ValueError(
            f"router {router.name!r} needs KV events, which a {', '.join(silent)} cache does not publish "
            "(emits_kv_events is False): use a backend that does (apc, radix) or another router"
        )
