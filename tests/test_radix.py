"""radix backend: exact expectations (hits, splits, eviction order, locks, namespaces, fork)."""

from __future__ import annotations

import numpy as np
import pytest

from backends.radix import RadixCache
from backends.radix_pages import PageTable
from backends.radix_policy import EvictionPolicy
from cachelib import (
    CopyOp,
    ExtraKeys,
    InvalidRequestError,
    Sequence,
    StaleMatchError,
    UnknownSequenceError,
    create_cache,
)
from tests.helpers import run_prompt, seq, unchanged


def radix(num_pages: int = 256, page_size: int = 1, **kw) -> RadixCache:
    return create_cache("radix", num_pages=num_pages, page_size=page_size, track_contents=True, **kw)


def finish(cache: RadixCache, s: Sequence) -> None:
    cache.release(s)
    cache.check_invariants()


def tree_tokens(cache: RadixCache) -> int:
    st = cache.stats().extra
    return st["evictable_tokens"] + st["protected_tokens"]


def leaf_runs(cache: RadixCache) -> list[tuple[int, tuple[int, ...]]]:
    """(start, first token) of every eviction candidate, next evicted first."""
    return [(k[-1].start, int(k[-1].key[0])) for k in cache.tree.candidates]


# -- hits ---------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size, expected", [(1, 10), (4, 8)])
def test_two_requests_sharing_a_10_token_prefix(page_size, expected):
    cache = radix(page_size=page_size)
    shared = list(range(100, 110))
    a = seq("a", shared + [1, 2, 3, 4, 5, 6])
    assert run_prompt(cache, a).num_tokens == 0
    a_table = list(a.page_table)  # released, a's table list becomes the tree's (a keeps none)
    finish(cache, a)
    assert a.page_table == []
    b = seq("b", shared + [7, 8, 9, 10, 11, 12])
    m = run_prompt(cache, b)
    assert m.num_tokens == expected
    assert list(m.pages) == a_table[: expected // page_size] == b.page_table[: expected // page_size]
    finish(cache, b)


@pytest.mark.parametrize("page_size, expected", [(1, 15), (4, 12)])
def test_identical_16_token_prompt_resent(page_size, expected):
    cache = radix(page_size=page_size)
    tokens = list(range(16))
    a = seq("a", tokens)
    run_prompt(cache, a)
    a_table = list(a.page_table)
    finish(cache, a)
    b = seq("b", tokens)
    m = run_prompt(cache, b)
    assert m.num_tokens == expected
    # the recomputed tail is a duplicate of tree pages: freed, and b's table points at the tree's
    assert b.page_table == a_table
    assert cache.stats().pages_pinned == 16 // page_size
    finish(cache, b)
    assert cache.stats().pages_free == cache.num_pages - 16 // page_size


def test_match_is_capped_at_len_minus_one_and_rounded_to_pages():
    cache = radix(page_size=4)
    a = seq("a", range(12))
    run_prompt(cache, a)
    finish(cache, a)
    assert cache.match(seq("x", range(12))).num_tokens == 8  # 11 -> 8
    assert cache.match(seq("y", range(13))).num_tokens == 12
    assert cache.match(seq("z", range(4))).num_tokens == 0  # 3 tokens: no whole page
    assert cache.match(seq("w", [0, 1, 2, 9, 4, 5, 6, 7, 8])).num_tokens == 0  # first page differs


def test_partial_last_page_stays_private_and_is_freed_at_release():
    cache = radix(num_pages=16, page_size=4)
    a = seq("a", range(10))
    run_prompt(cache, a)
    assert tree_tokens(cache) == 8  # two whole pages in the tree, the third is a's own
    st = cache.stats()
    assert (st.pages_free, st.pages_cached, st.pages_pinned) == (13, 0, 3)
    finish(cache, a)
    st = cache.stats()
    assert (st.pages_free, st.pages_cached, st.pages_pinned) == (14, 2, 0)


# -- splits -------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4])
def test_splits_keep_the_tree_token_count(page_size):
    cache = radix(page_size=page_size)
    a = seq("a", range(32))
    run_prompt(cache, a)
    finish(cache, a)
    assert (tree_tokens(cache), cache.stats().extra["tree_nodes"]) == (32, 1)
    # a match ending inside the node splits it; nothing is added or lost
    m = cache.match(seq("b", list(range(12)) + [99] * 9))
    assert m.num_tokens == 12
    assert (tree_tokens(cache), cache.stats().extra["tree_nodes"]) == (32, 2)
    cache.check_invariants()
    # an insert diverging inside a node splits it too
    c = seq("c", list(range(20)) + [77] * 12)
    run_prompt(cache, c)
    finish(cache, c)
    assert tree_tokens(cache) == 32 + 12
    assert cache.stats().extra["tree_nodes"] == 4  # [0,12) [12,20) [20,32) [77...]
    cache.check_invariants()


# -- eviction order -----------------------------------------------------------------------


def build_tree(policy: str | EvictionPolicy) -> RadixCache:
    """A small hand-built tree at page size 1 (one logical-clock tick per walk)::

        root -> P [1,2,3,4] -> A [10]*4          created 1 (as one node, split off P at 2)
                            -> B [20]*4          created 3
                            -> C1 [30]*3 -> C2 [30]   C created 5, split at 8 by a re-send
             -> D [40]*6                          created 7

    C is re-sent twice (each insert walk counts a hit on P, C1, C2: LFU), then A is matched
    again last (the most recent access).
    """
    cache = radix(num_pages=64, page_size=1, eviction_policy=policy)
    for rid, tail in (("A", 10), ("B", 20), ("C", 30)):
        s = seq(rid, [1, 2, 3, 4] + [tail] * 4)
        run_prompt(cache, s)
        finish(cache, s)
    d = seq("D", [40] * 6)
    run_prompt(cache, d)
    finish(cache, d)
    for i in range(2):  # re-send C: its match (len - 1) splits C once; both inserts walk it
        s = seq(f"C{i}", [1, 2, 3, 4] + [30] * 4)
        run_prompt(cache, s)
        finish(cache, s)
    cache.match(seq("A2", [1, 2, 3, 4] + [10] * 4 + [5]))  # A most recently used, no split
    cache.check_invariants()
    return cache


A, B, C1, C2, D, P = (10, 4), (20, 4), (30, 4), (30, 7), (40, 0), (1, 0)


@pytest.mark.parametrize(
    "policy, order",
    [
        ("lru", [B, D, C2, C1, A, P]),
        ("mru", [A, C2, C1, D, B, P]),
        ("fifo", [A, B, C2, D, C1, P]),
        ("filo", [D, C2, C1, B, A, P]),
        ("lfu", [B, D, A, C2, C1, P]),
    ],
)
def test_leaf_eviction_order_per_policy(policy, order):
    cache = build_tree(policy)
    evicted: list[tuple[int, int]] = []
    cache.on_evict = lambda ns, start, key: evicted.append((int(key[0]), start))
    total = 0
    for _ in range(6):
        total += cache.evict(1)
        cache.check_invariants()
    assert evicted == order  # a parent becomes a candidate once its last child is gone
    assert total == 4 + 4 + 3 + 1 + 6 + 4
    assert cache.evict(1) == 0
    assert cache.stats().pages_free == cache.num_pages


class LongestFirst(EvictionPolicy):
    """A policy from outside the backend: the longest leaf goes first."""

    __slots__ = ()
    name = "longest"
    rekey_on_split = True  # a split shortens the lower part

    def key(self, node):
        return (-len(node.key), node.node_id, node)


def test_a_policy_object_orders_eviction():
    """`eviction_policy` takes an `EvictionPolicy`: a new order without touching the tree."""
    cache = build_tree(LongestFirst())
    assert cache.stats().extra["eviction_policy"] == "longest"
    evicted: list[tuple[int, int]] = []
    cache.on_evict = lambda ns, start, key: evicted.append((int(key[0]), start))
    while cache.evict(1):
        cache.check_invariants()
    assert evicted == [D, A, B, C2, C1, P]  # 6, 4, 4 (older first), 1, then the parents


@pytest.mark.parametrize("bad", ["lru2", 3, None])
def test_unknown_policy_names_the_choices(bad):
    with pytest.raises(InvalidRequestError, match="unknown eviction policy.*lru, lfu, fifo, mru, filo"):
        radix(eviction_policy=bad)


def test_fifo_split_node_is_created_when_split():
    """SGLang's split creates the prefix node *now*: under FIFO it outlives its old child."""
    cache = radix(num_pages=64, page_size=1, eviction_policy="fifo")
    a = seq("a", range(10))
    run_prompt(cache, a)
    finish(cache, a)
    b = seq("b", [50] * 4)
    run_prompt(cache, b)
    finish(cache, b)
    cache.match(seq("c", list(range(5)) + [9, 9]))  # splits a at 5
    evicted = []
    cache.on_evict = lambda ns, start, key: evicted.append((start, len(key)))
    cache.evict(64)
    assert evicted == [(5, 5), (0, 4), (0, 5)]


def test_locked_paths_are_never_evicted():
    cache = radix(num_pages=18, page_size=1)
    a = seq("a", range(10))
    run_prompt(cache, a)  # a holds [0, 10)
    b = seq("b", range(100, 108))
    run_prompt(cache, b)
    finish(cache, b)
    assert cache.evict(100) == 8  # only b's pages are evictable
    assert cache.stats().extra["protected_tokens"] == 10
    # c needs 11 more pages but 8 are free and nothing is evictable: refused, unchanged
    c = seq("c", list(range(10)) + list(range(200, 211)))
    m = cache.match(c)
    assert m.num_tokens == 10
    with unchanged(cache):
        assert cache.admit(c, m, len(c)) is None
    finish(cache, a)


def test_admission_does_not_count_its_own_path_as_evictable():
    cache = radix(num_pages=12, page_size=1)
    a = seq("a", range(10))
    run_prompt(cache, a)
    finish(cache, a)  # 10 cached, 2 free
    b = seq("b", list(range(10)) + [50, 51, 52])
    m = cache.match(b)
    assert m.num_tokens == 10
    # b needs 3 pages: 2 free, and the only evictable pages are its own prefix
    with unchanged(cache):
        assert cache.admit(b, m, len(b)) is None


def _four_leaves(cache: RadixCache) -> None:
    for i, rid in enumerate("abcd"):
        s = seq(rid, [10 * (i + 1)] * 4)
        run_prompt(cache, s)
        finish(cache, s)  # four leaves of 4 tokens, LRU a..d


def test_admit_evicts_only_the_shortfall():
    """SGLang 0.5.23's `evict_to_free_tokens`: evict the demand minus what is free."""
    cache = radix(num_pages=20, page_size=1)
    _four_leaves(cache)  # 4 pages free
    e = seq("e", [90] * 6)
    assert run_prompt(cache, e).num_tokens == 0
    assert cache.stats().evicted_pages == 4  # short by 2: one whole leaf (a)
    finish(cache, e)


def test_admit_evicts_the_whole_need_with_the_older_rule():
    """`admission_eviction="extend"`: older SGLang asked the tree for all the new tokens."""
    cache = radix(num_pages=20, page_size=1, admission_eviction="extend")
    _four_leaves(cache)
    e = seq("e", [90] * 6)
    assert run_prompt(cache, e).num_tokens == 0
    assert cache.stats().evicted_pages == 8  # asked for 6: two whole leaves (a, b)
    finish(cache, e)


def test_paged_admission_reserves_one_page():
    """At page size > 1 SGLang's demand is the extend tokens plus one page."""
    for reserve, evicted in ((True, 2), (False, 0)):
        cache = radix(num_pages=10, page_size=4, reserve_page=reserve)
        for i, rid in enumerate("ab"):
            s = seq(rid, [10 * (i + 1)] * 8)
            run_prompt(cache, s)
            finish(cache, s)  # two leaves of 2 pages; 6 pages free
        e = seq("e", [90] * 24)  # 6 new pages: they fit exactly, the demand is 7
        run_prompt(cache, e)
        assert cache.stats().evicted_pages == evicted
        finish(cache, e)


def test_paged_decode_keeps_one_page_available_every_step():
    """SGLang's paged decode asks for a whole page every step, even one inside a held page."""
    for reserve, evicted in ((True, 2), (False, 0)):
        cache = radix(num_pages=4, page_size=4, reserve_page=reserve)
        a = seq("a", [10] * 8)
        run_prompt(cache, a)
        finish(cache, a)  # one leaf of 2 pages; 2 free
        e = seq("e", [90] * 4)  # its demand (2 pages) is free: 1 left after it
        run_prompt(cache, e)
        assert cache.stats().evicted_pages == 0
        e.append([91, 92])
        # token 4 takes the last free page; token 5 lives in that page, yet its step finds
        # nothing free and evicts a whole page's worth (the leaf a)
        assert cache.grow(e, len(e)) == []
        assert cache.stats().evicted_pages == evicted
        cache.commit(e, len(e))
        finish(cache, e)


def test_lfu_counts_one_hit_per_request():
    """A request's finish-time insert does not count the path its prefill already counted."""
    cache = radix(page_size=1, eviction_policy="lfu")
    a = seq("a", range(10))
    run_prompt(cache, a)
    a.append([100, 101, 102])
    cache.grow(a, len(a))
    cache.commit(a, len(a))
    finish(cache, a)
    counts = {(n.start, len(n.key)): n.hit_count for n in cache.tree.nodes()}
    assert counts == {(0, 10): 1, (10, 3): 1}
    b = seq("b", range(12))  # hits 10, inserts 2 more: the shared node counts b once
    run_prompt(cache, b)
    finish(cache, b)
    counts = {(n.start, len(n.key)): n.hit_count for n in cache.tree.nodes()}
    assert counts == {(0, 10): 2, (10, 3): 1, (10, 2): 1}


def test_release_refreshes_recency_without_decode_tokens():
    """SGLang's release always re-inserts (a walk that touches the path), output length 1 too."""
    cache = radix(num_pages=20, page_size=1)
    x = seq("x", [1] * 6)
    run_prompt(cache, x)
    y = seq("y", [2] * 6)
    run_prompt(cache, y)
    finish(cache, y)
    finish(cache, x)  # no decode token got KV, yet x is now the most recent
    assert [first for _, first in leaf_runs(cache)] == [2, 1]


def test_grow_evicts_only_the_shortfall():
    cache = radix(num_pages=20, page_size=1)
    for i, rid in enumerate("abcd"):
        s = seq(rid, [10 * (i + 1)] * 4)
        run_prompt(cache, s)
        finish(cache, s)
    e = seq("e", [90] * 3)
    run_prompt(cache, e)  # 1 free left
    e.append([91] * 2)
    assert cache.grow(e, len(e)) == []
    assert cache.stats().evicted_pages == 4  # shortfall 1: one leaf
    finish(cache, e)


# -- namespaces -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x, y",
    [
        (ExtraKeys(cache_salt="t1"), ExtraKeys(cache_salt="t2")),
        (ExtraKeys(cache_salt="t1"), ExtraKeys()),
        (ExtraKeys(lora_id=1), ExtraKeys(lora_id=2)),
        (ExtraKeys(lora_id=1), ExtraKeys()),
        (ExtraKeys(cache_salt="t1", lora_id=1), ExtraKeys(cache_salt="t1", lora_id=2)),
    ],
)
def test_salt_and_lora_isolation(x, y):
    cache = radix(page_size=1)
    tokens = list(range(20))
    a = seq("a", tokens, x)
    run_prompt(cache, a)
    finish(cache, a)
    b = seq("b", tokens, y)
    assert run_prompt(cache, b).num_tokens == 0
    finish(cache, b)
    c = seq("c", tokens, x)
    assert run_prompt(cache, c).num_tokens == 19
    finish(cache, c)
    assert cache.stats().extra["namespaces"] == 2


