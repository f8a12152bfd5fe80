"""`can_admit(seq, m, n)`: the read-only "would `admit(seq, m, n)` fit now?" query.

A scheduler asks it for an admission rule stricter than the allocation it makes (vLLM V1
admits a waiting request only if its whole prompt fits, then allocates the first chunk).
Checked here for every backend and the radix variants, under random operation sequences
with memory pressure:

- it leaves the cache and the sequence exactly as they were (`deep_state`: every object,
  order and count; so no eviction, no recency refresh, no counter);
- its answer is `admit`'s, for every `num_tokens` in `[max(hit, 1), len(seq)]` (each one
  tried on a deep copy of the cache, and one on the cache itself), and both answers occur;
- a misused call (stale, foreign or forged match, `num_tokens` out of range or of the
  wrong type, an already admitted sequence) raises exactly what `admit` raises, changing
  nothing.
"""

from __future__ import annotations

import copy
import math
import random
from collections import Counter
from contextlib import contextmanager

import pytest

from backends.radix_policy import EVICTION_POLICIES
from cachelib import (
    CacheError,
    ExtraKeys,
    InvalidRequestError,
    PrefixCache,
    Sequence,
    StaleMatchError,
    available_backends,
    create_cache,
    get_backend,
)
from tests.snapshots import deep_state, first_difference

#: (backend, options): every registered backend, and the radix variants that change admission
#: (the eviction policy changes which pages are evictable once locks move)
CONFIGS = [
    ("none", {}),
    ("apc", {}),
    ("apc", {"verify_tokens": True}),
    *[("radix", {"eviction_policy": p}) for p in EVICTION_POLICIES],
    ("radix", {"admission_eviction": "extend"}),
    ("radix", {"reserve_page": False}),
    ("radix-aged", {}),
    ("radix-aged", {"half_life": math.inf, "cost_context": None}),
    ("paged", {}),
]
CONFIGS += [(b, {}) for b in available_backends() if b not in {c[0] for c in CONFIGS}]
CONFIG_IDS = [b + "".join(f"-{k}={v}" for k, v in o.items()) for b, o in CONFIGS]
#: stale matches can only happen where something bumps the epoch (eviction, unregistration)
CAN_GO_STALE = {"apc", "radix", "radix-aged", "paged"}
SALTED = ExtraKeys(cache_salt="t")
OPS = ["probe", "later", "old", "release", "decode", "evict", "flush", "redeclare"]
WEIGHTS = [6, 3, 2, 3, 2, 2, 2, 1]


@contextmanager
def unchanged(*objs):
    """The block must leave every object (a cache, sequences) exactly as it found it."""
    before = deep_state(objs)
    yield
    after = deep_state(objs)
    assert after == before, first_difference(before, after)


def _admits_in_a_copy(cache: PrefixCache, seq: Sequence, m, k: int) -> bool:
    """What `admit(seq, m, k)` does to a deep copy of the cache (the match and the sequence
    copied along, so the match names the copy's own nodes and blocks)."""
    twin, twin_seq, twin_m = copy.deepcopy((cache, seq, m))
    ops = twin.admit(twin_seq, twin_m, k)
    twin.check_invariants()
    return ops is not None


