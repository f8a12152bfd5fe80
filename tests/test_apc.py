"""apc with exact expectations: block ids, free-queue order, eviction order (vLLM V1 semantics)."""

from __future__ import annotations

import numpy as np
import pytest

from backends.apc import APCCache
from cachelib import CopyOp, ExtraKeys, StaleMatchError, create_cache
from cachelib.hashing import DictIndex, RunIndex
from tests.helpers import run_prompt, seq, unchanged


@pytest.fixture(autouse=True, params=[RunIndex, DictIndex])
def table(request, monkeypatch):
    """Every test on both hash tables: per commit (`RunIndex`) and per block (`DictIndex`)."""
    monkeypatch.setattr(APCCache, "index_type", request.param)
    return request.param


def queue_ids(cache: APCCache) -> list[int]:
    return list(cache.free_queue)  # block ids, head first


def test_seed_example_hits_8_of_14():
    """DESIGN/seed: block size 4, request 1 has 14 tokens, its first 10 equal to request 0's."""
    cache = APCCache(num_pages=10, page_size=4)
    r0 = seq("r0", range(10))
    run_prompt(cache, r0)
    assert r0.page_table == [0, 1, 2]
    cache.release(r0)
    # last block (unhashed, partial) to the head; hashed blocks to the tail, last first
    assert queue_ids(cache) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    r1 = seq("r1", list(range(10)) + [100, 101, 102, 103])
    m = cache.match(r1)
    assert (m.num_tokens, m.pages) == (8, (0, 1))
    assert len(r1) - m.num_tokens == 6
    cache.admit(r1, m, len(r1))
    assert r1.page_table == [0, 1, 2, 3]
    assert r1.num_computed == 8
    cache.check_invariants()


def test_identical_prompt_hits_all_but_last_block_then_longer_hits_all():
    cache = APCCache(num_pages=10, page_size=4)
    r0 = seq("r0", range(16))
    run_prompt(cache, r0)
    assert r0.page_table == [0, 1, 2, 3]
    cache.release(r0)
    assert queue_ids(cache) == [4, 5, 6, 7, 8, 9, 3, 2, 1, 0]
    assert cache.cached_blocks_in_lru_order() == [3, 2, 1, 0]

    r1 = seq("r1", range(16))
    m = run_prompt(cache, r1)
    assert m.num_tokens == 12  # capped at 15, rounded down to a block
    assert r1.page_table == [0, 1, 2, 4]
    # the recomputed last block is cached again: a duplicate of block 3
    assert cache.stats().extra["table_entries"] == 5
    assert len(cache._table) == 4

    r2 = seq("r2", list(range(16)) + [99])
    m = cache.match(r2)
    assert m.num_tokens == 16
    assert m.pages == (0, 1, 2, 3)  # the oldest of the duplicates
    cache.release(r1)
    cache.check_invariants()


def test_eviction_takes_the_queue_head_lazily():
    cache = APCCache(num_pages=10, page_size=4)
    r0 = seq("r0", range(16))
    run_prompt(cache, r0)
    cache.release(r0)
    other = seq("other", range(1000, 1028))  # 7 blocks: 6 free ones, then cached block 3
    run_prompt(cache, other)
    assert other.page_table == [4, 5, 6, 7, 8, 9, 3]
    assert cache.stats().evicted_pages == 1
    assert cache.cached_blocks_in_lru_order() == [2, 1, 0]
    again = seq("again", range(16))
    assert cache.match(again).num_tokens == 12  # blocks 0..2 survive; block 3 is gone


def test_admission_counts_hit_blocks_in_the_free_queue():
    cache = APCCache(num_pages=4, page_size=4)
    r0 = seq("r0", range(16))
    run_prompt(cache, r0)
    cache.release(r0)
    # 3 hit blocks + 2 new: 4 blocks are in the queue, but 3 of them are the hit itself
    r1 = seq("r1", list(range(12)) + list(range(500, 508)))
    m = cache.match(r1)
    assert m.num_tokens == 12
    with unchanged(cache):
        assert cache.admit(r1, m, len(r1)) is None
    # 1 new block fits
    r2 = seq("r2", list(range(12)) + [600, 601, 602])
    assert cache.admit(r2, cache.match(r2), 15) == []
    assert r2.page_table == [0, 1, 2, 3]
    assert cache.stats().evicted_pages == 1


