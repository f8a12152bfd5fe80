"""Routers that keep related requests together without looking at any cache: `consistent_hash`
(a prefix key on a hash ring, with bounded loads) and `session` (a conversation stays where
it started).
"""

from __future__ import annotations

import bisect
import hashlib
import math

import numpy as np

from experiments.engine.routers.base import ClusterView, Router
from experiments.engine.routers.load import least_loaded
from experiments.workloads.spec import RequestSpec


def hash64(data: bytes) -> int:
    """A stable 64-bit hash (BLAKE2b): the same on every run and machine, unlike `hash()`."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class ConsistentHash(Router):
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent
    Hashing with Bounded Loads", SODA 2018) on a prefix key.

    The key is the first `prefix_pages` pages of the prompt (`prefix_pages * page_size`
    tokens, the whole prompt when shorter), hashed onto a ring where each replica has
    `virtual_nodes` points. With `m` requests in flight in the cluster counting this one
    (`ClusterView.requests`), a replica may hold at most `ceil(load_factor * m / n)`:
    walking the ring clockwise from the key, the first replica with fewer than that many
    takes the request. `load_factor` is the paper's `c`; it must be >= 1, so some replica
    always has room. Defaults as SGLang's `prefix_hash` policy (sgl-model-gateway,
    `src/policies/prefix_hash.rs`: 256 prefix tokens, load factor 1.25), which bounds the
    load the same way but takes the least loaded replica under the bound instead of walking
    the ring; HAProxy's `hash-balance-factor` walks it, as the paper does and as here.
    `counters`: `home` (the key's own replica), `spill` (a later one on the ring)."""

    name = "consistent_hash"

    def __init__(
        self, num_replicas: int, prefix_pages: int = 16, load_factor: float = 1.25, virtual_nodes: int = 100
    ) -> None:
        super().__init__(num_replicas)
        if prefix_pages < 1 or virtual_nodes < 1:
            raise ValueError(f"prefix_pages and virtual_nodes must be >= 1, got {prefix_pages}, {virtual_nodes}")
        if not load_factor >= 1.0 or math.isinf(load_factor):
            raise ValueError(
                f"load_factor (c) must be a finite number >= 1 so that a replica has room, got {load_factor}"
            )
        self.prefix_pages = prefix_pages
        self.load_factor = load_factor
        ring = sorted(
            (hash64(f"replica-{i}-{v}".encode()), i) for i in range(num_replicas) for v in range(virtual_nodes)
        )
        self.points = [p for p, _ in ring]
        self.owners = [i for _, i in ring]

    def key(self, request: RequestSpec, page_size: int) -> int:
        """The hash of the request's first `prefix_pages` pages of tokens."""
        head = np.asarray(request.prompt[: self.prefix_pages * page_size], dtype=np.int64)
        return hash64(head.tobytes())

    def capacity(self, view: ClusterView) -> int:
        """Requests a replica may hold once this one is placed: ceil(c * m / n)."""
        m = sum(view.requests(i) for i in range(self.num_replicas)) + 1
        return math.ceil(self.load_factor * m / self.num_replicas)

    def route(self, request: RequestSpec, view: ClusterView) -> int:
        cap = self.capacity(view)
        start = bisect.bisect_right(self.points, self.key(request, view.page_size))
        tried: set[int] = set()
        for k in range(len(self.points)):
            i = self.owners[(start + k) % len(self.points)]
            if i in tried:
                continue
            if view.requests(i) < cap:
                self.count("home" if not tried else "spill")
                return i
            tried.add(i)
        raise AssertionError("no replica under the bound: impossible with load_factor >= 1")


class Session(Router):
    """Session affinity: every request of a session goes where its session's first request
    went, as llm-d's session-affinity scorer sends a session back to the pod that served it
    (and vLLM's production-stack `session` router keeps a session on one engine). The
    session id is what the client sends (`ClusterView.session`: in this project the first
    request id of a conversation, linked by `RequestSpec.after`). A session's first request,
    and any request without a session (a trace with no conversations: Mooncake's), goes to
    the replica with the fewest outstanding tokens, as `least_load`. `counters`: `sticky`,
    `new_session`, `no_session` (so a run says how often it fell back)."""

    name = "session"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self.home: dict[str, int] = {}

    def route(self, request: RequestSpec, view: ClusterView) -> int:
        session = view.session(request)
        if session is None:
            self.count("no_session")
            return least_loaded(view)
        home = self.home.get(session)
        if home is not None:
            self.count("sticky")
            return home
        self.count("new_session")
        home = self.home[session] = least_loaded(view)
        return home
