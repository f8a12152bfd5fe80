"""radix page ids as int32 arrays (backends/radix_pages.py): the pool, the tables, and the
proof that how page ids are stored changes no decision.

The radix cache once kept page ids as lists of Python ints, with tree nodes borrowing from a
running request's list (radix-hicache still builds list tables, through the same inherited
calls). `ListTables` below is that representation: a radix cache whose tables are lists from
admission on. It must decide exactly as the array cache does, call for call: the same hits,
the same fits, the same evicted nodes in the same order, the same counters.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from backends.radix import RadixCache
from backends.radix_pages import PagePool, PageTable
from cachelib import InvalidRequestError, StaleMatchError, create_cache
from experiments.engine import replay
from tests.helpers import seq

# -- the pool -------------------------------------------------------------------------------


def test_the_pool_creates_ids_only_when_first_handed_out():
    pool = PagePool(10**12)  # an unlimited pool costs nothing up front
    assert pool.num_free == 10**12
    assert pool.take(3).tolist() == [0, 1, 2]
    assert pool.num_free == 10**12 - 3


def test_the_pool_keeps_a_long_array_given_back_and_copies_a_short_one():
    # long = at least `_SHORT_RUN` ids (a page-1 prompt's node), short = fewer
    pool = PagePool(100_000)
    pool.take(30_000)
    long_run = np.arange(10_000, 20_000, dtype=np.int32)
    short = np.arange(10, 20, dtype=np.int32)
    pool.give(long_run)
    pool.give(short)
    short[:] = -1  # the pool copied the short one: the caller may write its array again
    expected = sorted([*range(10, 20), *range(10_000, 20_000), *range(30_000, 100_000)])
    assert sorted(pool.free_ids()) == expected
    (run,) = pool._runs
    assert run is long_run  # kept as it is, not copied
    out = pool.take(15_000)  # the last run first (10_000 of it), then the stack, then never-used ids
    assert out[:10_000].tolist() == list(range(10_000, 20_000))
    assert sorted(out[10_000:10_010].tolist()) == list(range(10, 20))
    assert out[10_010:].tolist() == list(range(30_000, 34_990))
    assert pool.num_free == 100_000 - 30_000 + 10_010 - 15_000


def test_the_pool_takes_from_its_stack_alone_when_no_run_is_left():
    pool = PagePool(1000)
    pool.take(1000)
    pool.give(np.arange(0, 300, dtype=np.int32))  # short: onto the stack
    pool.give(np.arange(500, 600, dtype=np.int32))
    assert not pool._runs
    assert pool.take(150).tolist() == list(range(250, 300)) + list(range(500, 600))  # the top 150
    assert sorted(pool.free_ids()) == list(range(250)) and pool.num_free == 250


def test_a_run_partly_taken_leaves_its_head_a_view_unless_short_beside_its_buffer():
    pool = PagePool(100_000)
    pool.take(100_000)
    buf = np.arange(100_000, dtype=np.int32)
    pool.give(buf[:80_000])  # a view of a 100_000-id buffer, kept as it is
    assert pool.take(10_000).tolist() == list(range(70_000, 80_000))
    (rest,) = pool._runs
    assert np.shares_memory(rest, buf) and rest.tolist() == list(range(70_000))
    assert pool.take(40_000).tolist() == list(range(30_000, 70_000))
    (rest,) = pool._runs  # 30_000 of 100_000: copied, so it no longer pins the buffer
    assert not np.shares_memory(rest, buf) and rest.tolist() == list(range(30_000))
    assert sorted(pool.free_ids()) == list(range(30_000)) and pool.num_free == 30_000


def test_a_list_given_back_is_taken_as_ints():
    pool = PagePool(100)
    pool.take(100)
    pool.give(list(range(20, 90)))  # a subclass's list table
    pool.give([5])
    assert sorted(pool.take(71).tolist()) == [5, *range(20, 90)]
    assert pool.num_free == 0


# -- the table ------------------------------------------------------------------------------


def test_a_table_reads_as_a_list_of_ints():
    t = PageTable(2)
    t.extend(np.array([7, 8, 9], dtype=np.int32))
    t.append(10)
    t.extend([11, 12])
    assert len(t) == 6 and t == [7, 8, 9, 10, 11, 12] and t != [7, 8]
    assert t[0] == 7 and t[-1] == 12 and type(t[0]) is int
    assert t[1:3] == [8, 9] and type(t[1:3]) is list
    assert list(t) == [7, 8, 9, 10, 11, 12] and all(type(p) is int for p in t)
    assert np.asarray(t, dtype=np.int64).tolist() == list(t)
    with pytest.raises(IndexError):
        t[6]


def test_a_table_keeps_its_ids_when_it_outgrows_its_buffer_and_old_views_keep_theirs():
    t = PageTable(4)
    t.extend(np.arange(4, dtype=np.int32))
    view = t.array()[1:3]
    t.append_slots(100)[:] = np.arange(100, 200, dtype=np.int32)
    assert t[:4] == [0, 1, 2, 3] and t[4:] == list(range(100, 200))
    assert view.tolist() == [1, 2] and not np.shares_memory(view, t.array())
    t[0:2] = [50, 51]
    assert t[:3] == [50, 51, 2] and view.tolist() == [1, 2]


# -- the match memo: a fast path that must agree with the full proof ---------------------------


def radix(num_pages=64, page_size=4, **kw) -> RadixCache:
    return create_cache("radix", num_pages=num_pages, page_size=page_size, track_contents=True, **kw)


def _cached(cache, tokens, rid="w"):
    s = seq(rid, tokens)
    cache.admit(s, cache.match(s), len(s))
    cache.commit(s, len(s))
    cache.release(s)


def test_a_memo_recognised_match_is_still_refused_once_its_node_is_evicted():
    cache = radix()
    _cached(cache, range(100, 117))
    s = seq("s", range(100, 110))
    m = cache.match(s)
    assert m.num_tokens == 8 and s.cache_memo[-1] is m.pages
    cache.evict(cache.stats().pages_cached)
    with pytest.raises(StaleMatchError):
        cache.admit(s, m, len(s))


def test_an_edited_token_count_with_the_memo_s_own_pages_is_refused():
    cache = radix()
    _cached(cache, range(100, 117))
    s = seq("s", range(100, 110))
    m = cache.match(s)
    forged = m._replace(num_tokens=7)  # same page count, the same tuple object: not the match made
    with pytest.raises(InvalidRequestError, match="ends at token 8, not 7"):
        cache.admit(s, forged, len(s))
    assert cache.admit(s, m, len(s)) is not None


def test_a_memo_copied_to_another_sequence_proves_nothing():
    cache = radix()
    _cached(cache, range(100, 117))
    s = seq("s", range(100, 110))
    m = cache.match(s)
    other = seq("s", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], s.extra)  # same id and keys, other tokens
    other.cache_memo = s.cache_memo  # as an engine re-creating a request copies it
    with pytest.raises(InvalidRequestError, match="not the tree's for this sequence"):
        cache.admit(other, m, len(other))


# -- arrays decide as lists did ---------------------------------------------------------------


class ListTables(RadixCache):
    """The radix cache with list tables (the representation before arrays): a table becomes
    a list of ints at admission, before any node could view it, so every later call takes
    the list path (borrowing nodes, settled at release)."""

    name = "radix-list-tables"

    def _admit(self, seq, match, num_tokens):
        admitted = super()._admit(seq, match, num_tokens)
        if admitted is not None:
            seq.page_table = seq.page_table.tolist()
        return admitted


def _caches(page_size: int, num_pages: int, policy: str = "lru"):
    out = []
    for cls in (RadixCache, ListTables):
        cache = cls(num_pages, page_size, eviction_policy=policy, track_contents=True)
        evicted: list = []
        cache.on_evict = lambda ns, start, key, evicted=evicted: evicted.append((ns, start, key.tobytes()))
        out.append((cache, evicted))
    return out


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
def test_array_and_list_tables_decide_alike_on_the_trace(page_size, concurrency):
    from experiments.workloads.mooncake import load_mooncake
    from tests.test_radix_fidelity import TRACE

    requests = load_mooncake(TRACE, limit=150)
    results = []
    for cache, evicted in _caches(page_size, 60_000 // page_size):
        result = replay(cache, requests, concurrency=concurrency)
        cache.check_invariants()
        results.append((result["per_request_hits"], evicted, cache.stats().evicted_pages))
    assert results[0][1], "the run should evict"
    assert results[0] == results[1]


def _random_workload(rng: random.Random, pair, page_size: int, steps: int) -> None:
    """Random calls on two caches at once (chunked prefills, decode steps, forks, releases),
    every outcome compared, invariants checked after each call."""
    (a, ev_a), (b, ev_b) = pair
    # long shared prefixes: two requests prefilling one in chunks compute duplicates of
    # more than a few pages (the pool keeps long runs as they are)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 200))] for _ in range(6)]
    live: dict[str, tuple] = {}
    n = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.35 or not live:
            n += 1
            rid = f"r{n}"
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            sa, sb = seq(rid, tokens), seq(rid, tokens)
            ma, mb = a.match(sa), b.match(sb)
            assert ma.num_tokens == mb.num_tokens and len(ma.pages) == len(mb.pages)
            chunk = rng.randrange(max(ma.num_tokens, 1), len(sa) + 1)
            fa, fb = a.admit(sa, ma, chunk), b.admit(sb, mb, chunk)
            assert (fa is None) == (fb is None)
            if fa is not None:
                a.commit(sa, chunk)
                b.commit(sb, chunk)
                live[rid] = (sa, sb)
        elif op < 0.7:
            rid = rng.choice(sorted(live))
            sa, sb = live[rid]
            if sa.num_computed < len(sa):  # the rest of the prompt
                ga, gb = a.grow(sa, len(sa)), b.grow(sb, len(sb))
                end = len(sa)
            else:  # a decode token
                t = rng.randrange(50)
                sa.append_token(t)
                sb.append_token(t)
                ga, gb = a.grow(sa, len(sa)), b.grow(sb, len(sb))
                end = len(sa) - 1
            assert (ga is None) == (gb is None)
            if ga is not None:
                a.commit(sa, max(end, sa.num_computed))
                b.commit(sb, max(end, sb.num_computed))
        elif op < 0.8:
            rid = rng.choice(sorted(live))
            sa, sb = live[rid]
            n += 1
            ca, cb = sa.fork(f"r{n}"), sb.fork(f"r{n}")
            oa, ob = a.fork(sa, ca), b.fork(sb, cb)
            assert (oa is None) == (ob is None) and (oa is None or len(oa) == len(ob))
            if oa is not None:
                live[f"r{n}"] = (ca, cb)
        else:
            rid = rng.choice(sorted(live))
            sa, sb = live.pop(rid)
            a.release(sa)
            b.release(sb)
        a.check_invariants()
        b.check_invariants()
        assert ev_a == ev_b
        sta, stb = a.stats(), b.stats()
        assert (sta.pages_free, sta.pages_cached, sta.hit_tokens, sta.evicted_pages, sta.extra) == (
            stb.pages_free,
            stb.pages_cached,
            stb.hit_tokens,
            stb.evicted_pages,
            stb.extra,
        )
    for sa, sb in live.values():
        a.release(sa)
        b.release(sb)
    assert ev_a == ev_b and a.stats().pages_pinned == b.stats().pages_pinned == 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page_size", [1, 4])
def test_array_and_list_tables_decide_alike_on_random_calls(seed, page_size):
    rng = random.Random(seed * 100 + page_size)
    policy = ["lru", "lfu", "fifo", "mru", "filo", "lru"][seed]
    pair = _caches(page_size, 700 // page_size + 8, policy)
    _random_workload(rng, pair, page_size, steps=250)
    assert pair[0][1], "the workload should evict"