def test_release_order_hashed_to_tail_unhashed_to_head():
    cache = APCCache(num_pages=8, page_size=4)
    a = seq("a", range(9))  # blocks 0,1 full, 2 partial
    b = seq("b", range(100, 106))  # block 3 full, 4 partial
    run_prompt(cache, a)
    run_prompt(cache, b)
    assert (a.page_table, b.page_table) == ([0, 1, 2], [3, 4])
    cache.release(b)
    cache.release(a)
    assert queue_ids(cache) == [2, 4, 5, 6, 7, 3, 1, 0]


def test_decode_blocks_are_cached_as_they_fill():
    cache = APCCache(num_pages=8, page_size=4)
    r0 = seq("r0", range(6))
    run_prompt(cache, r0)
    r0.append([50, 51, 52, 53])
    assert cache.grow(r0, 10) == []
    cache.commit(r0, 9)  # the last generated token gets no KV
    assert r0.page_table == [0, 1, 2]
    cache.release(r0)
    follow = seq("f", [0, 1, 2, 3, 4, 5, 50, 51, 77])
    assert cache.match(follow).num_tokens == 8


@pytest.mark.parametrize("field", ["cache_salt", "lora_id"])
def test_salt_and_lora_never_share(field):
    cache = APCCache(num_pages=16, page_size=4)
    a_key, b_key = ("tenant-a", "tenant-b") if field == "cache_salt" else (1, 2)
    a = seq("a", range(12), ExtraKeys(**{field: a_key}))
    run_prompt(cache, a)
    cache.release(a)
    assert cache.match(seq("b", range(12), ExtraKeys(**{field: b_key}))).num_tokens == 0
    assert cache.match(seq("plain", range(12))).num_tokens == 0
    assert cache.match(seq("a2", range(12), ExtraKeys(**{field: a_key}))).num_tokens == 8


def test_multimodal_hash_changes_only_overlapping_blocks_and_after():
    from cachelib.types import MultiModalSpan

    cache = APCCache(num_pages=16, page_size=4)
    img1 = ExtraKeys(mm=(MultiModalSpan(4, 4, "img-1"),))
    img2 = ExtraKeys(mm=(MultiModalSpan(4, 4, "img-2"),))
    a = seq("a", range(13), img1)
    run_prompt(cache, a)
    cache.release(a)
    assert cache.match(seq("b", range(13), img2)).num_tokens == 4  # block 0 precedes the image
    assert cache.match(seq("c", range(13), img1)).num_tokens == 12


def _constant_hash(data: bytes) -> bytes:
    return b"\x07" * 16  # every block collides with every other


def test_hash_collision_is_observable_without_verification():
    cache = APCCache(num_pages=8, page_size=4, hash_fn=_constant_hash)
    run_prompt(cache, seq("r0", [1, 2, 3, 4, 5]))
    m = cache.match(seq("r1", [9, 9, 9, 9, 9]))
    assert m.num_tokens == 4 and m.pages == (0,)  # wrong KV: the tokens differ


def test_verify_tokens_never_returns_a_wrong_block():
    cache = APCCache(num_pages=16, page_size=4, hash_fn=_constant_hash, verify_tokens=True)
    A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    r0 = seq("r0", A + B + [0])
    run_prompt(cache, r0)
    assert cache.match(seq("x", [9, 9, 9, 9, 9])).num_tokens == 0
    r1 = seq("r1", C + B + [0])
    assert cache.match(r1).num_tokens == 0  # C was never cached
    run_prompt(cache, r1)
    m = cache.match(seq("r2", A + B + [42]))
    assert m.num_tokens == 8 and m.pages == tuple(r0.page_table[:2])
    # same tokens B, but after C: only r1's block (parent C) is right
    m = cache.match(seq("r3", C + B + [42]))
    assert m.num_tokens == 8 and m.pages == tuple(r1.page_table[:2])
    cache.check_invariants()