class Driver:
    """Random match / can_admit / admit / commit / grow / release / evict steps on one cache,
    in a pool small enough that admissions often do not fit."""

    def __init__(self, backend: str, options: dict, page_size: int, num_pages: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.backend = backend
        self.ps = page_size
        self.cache = create_cache(backend, num_pages=num_pages, page_size=page_size, **options)
        self.live: list[Sequence] = []
        self.pending: list = []  # (sequence, match) made some steps ago
        self.history: list[list[int]] = []  # token lists seen: later prompts extend them (hits)
        self.counter = 0
        self.seen: Counter = Counter()
        self.prefixes: dict[tuple, int] = {}  # paged: declared prefix tokens -> id
        #: shared documents many prompts start with (declared prefixes on paged)
        self.docs = [[self.rng.randrange(50) for _ in range(n)] for n in (2 * page_size + 1, 3 * page_size)]
        if backend == "paged":
            for doc in self.docs:
                self._declare(doc)

    def _declare(self, tokens: list[int]) -> None:
        pid = self.cache.register_prefix(tokens)
        if pid is not None:
            self.cache.commit(self.cache.prefix_sequence(pid), len(tokens))
            self.prefixes[tuple(tokens)] = pid

    def new_seq(self, reuse: float = 0.5) -> Sequence:
        """A prompt: often the start of an earlier sequence (`reuse`: how often) or a
        shared document, then a few new tokens."""
        rng = self.rng
        self.counter += 1
        base: list[int] = []
        if self.history and rng.random() < reuse:
            old = rng.choice(self.history)
            base = old[: rng.choice([len(old), rng.randint(1, len(old))])]
        elif rng.random() < 0.6:
            base = list(rng.choice(self.docs))
        tokens = base + [rng.randrange(50) for _ in range(rng.randint(1, 2 * self.ps))]
        extra = SALTED if self.backend != "paged" and rng.random() < 0.15 else ExtraKeys()
        pid = None
        for p, i in self.prefixes.items():
            if tokens[: len(p)] == list(p):
                pid = i
        return Sequence(f"r{self.counter}", tokens, extra, prefix_id=pid)

    # -- the check ----------------------------------------------------------------------

    def probe(self, seq: Sequence, m) -> None:
        """can_admit for several k changes nothing and agrees with admit; then admit one."""
        cache, rng = self.cache, self.rng
        lo = max(m.num_tokens, 1)
        hit = "hit" if m.num_tokens else "miss"
        ks = sorted({lo, len(seq), *(rng.randint(lo, len(seq)) for _ in range(3))})
        with unchanged(cache, seq):
            answers = {k: cache.can_admit(seq, m, k) for k in ks}
            answers_again = {k: cache.can_admit(seq, m, k) for k in ks}
        assert answers == answers_again
        for k, fits in answers.items():
            assert fits is True or fits is False, f"can_admit returned {fits!r}, not a bool"
            assert _admits_in_a_copy(cache, seq, m, k) == fits, f"k={k}: can_admit says {fits}, admit disagrees"
            self.seen["fits" if fits else "does not fit"] += 1
            self.seen[f"{hit}, {'fits' if fits else 'does not fit'}"] += 1
        k = rng.choice(ks)
        before = deep_state((cache, seq))
        ops = cache.admit(seq, m, k)
        assert (ops is not None) == answers[k]
        if ops is None:
            assert deep_state((cache, seq)) == before, "a refused admit changed state"
            return
        cache.commit(seq, k)
        self.live.append(seq)
        if k < len(seq) and rng.random() < 0.5:  # the rest of a chunked prefill
            if cache.grow(seq, len(seq)) is not None:
                cache.commit(seq, len(seq))

    def probe_old(self) -> None:
        """A match made steps ago: both calls raise the same error, or agree."""
        seq, m = self.pending.pop(self.rng.randrange(len(self.pending)))
        try:
            with unchanged(self.cache, seq):
                self.cache.can_admit(seq, m, len(seq))
        except StaleMatchError as exc:
            with unchanged(self.cache, seq), pytest.raises(StaleMatchError) as again:
                self.cache.admit(seq, m, len(seq))
            assert str(again.value) == str(exc)
            self.seen["stale"] += 1
            return
        self.probe(seq, m)

    # -- the other operations -------------------------------------------------------------

    def release(self, seq: Sequence) -> None:
        self.cache.release(seq)
        self.live.remove(seq)
        self.history.append(seq.tokens.tolist()[: seq.num_computed or 1])
        del self.history[:-8]

    def decode(self, seq: Sequence) -> None:
        if seq.num_computed < len(seq):
            return  # an earlier grow did not fit
        for _ in range(self.rng.randint(1, 2 * self.ps)):
            seq.append_token(self.rng.randrange(50))
            if self.cache.grow(seq, len(seq)) is None:
                return
            self.cache.commit(seq, len(seq))

    def step(self) -> None:
        rng, cache = self.rng, self.cache
        op = rng.choices(OPS, WEIGHTS)[0]
        if op == "probe" or (op == "old" and not self.pending):
            seq = self.new_seq()
            self.probe(seq, cache.match(seq))
        elif op == "later":
            seq = self.new_seq(reuse=0.95)
            self.pending.append((seq, cache.match(seq)))
            del self.pending[:-4]
        elif op == "old":
            self.probe_old()
        elif op == "release" and self.live:
            self.release(rng.choice(self.live))
        elif op == "decode" and self.live:
            self.decode(rng.choice(self.live))
        elif op == "evict":
            cache.evict(rng.randint(0, 4))
        elif op == "flush":  # every unpinned cached page (after an idle spell, every page)
            while self.live and rng.random() < 0.5:
                self.release(self.live[0])
            cache.evict(cache.num_pages)
        elif op == "redeclare" and self.prefixes:  # paged: matches naming it go stale
            tokens = rng.choice(sorted(self.prefixes))
            cache.unregister_prefix(self.prefixes.pop(tokens))
            self._declare(list(tokens))
        cache.check_invariants()


@pytest.mark.parametrize("page_size, num_pages", [(1, 24), (4, 12)])
@pytest.mark.parametrize("backend, options", CONFIGS, ids=CONFIG_IDS)
def test_can_admit_is_read_only_and_agrees_with_admit(backend, options, page_size, num_pages):
    seen: Counter = Counter()
    for seed in range(3):
        d = Driver(backend, options, page_size, num_pages, seed)
        for _ in range(150):
            d.step()
        seen += d.seen
    # memory pressure makes both answers common, with a hit and without: the test cannot
    # pass vacuously
    assert seen["miss, fits"] >= 20 and seen["miss, does not fit"] >= 20, dict(seen)
    if get_backend(backend).reuses_kv:
        assert seen["hit, fits"] >= 20 and seen["hit, does not fit"] >= 10, dict(seen)
    if backend in CAN_GO_STALE:
        assert seen["stale"] >= 1, dict(seen)


# -- the vLLM V1 rule, spelled out on apc -------------------------------------------------


def test_apc_whole_prompt_rule_counts_hit_blocks_waiting_in_the_free_queue():
    """4 blocks: a 3-block prefix cached and unreferenced (in the free queue), 1 free. A
    5-block prompt hitting the prefix needs 2 new blocks; the 3 hit blocks leave the queue,
    so only 1 is free for it: the whole prompt does not fit, its first chunk does."""
    cache = create_cache("apc", num_pages=4, page_size=4)
    prefix = list(range(1, 13))
    warm = Sequence("warm", prefix + [99])
    assert cache.admit(warm, cache.match(warm), len(warm)) is not None
    cache.commit(warm, len(warm))
    cache.release(warm)
    seq = Sequence("s", prefix + list(range(20, 28)))
    m = cache.match(seq)
    assert m.num_tokens == 12
    with unchanged(cache, seq):
        assert cache.can_admit(seq, m, len(seq)) is False  # 2 new > 4 free - 3 hit in the queue
        assert cache.can_admit(seq, m, 16) is True  # the first chunk: 1 new block
        assert cache.can_admit(seq, m, 12) is True
    assert cache.stats().lookups == 2 and cache.stats().admitted == 1
    assert cache.admit(seq, m, 16) is not None


# -- misuse: the same error as admit, nothing changed --------------------------------------


def _warm(backend: str, options: dict) -> tuple[PrefixCache, Sequence]:
    """A cache holding a 3-page prefix (cached, or declared on paged) and a sequence that
    starts with it."""
    cache = create_cache(backend, num_pages=16, page_size=4, **options)
    prefix = list(range(100, 112))
    pid = None
    if backend == "paged":
        pid = cache.register_prefix(prefix)
        cache.commit(cache.prefix_sequence(pid), len(prefix))
    else:
        w = Sequence("warm", prefix + [1, 2])
        assert cache.admit(w, cache.match(w), len(w)) is not None
        cache.commit(w, len(w))
        cache.release(w)
    return cache, Sequence("s", prefix + [7, 8, 9], prefix_id=pid)


def _same_refusal(cache: PrefixCache, seq: Sequence, m, k, error: type[CacheError] = CacheError) -> CacheError:
    """`can_admit` and `admit` both raise `error`, of the same type and message, changing nothing."""
    with unchanged(cache, seq), pytest.raises(error) as asked:
        cache.can_admit(seq, m, k)
    with unchanged(cache, seq), pytest.raises(error) as admitted:
        cache.admit(seq, m, k)
    assert type(asked.value) is type(admitted.value) and str(asked.value) == str(admitted.value)
    cache.check_invariants()
    return asked.value


def _make_stale(cache: PrefixCache, backend: str, seq: Sequence) -> None:
    if backend == "paged":
        cache.unregister_prefix(seq.prefix_id)
    else:
        assert cache.evict(cache.num_pages) > 0


@pytest.mark.parametrize("backend, options", CONFIGS, ids=CONFIG_IDS)
def test_misuse_raises_what_admit_raises_and_changes_nothing(backend, options):
    cache, seq = _warm(backend, options)
    m = cache.match(seq)
    hit = m.num_tokens
    assert hit == (0 if backend == "none" else 12)
    # num_tokens out of range, or not an int
    for k in [max(hit, 1) - 1, len(seq) + 1, -1, 2.0, True, "3", None]:
        _same_refusal(cache, seq, m, k, InvalidRequestError)
    # not a Match, not a Sequence
    _same_refusal(cache, seq, tuple(m), len(seq), InvalidRequestError)
    with unchanged(cache), pytest.raises(InvalidRequestError):
        cache.can_admit("s", m, 3)
    # a match of another request id, or made by another cache
    other = Sequence("o", seq.tokens, prefix_id=seq.prefix_id)
    _same_refusal(cache, other, m, len(other), InvalidRequestError)
    twin, twin_seq = _warm(backend, options)
    _same_refusal(cache, seq, twin.match(twin_seq), len(seq), InvalidRequestError)
    # forged: a hit whose first page is another one
    if hit:
        forged = m._replace(pages=(m.pages[0] + 1, *m.pages[1:]))
        _same_refusal(cache, seq, forged, len(seq), InvalidRequestError)
    # the match still holds: both say it fits
    assert cache.can_admit(seq, m, len(seq)) is True
    # an admitted sequence, and a second object under its id
    assert cache.admit(seq, m, len(seq)) is not None
    cache.commit(seq, len(seq))
    again = Sequence("s", seq.tokens, prefix_id=seq.prefix_id)
    m2 = cache.match(again)
    err = _same_refusal(cache, again, m2, len(again), InvalidRequestError)
    assert "already admitted" in str(err)
    _same_refusal(cache, seq, m2, len(seq), InvalidRequestError)
    # stale: the cache changed since the match
    if backend in CAN_GO_STALE:
        cache.release(seq)
        fresh = Sequence("f", seq.tokens, prefix_id=seq.prefix_id)
        m3 = cache.match(fresh)
        _make_stale(cache, backend, seq)
        _same_refusal(cache, fresh, m3, len(fresh), StaleMatchError)


@pytest.mark.parametrize("backend, options", CONFIGS, ids=CONFIG_IDS)
def test_can_admit_moves_no_counter_and_refreshes_nothing(backend, options):
    """Asked many times, over a pool with room and over one with none: stats and state stay put."""
    cache, seq = _warm(backend, options)
    m = cache.match(seq)
    stats = cache.stats()
    with unchanged(cache, seq):
        for _ in range(5):
            for k in range(max(m.num_tokens, 1), len(seq) + 1):
                assert cache.can_admit(seq, m, k) is True
    assert cache.stats() == stats
    # a prompt longer than the pool: its largest chunk that fits takes every page left
    hog = Sequence("hog", list(range(500, 508 + 4 * cache.num_pages)))
    hm = cache.match(hog)
    k = len(hog)
    while not cache.can_admit(hog, hm, k):
        k -= 1
    assert k < len(hog) and cache.admit(hog, hm, k) is not None
    # so nothing is reclaimable: the answer is no, and still nothing moves
    assert cache.pages_reclaimable() == 0
    m = cache.match(seq)
    stats = cache.stats()
    with unchanged(cache, seq):
        assert cache.can_admit(seq, m, len(seq)) is False
    assert cache.stats() == stats
