"""The host tier's eviction policies (backends/apc_offload.py, rules R7 and R8) decide
exactly as the naive models in tests/reference/vllm_offload_policies.py: both are driven
by the same random calls (stores, first accesses, pins, finishes, evictions with protected
chunks, refusals) and must evict the same chunks in the same order, refuse the same
evictions and keep the same eviction order throughout. Small key pools make chunks shared
between requests, re-ranked and re-inserted after eviction often."""

from __future__ import annotations

import random

import pytest

from backends.apc_offload import _Chunk, _LruPolicy, _Request
from cachelib.errors import InvariantViolation
from tests.reference.vllm_offload_policies import NaiveLru

P = 16


def fail(msg: str) -> None:
    raise InvariantViolation(msg)


class _Driver:
    """Random calls, in the order OffloadTier makes them, on the policy and the model."""

    def __init__(self, seed: int, pool: int) -> None:
        self.rng = random.Random(seed)
        self.pool = [bytes([i % 256, i // 256]) for i in range(pool)]
        self.policy = _LruPolicy(capacity=pool)
        self.model = NaiveLru()
        self.requests: dict[str, tuple[_Request, list[bytes]]] = {}
        self.next_id = 0
        self.evictions = self.refusals = 0

    def start(self) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        keys = self.rng.sample(self.pool, self.rng.randint(1, min(12, len(self.pool))))
        req = _Request()
        req.keys = keys
        req.positions = {k: (i + 1) * P for i, k in enumerate(keys)}
        self.requests[rid] = (req, keys)

    def access(self, rid: str, keys: list[bytes]) -> None:
        req, _ = self.requests[rid]
        new = [k for k in keys if k not in req.seen]
        req.seen.update(new)
        req.seen_order.extend(new)
        if new:
            self.policy.on_request_access(new, req)
            self.model.access([(k, req.positions[k]) for k in new], rid)

    def store(self, rid: str) -> None:
        req, keys = self.requests[rid]
        missing = [k for k in keys if self.policy.get(k) is None]
        if not missing:
            return
        offered = missing[: self.rng.randint(1, len(missing))]
        self.access(rid, offered)
        for key in offered:
            chunk = _Chunk(0)
            if self.rng.random() < 0.2:
                chunk.ref_cnt = 0  # inserted ready (evictable at once)
            self.policy.insert(key, chunk, req)
            self.model.insert(key, rid, req.positions[key], pinned=chunk.ref_cnt != 0)
        for key in offered:  # complete_store
            chunk = self.policy.get(key)
            if chunk.ref_cnt == -1:
                chunk.ref_cnt = 0
                self.policy.mark_evictable(key)
                self.model.pinned.discard(key)

    def pin_and_unpin(self, rid: str) -> None:
        """A load: pin the cached chunks of the request (first access), then unpin them."""
        req, keys = self.requests[rid]
        loaded = [k for k in keys if (c := self.policy.get(k)) is not None and c.ref_cnt >= 0]
        for key in loaded:
            chunk = self.policy.get(key)
            if chunk.ref_cnt == 0:
                self.policy.mark_non_evictable(key)
                self.model.pinned.add(key)
            chunk.ref_cnt += 1
        self.access(rid, loaded)
        if self.rng.random() < 0.5:
            self.evict()  # an eviction while the load is in flight
        for key in loaded:
            chunk = self.policy.get(key)
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self.policy.mark_evictable(key)
                self.model.pinned.discard(key)

    def finish(self, rid: str) -> None:
        req, _ = self.requests.pop(rid)
        ordered = sorted(req.seen_order, key=req.positions.__getitem__)
        self.policy.on_request_finished(ordered, req.inserted - req.reused, req.reused)
        self.model.finish(ordered)

    def evict(self) -> None:
        cached = list(self.policy.chunks)
        protected = set(self.rng.sample(cached, self.rng.randint(0, len(cached)))) if cached else set()
        protected.update(self.rng.sample(self.pool, 2))  # keys not cached are protected too
        n = self.rng.randint(0, max(1, len(cached) // 2 + 1))
        got = self.policy.evict(n, protected)
        want = self.model.evict(n, protected)
        assert (None if got is None else [k for k, _ in got]) == want
        if got is None:
            self.refusals += 1
        elif got:
            self.evictions += 1

    def step(self) -> None:
        op = self.rng.random()
        if not self.requests or op < 0.15:
            self.start()
            return
        rid = self.rng.choice(sorted(self.requests))
        if op < 0.45:
            self.store(rid)
        elif op < 0.55:
            self.pin_and_unpin(rid)
        elif op < 0.65:
            req, keys = self.requests[rid]
            self.access(rid, self.rng.sample(keys, self.rng.randint(1, len(keys))))
        elif op < 0.8:
            self.finish(rid)
        else:
            self.evict()


@pytest.mark.parametrize("seed", range(40))
def test_lru_evicts_as_the_naive_model(seed):
    d = _Driver(seed, pool=[6, 20, 60][seed % 3])
    for i in range(600):
        d.step()
        assert d.policy.order() == d.model.order()
        if i % 50 == 0:
            d.policy.check(fail)
    d.policy.check(fail)
    assert d.evictions > 5 and d.refusals > 0  # the run reached both outcomes


def test_lru_heap_compacts_without_changing_the_order():
    """Re-ranking every chunk many times fills the heap with stale entries; the compaction
    inside `evict` must keep every live one."""
    d = _Driver(7, pool=200)
    for _ in range(30):
        d.start()
    for rid in sorted(d.requests):
        d.store(rid)
    for _ in range(20):
        for rid in sorted(d.requests):
            d.finish(rid)
        for _ in range(30):
            d.start()
        for rid in sorted(d.requests):
            d.access(rid, d.requests[rid][1])
    assert len(d.policy.heap) > 2 * len(d.policy.evictable)
    d.evict()
    d.policy.check(fail)
    assert d.policy.order() == d.model.order()