def test_verify_tokens_survives_eviction_and_block_reuse():
    cache = APCCache(num_pages=3, page_size=4, hash_fn=_constant_hash, verify_tokens=True)
    r0 = seq("r0", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    run_prompt(cache, r0)
    cache.release(r0)
    # evicts the block holding [1,2,3,4] (LRU head order: partial, then last block first)
    r1 = seq("r1", [9, 9, 9, 9, 9, 9, 9, 9, 9])
    run_prompt(cache, r1)
    cache.release(r1)
    got = cache.match(seq("r2", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    for i, page in enumerate(got.pages):
        assert np.array_equal(cache._tokens[page], [1, 2, 3, 4, 5, 6, 7, 8][4 * i : 4 * i + 4])


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    cache = APCCache(num_pages=8, page_size=4)
    parent = seq("p", range(10))
    run_prompt(cache, parent)
    child = parent.fork("c")
    ops = cache.fork(parent, child)
    assert ops == [CopyOp(2, 3)]
    assert child.page_table == [0, 1, 3] and child.num_computed == 10
    assert [cache.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    cache.check_invariants()
    cache.release(parent)
    assert [cache.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    cache.release(child)
    assert cache.stats().pages_pinned == 0
    cache.check_invariants()


def test_explicit_evict_in_lru_order():
    cache = APCCache(num_pages=10, page_size=4)
    r0 = seq("r0", range(16))
    run_prompt(cache, r0)
    assert cache.evict(3) == 0  # everything is pinned
    cache.release(r0)
    assert cache.evict(0) == 0
    assert cache.evict(2) == 2
    assert cache.cached_blocks_in_lru_order() == [1, 0]
    assert queue_ids(cache)[:2] == [3, 2]
    assert cache.evict(100) == 2
    assert cache.stats().pages_cached == 0
    cache.check_invariants()


def test_stale_match_is_refused():
    cache = APCCache(num_pages=4, page_size=4)
    r0 = seq("r0", range(9))
    run_prompt(cache, r0)
    cache.release(r0)
    r1 = seq("r1", range(9))
    m = cache.match(r1)
    run_prompt(cache, seq("big", range(100, 116)))  # evicts r0's blocks
    with pytest.raises(StaleMatchError):
        cache.admit(r1, m, len(r1))


def test_sha256_option_gives_the_same_decisions():
    a = create_cache("apc", num_pages=10, page_size=4)
    b = create_cache("apc", num_pages=10, page_size=4, hash_algorithm="sha256")
    for cache in (a, b):
        run_prompt(cache, seq("r0", range(14)))
    assert a.match(seq("q", range(13))).pages == b.match(seq("q", range(13))).pages == (0, 1, 2)


def test_stats_account_for_every_page():
    cache = APCCache(num_pages=10, page_size=4)
    r0 = seq("r0", range(10))
    run_prompt(cache, r0)
    s = cache.stats()
    assert (s.pages_free, s.pages_cached, s.pages_pinned) == (7, 0, 3)
    cache.release(r0)
    s = cache.stats()
    assert (s.pages_free, s.pages_cached, s.pages_pinned) == (8, 2, 0)
    assert s.admitted_tokens == 10 and s.hit_tokens == 0 and s.lookups == 1


@pytest.mark.parametrize("verify_tokens", [False, True])
def test_a_billion_pages_cost_nothing_until_used(verify_tokens):
    """Pages are created lazily (replay with unlimited capacity asks for every page of a
    trace): a pool of 10**9 blocks holds only what the blocks used need."""
    import tracemalloc

    # the hash chain's compiled code is loaded at its first use in a process (tens of MB
    # that are not the cache's): load it before measuring
    warm = APCCache(num_pages=64, page_size=16, verify_tokens=verify_tokens)
    warm.prefill(seq("warm", np.arange(40)))
    tracemalloc.start()
    try:
        cache = APCCache(num_pages=10**9, page_size=16, verify_tokens=verify_tokens)
        rng = np.random.default_rng(0)
        prefix = rng.integers(0, 50_000, 64)
        for i in range(40):
            s = seq(f"r{i}", np.concatenate([prefix, rng.integers(0, 50_000, 300)]))
            m = cache.match(s)
            assert cache.admit(s, m, len(s)) == []
            cache.commit(s, len(s))
            assert m.num_tokens == (0 if i == 0 else 64)
            cache.release(s)
        stats = cache.stats()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stats.pages_free + stats.pages_cached == 10**9 and stats.pages_cached > 0
    assert peak < 5_000_000, f"{peak} bytes for 10**9 pages, {cache.free_queue.num_used} used"