# -- fork -------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size, computed, copies", [(1, 10, 0), (4, 10, 1), (4, 8, 0)])
def test_fork_shares_through_the_tree_and_copies_only_a_partial_page(page_size, computed, copies):
    cache = radix(num_pages=32, page_size=page_size)
    p = seq("p", range(10))
    m = cache.match(p)
    cache.admit(p, m, 10)
    cache.commit(p, computed)
    child = p.fork("c")
    ops = cache.fork(p, child)
    cache.check_invariants()
    full = computed // page_size
    assert child.page_table[:full] == p.page_table[:full]
    assert len(ops) == copies
    if copies:
        assert ops == [CopyOp(p.page_table[full], child.page_table[full])]
    assert tree_tokens(cache) == full * page_size
    # both hold the shared path: it survives the parent's release
    finish(cache, p)
    assert cache.evict(100) == 0
    finish(cache, child)
    assert cache.stats().pages_pinned == 0


# -- bad input and stale matches ----------------------------------------------------------


def test_bad_input_raises_and_leaves_the_cache_unchanged():
    cache = radix(num_pages=32, page_size=4)
    a = seq("a", range(12))
    run_prompt(cache, a)
    m = cache.match(a)  # match counts a lookup: made outside the unchanged block
    b = seq("b", range(12))
    with unchanged(cache):
        with pytest.raises(InvalidRequestError):
            cache.commit(a, 13)  # beyond the sequence
        with pytest.raises(InvalidRequestError):
            cache.grow(a, 100)
        with pytest.raises(InvalidRequestError):
            cache.evict(-1)
        with pytest.raises(InvalidRequestError):
            cache.admit(a, m, 12)  # already admitted
        with pytest.raises(UnknownSequenceError):
            cache.release(seq("ghost", [1, 2]))
        with pytest.raises(InvalidRequestError):
            cache.match("not a sequence")
        with pytest.raises(InvalidRequestError):
            cache.admit(b, m, 12)  # someone else's match
    with pytest.raises(InvalidRequestError):
        radix(eviction_policy="random")
    finish(cache, a)
    with pytest.raises(UnknownSequenceError):
        cache.release(a)


