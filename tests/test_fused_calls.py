"""`prefill` and `grow_commit`, the contract's two fused calls, are the calls they fuse.

Two caches of each backend see the same requests: one through `prefill` / `grow_commit`,
the other through `match`, `admit`, `commit` / `grow`, `commit` one by one. Every call
returns the same (matches, copies, computed counts), and after every step the two agree
on their counters and occupancy (`stats()`), every live table, and, for a backend that
emits them, every KV event so far (each page published or evicted, in order); at the end
both are drained one page at a time and evict the same. Small caches, so admission fails
and eviction runs; prompts share prefixes, so hits and (tiered) load-backs happen. The
misuse of the fused calls is driven by the property tests (tests/test_properties.py
`_misuse_fused`).
"""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import InvalidRequestError, Sequence, available_backends, create_cache
from tests.snapshots import deep_state

PREFIXES = [np.arange(0, 24, dtype=np.int32), np.arange(100, 110, dtype=np.int32), np.arange(200, 237, dtype=np.int32)]


def _options(backend: str) -> dict:
    if backend == "radix-hicache":  # a host tier below a small device: demotions and load-backs
        return {"host_capacity_tokens": 160, "write_policy": "write_through"}
    if backend == "apc-lmcache":
        return {"lmcache_chunk_size": 8, "host_capacity_tokens": 160}
    return {}


def _prompt(rng: np.random.Generator, i: int) -> np.ndarray:
    head = PREFIXES[rng.integers(len(PREFIXES))][: rng.integers(4, 40)]
    return np.concatenate([head, np.arange(1000 + 50 * i, 1000 + 50 * i + rng.integers(1, 12), dtype=np.int32)])


class Recorder:
    """A KV-event listener that keeps every event."""

    def __init__(self) -> None:
        self.events: list = []

    def on_kv_event(self, event) -> None:
        self.events.append(event)


def _fields(m) -> tuple:
    """A match as a value: its handle (a node, blocks) by what it shows."""
    return m.request_id, m.num_tokens, m.pages, m.epoch, repr(m.handle)


def _picture(cache, live: list[Sequence], heard: Recorder) -> tuple:
    tables = [(s.request_id, list(s.page_table), s.num_computed) for s in live]
    return cache.stats(), tables, heard.events


def _same(pair, live, step: str) -> None:
    (fused, heard), (apart, heard2) = pair
    a = _picture(fused, [s for s, _ in live], heard)
    b = _picture(apart, [t for _, t in live], heard2)
    assert a == b, f"{step}: {a} != {b}"


@pytest.mark.parametrize("backend", available_backends())
def test_the_fused_calls_are_the_calls_one_by_one(backend):
    fused, apart = (create_cache(backend, num_pages=24, page_size=4, **_options(backend)) for _ in range(2))
    heard, heard2 = Recorder(), Recorder()
    if fused.emits_kv_events:
        fused.subscribe(heard)
        apart.subscribe(heard2)
    pair = ((fused, heard), (apart, heard2))
    rng = np.random.default_rng(7)
    live: list[tuple[Sequence, Sequence]] = []
    admitted = refused = hits = loaded = 0
    for i in range(60):
        tokens = _prompt(rng, i)
        s, t = Sequence(f"r{i}", tokens), Sequence(f"r{i}", tokens)
        m, ops, computed = fused.prefill(s)
        m2 = apart.match(t)
        ops2 = apart.admit(t, m2, len(t))
        computed2 = t.num_computed
        if ops2 is not None:
            apart.commit(t, len(t))
        assert _fields(m) == _fields(m2) and ops == ops2 and (computed == computed2 or ops is None)
        _same(pair, live, f"prefill of r{i}")
        if ops is None:
            refused += 1
            if live:  # finish the oldest, as the replay makes room
                old, old2 = live.pop(0)
                fused.release(old)
                apart.release(old2)
            continue
        admitted += 1
        hits += m.num_tokens > 0
        loaded += computed > m.num_tokens  # a tiered cache loaded more back from its host
        live.append((s, t))
        for _ in range(rng.integers(0, 3)):  # decode runs of a few tokens, KV written at once
            run = rng.integers(1, 7)
            new = np.arange(5000 + 10 * i, 5000 + 10 * i + run, dtype=np.int32)
            s.append(new)
            t.append(new)
            ops = fused.grow_commit(s, len(s) - 1)
            ops2 = apart.grow(t, len(t) - 1)
            if ops2 is not None:
                apart.commit(t, len(t) - 1)
            assert ops == ops2
            _same(pair, live, f"grow_commit of r{i}")
            if ops is None:
                break
        if len(live) > 3:
            old, old2 = live.pop(0)
            fused.release(old)
            apart.release(old2)
            _same(pair, live, f"release of {old.request_id}")
        fused.check_invariants()
    assert admitted > 20 and refused > 0
    assert hits > 5 or not fused.reuses_kv or fused.declares_prefixes  # paged reuses declared prefixes only
    assert loaded > 0 or len(fused.memory_tiers) == 1
    for s, t in live:
        fused.release(s)
        apart.release(t)
    while True:  # the same pages cached, evicted in the same order
        freed = fused.evict(1)
        assert freed == apart.evict(1)
        _same(pair, [], "draining")
        if not freed:
            break
    assert heard.events or not fused.emits_kv_events


def test_a_refused_fused_call_changes_nothing():
    """`prefill` of a live sequence is refused before its lookup (which refreshes
    recency), and `grow_commit` below the computed count before its grow."""
    cache = create_cache("radix", num_pages=24, page_size=4)
    s = Sequence("a", np.arange(20, dtype=np.int32))
    cache.prefill(s)
    s.append(np.arange(100, 104, dtype=np.int32))
    before = deep_state((cache, s))
    with pytest.raises(InvalidRequestError, match="already admitted"):
        cache.prefill(s)
    with pytest.raises(InvalidRequestError, match="outside"):
        cache.grow_commit(s, s.num_computed - 1)
    with pytest.raises(InvalidRequestError, match="num_tokens must be an int"):
        cache.grow_commit(s, 22.0)
    assert deep_state((cache, s)) == before
