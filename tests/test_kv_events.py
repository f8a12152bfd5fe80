"""KV events (cachelib/kv_events.py): a listener that only counts "pages stored" minus
"pages removed" holds, after every call of a random operation sequence, exactly the pages
the cache has published and not evicted (cached or pinned), key for key; the keys are the
ones a router computes from the request (`PageKeys`); subscribing changes no decision; and
the backends that publish nothing say so."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from backends.radix_hicache_tree import on_device
from cachelib import (
    ExtraKeys,
    InvalidRequestError,
    PageKeys,
    PagesRemoved,
    PagesStored,
    Sequence,
    available_backends,
    create_cache,
    get_backend,
)
from cachelib.kv_events import DEVICE_MEDIUM, SGLANG_CPU_MEDIUM

EMITTING = ["apc", "radix", "radix-aged", "radix-hicache"]
EXTRAS = [ExtraKeys(), ExtraKeys(), ExtraKeys(cache_salt="t1"), ExtraKeys(lora_id=3)]


class Rebuilt:
    """A listener that rebuilds the cache's published pages from events alone, one multiset
    per medium (apc may hold two blocks under one hash; a tiered cache publishes its host
    tier as another medium), refusing a removal of a page it never heard of."""

    def __init__(self) -> None:
        self.tiers: dict[str, Counter[bytes]] = {DEVICE_MEDIUM: Counter()}
        self.events: list = []

    @property
    def pages(self) -> Counter[bytes]:
        """The device's pages."""
        return self.tiers[DEVICE_MEDIUM]

    def on_kv_event(self, event) -> None:
        self.events.append(event)
        pages = self.tiers.setdefault(event.medium, Counter())
        if isinstance(event, PagesStored):
            pages.update(event.keys)
            return
        assert isinstance(event, PagesRemoved)
        for key in event.keys:
            assert pages[key] > 0, "removed a page that was never stored"
            pages[key] -= 1
            if not pages[key]:
                del pages[key]