def test_a_match_whose_prefix_was_evicted_is_stale():
    cache = radix(num_pages=32, page_size=1)
    a = seq("a", range(10))
    run_prompt(cache, a)
    finish(cache, a)
    b = seq("b", range(12))
    m = cache.match(b)
    assert m.num_tokens == 10
    cache.evict(32)
    with unchanged(cache):
        with pytest.raises(StaleMatchError):
            cache.admit(b, m, 12)


def test_lock_sizes_are_exact_through_a_lifecycle():
    cache = radix(num_pages=64, page_size=1)
    a = seq("a", range(10))
    run_prompt(cache, a)
    assert cache.stats().extra["protected_tokens"] == 10
    b = seq("b", list(range(6)) + [70] * 4)
    run_prompt(cache, b)  # splits a's node at 6; [0,6) is locked twice
    ex = cache.stats().extra
    assert (ex["protected_tokens"], ex["evictable_tokens"]) == (14, 0)
    finish(cache, a)
    ex = cache.stats().extra
    assert (ex["protected_tokens"], ex["evictable_tokens"]) == (10, 4)
    finish(cache, b)
    ex = cache.stats().extra
    assert (ex["protected_tokens"], ex["evictable_tokens"]) == (0, 14)
    assert leaf_runs(cache) == [(6, 6), (6, 70)]  # a's tail (older), then b's


