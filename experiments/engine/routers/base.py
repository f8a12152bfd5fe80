"""The router contract: `Router.route(request, view) -> replica index`, and `ClusterView`,
what a router may read about the replicas.

A real router sees the request (its tokens: the prompt), what each replica reports or what
it counts itself (requests in flight, queue length, tokens still to compute, KV usage), the
time, and headers the client sends (a session id). It does not see inside a replica's
cache. `ClusterView` is exactly that; the cluster driver (experiments/engine/cluster.py)
implements it over the live replicas, and `StaticView` is a fixed one for hand-made cases.

Capabilities are declared, never probed: a router that needs more than the view declares it
as a class attribute (`subscribes_kv_events`), and the driver refuses what it cannot give.
A subscribing router hears each replica's KV events ("pages stored", "pages removed",
cachelib/kv_events.py) through `on_kv_event(replica, event)`, as llm-d's and Dynamo's
routers subscribe to every vLLM instance's event stream, and is told first how each
replica names its pages (`on_kv_subscribed`: the backend's hashing, which a real router is
configured with).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from cachelib.kv_events import KvEvent, PageKeys
from experiments.workloads.spec import RequestSpec


class RouterError(RuntimeError):
    """A router broke the contract during a run (a replica index out of range): a bug in the
    router, raised at the step it happens, naming the router and the request."""


class ClusterView(Protocol):
    """What a router can see, per replica `i` in `range(num_replicas)`.

    - `waiting(i)`: requests queued at replica i, not yet admitted (or preempted back);
    - `running(i)`: requests in its running batch;
    - `requests(i)`: `waiting(i) + running(i)`, the requests sent to it and not finished:
      what a router counts itself (SGLang's `worker.load()`);
    - `outstanding_tokens(i)`: work left at replica i, in tokens: for each of its requests,
      the prompt tokens whose KV is not computed yet (a waiting request's whole prompt: a
      router cannot know its prefix hit) plus the output tokens it has still to generate;
    - `kv_usage(i)`: pages pinned by live requests / pages of its cache (vLLM's
      `kv_cache_usage`), in [0, 1];
    - `prefill_tokens(i)`: the prompt tokens of its requests whose KV is not computed yet
      (a waiting request's whole prompt): the prefill work queued there, what Dynamo's
      router tracks per worker from routing a request until its prefill completes;
    - `active_pages(i)`: the full pages of its requests' prompts (`prompt // page_size`
      each), from routing until the request finishes: Dynamo's "active blocks" of a
      worker (by default its router counts prompt blocks, not output ones);
    - `session(request)`: the session id the request's client sends (a conversation's first
      request id; None outside a conversation, see `engine.cluster.session_ids`);
    - `now`: the time of the decision (seconds, the run's clock); `page_size`: the replicas'
      KV page size (configuration, as Dynamo's `kv_block_size`).
    """

    num_replicas: int
    page_size: int

    @property
    def now(self) -> float: ...

    def waiting(self, i: int) -> int: ...

    def running(self, i: int) -> int: ...

    def requests(self, i: int) -> int: ...

    def outstanding_tokens(self, i: int) -> int: ...

    def kv_usage(self, i: int) -> float: ...

    def prefill_tokens(self, i: int) -> int: ...

    def active_pages(self, i: int) -> int: ...

    def session(self, request: RequestSpec) -> str | None: ...


class Router(ABC):
    """Picks the replica of each arriving request.

    `__init__(num_replicas, **options)`: the options are the constructor's keyword
    parameters after `num_replicas` (`--router-opt KEY=VALUE`, typed from the annotations by
    experiments/engine/routers/registry.py); a value the router cannot work with is refused there
    with `ValueError`, before any work. `route` is called once per request, in arrival
    order (ties in trace order), before the request joins the replica it returns; it must
    return an int in `range(num_replicas)`."""

    #: registry name (`--router NAME`)
    name: ClassVar[str] = "abstract"
    #: True when the router needs the replicas' KV events ("pages stored", "pages removed",
    #: as vLLM's `BlockStored` / `BlockRemoved`) through `on_kv_event`: the driver subscribes
    #: it to every replica's cache, and refuses it before any work over a backend that
    #: publishes none (`PrefixCache.emits_kv_events`)
    subscribes_kv_events: ClassVar[bool] = False

    def __init__(self, num_replicas: int) -> None:
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas!r}")
        self.num_replicas = num_replicas
        self.counters: dict[str, int] = {}  # decisions by branch, for the results (`stats`)

    @abstractmethod
    def route(self, request: RequestSpec, view: ClusterView) -> int:
        """The replica `request` goes to."""

    def on_kv_subscribed(self, replica: int, page_keys: PageKeys) -> None:
        """The driver subscribed this router to `replica`'s cache, whose events name pages
        by `page_keys` (called once per replica, before any event and any `route`)."""
        raise NotImplementedError(f"router {self.name!r} does not subscribe to KV events")

    def on_kv_event(self, replica: int, event: KvEvent) -> None:
        """A KV event of `replica`'s cache, as it happens (only for routers that
        `subscribes_kv_events`)."""
        raise NotImplementedError(f"router {self.name!r} does not subscribe to KV events")

    def stats(self) -> dict[str, int]:
        """What the router counted (decisions per branch, fallbacks), for the results."""
        return dict(self.counters)

    def count(self, branch: str) -> None:
        self.counters[branch] = self.counters.get(branch, 0) + 1


@dataclass
class StaticView:
    """A `ClusterView` with fixed numbers, for hand-made cases (tests, examples). `loads`
    gives `requests(i)` directly when `waiting`/`running` are not given."""

    num_replicas: int
    waiting_counts: list[int] = field(default_factory=list)
    running_counts: list[int] = field(default_factory=list)
    outstanding: list[int] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    sessions: dict[str, str] = field(default_factory=dict)
    page_size: int = 16
    time: float = 0.0

    def __post_init__(self) -> None:
        n = self.num_replicas
        self.waiting_counts = self.waiting_counts or [0] * n
        self.running_counts = self.running_counts or [0] * n
        self.outstanding = self.outstanding or [0] * n
        self.usage = self.usage or [0.0] * n
        self.prefill = self.prefill or [0] * n
        self.pages = self.pages or [0] * n
        for what in ("waiting_counts", "running_counts", "outstanding", "usage", "prefill", "pages"):
            if len(getattr(self, what)) != n:
                raise ValueError(f"StaticView.{what} needs {n} entries")

    @property
    def now(self) -> float:
        return self.time

    def waiting(self, i: int) -> int:
        return self.waiting_counts[i]

    def running(self, i: int) -> int:
        return self.running_counts[i]

    def requests(self, i: int) -> int:
        return self.waiting_counts[i] + self.running_counts[i]

    def outstanding_tokens(self, i: int) -> int:
        return self.outstanding[i]

    def kv_usage(self, i: int) -> float:
        return self.usage[i]

    def prefill_tokens(self, i: int) -> int:
        return self.prefill[i]

    def active_pages(self, i: int) -> int:
        return self.pages[i]

    def session(self, request: RequestSpec) -> str | None:
        return self.sessions.get(request.request_id)