def published(cache, host: bool = False) -> Counter[bytes]:
    """The cache's published pages by key, read from its own structures (`host`: those of
    radix-hicache's host tier, else the device's)."""
    if cache.name == "apc":
        blocks = np.flatnonzero(cache.index.cached)
        return Counter(cache.index.digests(blocks))
    keys = cache.page_keys()
    out: Counter[bytes] = Counter()
    for node in cache.tree.nodes():
        if cache.name == "radix-hicache" and (node.host_pages is not None if host else on_device(node)) is False:
            continue
        tokens = np.concatenate([x.key for x in cache.tree.path(node)])
        salt, lora = node.namespace
        out.update(keys.keys(tokens, ExtraKeys(cache_salt=salt, lora_id=lora))[node.start // cache.page_size :])
    return out


class Driver:
    """Random calls in contract order over prompts that share prefixes: admissions (whole
    or a first chunk), further prefill chunks, decode tokens, forks, releases, evictions."""

    def __init__(self, cache, seed: int) -> None:
        self.cache = cache
        self.rng = np.random.default_rng(seed)
        ps = cache.page_size
        self.stems = [
            self.rng.integers(0, 50, size=int(self.rng.integers(1, 5)) * ps + int(self.rng.integers(ps)))
            for _ in range(4)
        ]
        self.live: list[Sequence] = []
        self.n = 0

    def prompt(self) -> np.ndarray:
        stem = self.stems[int(self.rng.integers(len(self.stems)))]
        cut = int(self.rng.integers(1, len(stem) + 1))
        tail = self.rng.integers(0, 50, size=int(self.rng.integers(1, 3 * self.cache.page_size + 2)))
        return np.concatenate([stem[:cut], tail]).astype(np.int32)

    def step(self) -> None:
        op = int(self.rng.integers(7))
        if op <= 1 or not self.live:
            self.admit()
        elif op == 2:
            self.advance(self.live[int(self.rng.integers(len(self.live)))])
        elif op == 3:
            self.fork(self.live[int(self.rng.integers(len(self.live)))])
        elif op == 4 or op == 5:
            self.cache.release(self.live.pop(int(self.rng.integers(len(self.live)))))
        else:
            self.cache.evict(int(self.rng.integers(0, 4)))

    def admit(self) -> None:
        self.n += 1
        seq = Sequence(f"r{self.n}", self.prompt(), EXTRAS[int(self.rng.integers(len(EXTRAS)))])
        seq.prompt_len = len(seq)
        m = self.cache.match(seq)
        lo = max(m.num_tokens, 1)
        n = len(seq) if self.rng.random() < 0.5 else int(self.rng.integers(lo, len(seq) + 1))
        if self.cache.admit(seq, m, n) is None:
            return
        self.cache.commit(seq, n)
        self.live.append(seq)

    def advance(self, seq: Sequence) -> None:
        """The next prefill chunk, or one decode token."""
        done = seq.num_computed
        if done < seq.prompt_len:
            n = int(self.rng.integers(done + 1, seq.prompt_len + 1))
        else:
            seq.append_token(int(self.rng.integers(0, 50)))
            n = len(seq)
        if self.cache.grow(seq, n) is None:
            self.live.remove(seq)
            self.cache.release(seq)
            return
        self.cache.commit(seq, n if done < seq.prompt_len else n - 1)

    def fork(self, parent: Sequence) -> None:
        self.n += 1
        child = parent.fork(f"r{self.n}")
        child.prompt_len = parent.prompt_len
        if self.cache.fork(parent, child) is not None:
            self.live.append(child)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", EMITTING)
def test_rebuilt_pages_equal_the_published_pages_after_every_call(backend, page_size):
    for seed in range(6):
        cache = create_cache(backend, num_pages=48 if page_size == 16 else 300, page_size=page_size)
        listener = Rebuilt()
        cache.subscribe(listener)
        driver = Driver(cache, seed)
        for _ in range(250):
            driver.step()
            assert listener.pages == published(cache)
        cache.check_invariants()  # radix also proves each node's keys are its prefix's
        assert any(isinstance(e, PagesRemoved) for e in listener.events), "the run never evicted"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
def test_radix_hicache_events_rebuild_both_tiers_after_every_call(write_policy, page_size):
    """SGLang's HiCache events: the GPU-medium events rebuild the device's pages, the
    CPU_PINNED ones the host's (a storage tier's prefetches among them), key for key."""
    gpu = 48 if page_size == 16 else 300
    for seed in range(4):
        cache = create_cache(
            "radix-hicache",
            num_pages=gpu,
            page_size=page_size,
            write_policy=write_policy,
            host_capacity_tokens=gpu // 2 * page_size,
            storage_backend="file",
            prefetch_threshold=0,
        )
        listener = Rebuilt()
        cache.subscribe(listener)
        driver = Driver(cache, seed)
        for _ in range(250):
            driver.step()
            assert listener.pages == published(cache)
            assert listener.tiers.get(SGLANG_CPU_MEDIUM, Counter()) == published(cache, host=True)
        cache.check_invariants()
        media = {(type(e).__name__, e.medium) for e in listener.events}
        assert ("PagesRemoved", DEVICE_MEDIUM) in media and ("PagesStored", SGLANG_CPU_MEDIUM) in media
        assert {m for _, m in media} == {DEVICE_MEDIUM, SGLANG_CPU_MEDIUM}


@pytest.mark.parametrize("backend", ["apc", "radix"])
def test_stored_keys_are_the_keys_a_router_computes(backend):
    """A whole prompt committed and released: the pages it published carry the keys
    `page_keys()` gives for its tokens and extra keys, chained through `parent`."""
    cache = create_cache(backend, num_pages=64, page_size=4)
    listener = Rebuilt()
    cache.subscribe(listener)
    extra = ExtraKeys(cache_salt="s", lora_id=1)
    tokens = np.arange(30, dtype=np.int32)
    seq = Sequence("a", tokens, extra)
    cache.admit(seq, cache.match(seq), 30)
    cache.commit(seq, 14)
    cache.commit(seq, 30)
    cache.release(seq)
    want = cache.page_keys().keys(tokens, extra)
    assert len(want) == 7
    stored = [e for e in listener.events if isinstance(e, PagesStored)]
    assert [k for e in stored for k in e.keys] == want
    assert stored[0].parent is None and stored[1].parent == stored[0].keys[-1]
    # another salt, another namespace: other keys for the same tokens
    assert set(cache.page_keys().keys(tokens, ExtraKeys(cache_salt="t"))).isdisjoint(want)


def test_apc_duplicates_are_stored_and_removed_once_each():
    """vLLM keeps a block recomputed while an equal one is cached, and emits both."""
    cache = create_cache("apc", num_pages=8, page_size=2)
    listener = Rebuilt()
    cache.subscribe(listener)
    a, b = Sequence("a", np.arange(5, dtype=np.int32)), Sequence("b", np.arange(5, dtype=np.int32))
    ma, mb = cache.match(a), cache.match(b)  # both miss: b recomputes a's blocks
    cache.admit(a, ma, 5)
    cache.admit(b, mb, 5)
    cache.commit(a, 5)
    cache.commit(b, 5)
    key0, key1 = cache.page_keys().keys(np.arange(5, dtype=np.int32), ExtraKeys())
    assert listener.pages == Counter({key0: 2, key1: 2})
    cache.release(a)
    cache.release(b)
    assert cache.evict(3) == 3
    assert listener.pages == published(cache) and sum(listener.pages.values()) == 1


@pytest.mark.parametrize("backend", EMITTING)
def test_a_listener_moves_no_decision(backend):
    """The same random calls with and without a listener: the same hits, pages and stats."""
    runs = []
    for listen in (False, True):
        cache = create_cache(backend, num_pages=40, page_size=4)
        if listen:
            cache.subscribe(Rebuilt())
        driver = Driver(cache, seed=7)
        trail = []
        for _ in range(400):
            driver.step()
            trail.append([(s.request_id, s.num_computed, list(s.page_table)) for s in driver.live])
        runs.append((trail, cache.stats()))
    assert runs[0] == runs[1]


def test_subscribing_late_or_to_a_silent_backend_is_refused():
    silent = [name for name in available_backends() if not get_backend(name).emits_kv_events]
    assert sorted(silent) == ["none", "paged"]
    for name in silent:
        with pytest.raises(InvalidRequestError, match="publishes no KV events"):
            create_cache(name, num_pages=8, page_size=4).subscribe(Rebuilt())
        with pytest.raises(InvalidRequestError, match="no page keys"):
            create_cache(name, num_pages=8, page_size=4).page_keys()
    for name in EMITTING:
        cache = create_cache(name, num_pages=8, page_size=4)
        seq = Sequence("a", np.arange(9, dtype=np.int32))
        cache.admit(seq, cache.match(seq), 9)
        cache.commit(seq, 9)
        with pytest.raises(InvalidRequestError, match="before it"):
            cache.subscribe(Rebuilt())


def test_two_listeners_hear_the_same_events():
    cache = create_cache("radix", num_pages=32, page_size=4)
    one, two = Rebuilt(), Rebuilt()
    cache.subscribe(one)
    cache.subscribe(two)
    driver = Driver(cache, seed=3)
    for _ in range(200):
        driver.step()
    assert one.events == two.events and one.pages == published(cache)


def test_page_keys_compare_by_scheme():
    assert (
        create_cache("apc", num_pages=8, page_size=16).page_keys()
        == create_cache("apc", num_pages=8, page_size=16).page_keys()
    )
    assert (
        create_cache("apc", num_pages=8, page_size=16).page_keys()
        != create_cache("apc", num_pages=8, page_size=8).page_keys()
    )
    assert create_cache("radix", num_pages=8, page_size=16).page_keys() == PageKeys(16, namespace_only=True)
    assert PageKeys(4).keys(np.arange(3, dtype=np.int32), ExtraKeys()) == []


def test_a_router_index_keeps_the_device_tier_only():
    """`KvIndex` (precise, kv_cost) scores GPU reuse: a radix-hicache replica's host-tier
    events leave it as the replica's device pages, and a host-only removal never breaks it."""
    from experiments.engine.routers.kv_index import KvIndex

    cache = create_cache("radix-hicache", num_pages=24, page_size=1, host_capacity_tokens=48)
    index = KvIndex(1)
    index.watch(0, cache.page_keys())

    class Relay:
        def on_kv_event(self, event) -> None:
            index.apply(0, event)

    listener = Rebuilt()
    cache.subscribe(Relay())
    cache.subscribe(listener)
    driver = Driver(cache, seed=3)
    for _ in range(200):
        driver.step()
        assert +index.pages[0] == published(cache)
    assert listener.tiers[SGLANG_CPU_MEDIUM], "the run stored nothing on the host"


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_apc_host_tier_events_rebuild_the_host_chunks(eviction):
    """vLLM's offloading connector: "CPU" events (a store per chunk at `complete_store`, a
    removal of the chunks `prepare_store` evicts) rebuild the host tier's chunks; the GPU
    events still rebuild the GPU's blocks."""
    for seed in range(4):
        cache = create_cache("apc", num_pages=40, page_size=4, host_capacity_tokens=64, host_eviction=eviction)
        listener = Rebuilt()
        cache.subscribe(listener)
        driver = Driver(cache, seed)
        for _ in range(250):
            driver.step()
            assert listener.pages == published(cache)
            assert listener.tiers.get("CPU", Counter()) == Counter(cache.host.cached_keys())
        assert any(isinstance(e, PagesRemoved) and e.medium == "CPU" for e in listener.events), "no host eviction"