# -- page ids: nodes view the table that computed them (backends/radix_pages.py) ---------


def _views_of(cache: RadixCache, s: Sequence) -> list:
    """Nodes whose pages are a view of `s`'s table buffer (no copy of the ids)."""
    buf = s.page_table.array()
    return [n for n in cache.tree.nodes() if np.shares_memory(n.pages, buf)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_prefill_insert_views_the_table_and_the_ids_outlive_its_growth(page_size):
    cache = radix(page_size=page_size)
    a = seq("a", range(100, 100 + 40 * page_size))  # 40 pages: a leaf of 40 pages, a view
    run_prompt(cache, a)
    (leaf,) = _views_of(cache, a)
    assert leaf.lender is None and isinstance(a.page_table, PageTable)
    ids = list(a.page_table)
    assert leaf.pages.tolist() == ids[:40]
    for t in range(40 * page_size):  # decode 40 pages: the buffer is outgrown and copied
        a.append_token(t % 7)
        assert cache.grow(a, len(a)) is not None
    cache.check_invariants()
    assert not _views_of(cache, a) and leaf.pages.tolist() == ids[:40]
    assert a.page_table[: len(ids)] == ids
    finish(cache, a)  # check_invariants: contents, partition, owners
    assert a.page_table == [] and leaf.pages.tolist() == ids[:40]


def test_a_short_node_copies_its_ids_instead_of_pinning_a_long_table():
    cache = radix(page_size=1)
    a = seq("a", range(100, 160))
    run_prompt(cache, a)
    finish(cache, a)
    b = seq("b", list(range(100, 150)) + [1, 2, 3, 4, 5])  # hits 50 of 55: a 5-page leaf
    run_prompt(cache, b)
    (leaf,) = [n for n in cache.tree.nodes() if n.start == 50 and int(n.key[0]) == 1]
    assert leaf.pages.base is None and leaf.pages.tolist() == b.page_table[50:55]
    finish(cache, b)


def test_chunked_prefill_views_twice_and_both_nodes_keep_their_ids():
    cache = radix(page_size=4)
    a = seq("a", range(100, 124))
    m = cache.match(a)
    cache.admit(a, m, 8)
    cache.commit(a, 8)
    cache.grow(a, 24)
    cache.commit(a, 24)
    cache.check_invariants()
    first, second = sorted((n for n in cache.tree.nodes()), key=lambda n: n.start)
    assert (first.start, second.start) == (0, 8)
    pages = list(a.page_table)
    finish(cache, a)
    assert first.pages.tolist() + second.pages.tolist() == pages
    b = seq("b", range(100, 125))
    assert run_prompt(cache, b).num_tokens == 24
    finish(cache, b)


def test_a_viewed_node_split_by_another_request_keeps_its_ids_in_both_parts():
    cache = radix(page_size=1)
    a = seq("a", range(100, 120))
    run_prompt(cache, a)  # a's leaf views a's table; a runs on
    b = seq("b", list(range(100, 110)) + [7, 8, 9])
    assert run_prompt(cache, b).num_tokens == 10  # splits a's leaf at 10
    assert b.page_table[:10] == a.page_table[:10]
    pages = list(a.page_table)
    finish(cache, a)
    upper, lower = sorted((n for n in cache.tree.nodes() if int(n.key[0]) in (100, 110)), key=lambda n: n.start)
    assert upper.pages.tolist() + lower.pages.tolist() == pages[:20]
    finish(cache, b)
    assert cache.stats().pages_pinned == 0


def test_invariants_refuse_a_node_borrowing_from_no_live_table():
    from cachelib.errors import InvariantViolation

    cache = radix(page_size=1)
    a = seq("a", range(100, 120))
    run_prompt(cache, a)
    finish(cache, a)
    (node,) = list(cache.tree.nodes())
    node.lender, node.pages = cache.tree.page_ids(node), None  # borrows from a table nobody runs on
    with pytest.raises(InvariantViolation, match="borrows pages from a table"):
        cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_hot_prefix_builds_its_match_pages_once_and_they_follow_splits_and_evictions(page_size):
    """`match` keeps the page tuple of the path it ends on (`RadixCache._match_pages`, a few
    recent ends): the next match ending there hands out that very tuple, and a split above it,
    a split of the node itself or its eviction never lets a stale tuple out (the invariant
    check compares each kept tuple with its path's pages; admit proves a match against the
    tree)."""
    ps = page_size
    cache = radix(num_pages=64, page_size=ps)
    base = list(range(100, 100 + 8 * ps))
    run_prompt(cache, a := seq("a", base + [1]))
    finish(cache, a)
    m1 = cache.match(seq("b", base + [2]))
    m2 = cache.match(seq("c", base + [3]))
    assert m1.num_tokens == 8 * ps and m2.pages is m1.pages  # built once
    cache.check_invariants()
    # a request diverging after 3 pages splits the node the tuple was kept on: the upper part
    # is a new node, the kept tuple stays on the lower one, whose path still holds those pages
    run_prompt(cache, d := seq("d", base[: 3 * ps] + [7] * (2 * ps) + [9]))
    finish(cache, d)
    cache.check_invariants()
    m3 = cache.match(s3 := seq("e", base + [4]))
    assert m3.pages == m1.pages and m3.num_tokens == 8 * ps
    cache.admit(s3, m3, len(s3))  # proven against the tree
    assert list(s3.page_table)[:8] == list(m3.pages)
    cache.commit(s3, len(s3))
    finish(cache, s3)
    # a match ending inside the node splits it: the upper part builds its own tuple
    m4 = cache.match(seq("f", base[: 5 * ps] + [5] * ps))
    assert m4.num_tokens == 5 * ps and m4.pages == m1.pages[:5]
    cache.check_invariants()
    # evicted: the node's tuple is never handed out again; re-inserted, the new node builds its own
    cache.evict(64)
    assert cache.match(seq("g", base + [6])).num_tokens == 0
    run_prompt(cache, h := seq("h", base + [1]))
    finish(cache, h)
    m5 = cache.match(seq("i", base + [8]))
    assert m5.num_tokens == 8 * ps and m5.pages is not m1.pages  # the new node's own tuple
    cache.check_invariants()


def test_the_kept_match_pages_are_bounded_oldest_dropped_first():
    """Only the last few match ends keep their page tuple: memory stays a few paths however
    many nodes a large cache holds."""
    from backends.radix import _MATCH_PAGES_KEPT

    cache = radix(num_pages=512, page_size=1)
    prompts = [[1000 * (i + 1) + t for t in range(6)] for i in range(_MATCH_PAGES_KEPT + 3)]
    for i, p in enumerate(prompts):
        run_prompt(cache, s := seq(f"p{i}", p))
        finish(cache, s)
    ends = []
    for i, p in enumerate(prompts):
        m = cache.match(seq(f"q{i}", p + [7]))
        assert m.num_tokens == len(p)
        ends.append(m.handle)
    assert len(cache._match_pages) == _MATCH_PAGES_KEPT
    assert list(cache._match_pages) == ends[-_MATCH_PAGES_KEPT:]  # the oldest went first
    cache.check_invariants()


def test_a_policy_that_keeps_creation_state_must_declare_it():
    """The tree calls `created` only for a policy declaring `tracks_creation` (one call less
    per new node for the others): one that defines the hook without declaring it is refused
    where it is defined, not skipped silently; a declared one is called for every new node."""
    with pytest.raises(TypeError, match="tracks_creation"):

        class Forgetful(EvictionPolicy):  # noqa: F841 - defining it is the test
            __slots__ = ()
            name = "forgetful"

            def key(self, node):
                return (node.node_id, node)

            def created(self, node):
                node.policy_state = 0

    class Counting(EvictionPolicy):
        __slots__ = ("seen",)
        name = "counting"
        tracks_creation = True

        def __init__(self):
            self.seen = 0

        def key(self, node):
            return (node.last_access, node.node_id, node)

        def created(self, node):
            self.seen += 1

    policy = Counting()
    cache = build_tree(policy)
    assert policy.seen == cache.tree.num_nodes > 0
