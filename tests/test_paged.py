"""paged backend: exact block ids for fork / copy-on-write / declared prefixes, bad input,
and a hypothesis state machine with invariants checked after every step."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backends.paged import PagedCache
from cachelib import (
    CopyOp,
    ExtraKeys,
    InvalidRequestError,
    Sequence,
    StaleMatchError,
    UnknownSequenceError,
    create_cache,
)
from cachelib.types import NO_EXTRA

PS = 4  # page size of the exact-id tests


def make(num_pages: int = 16, page_size: int = PS) -> PagedCache:
    cache = create_cache("paged", num_pages=num_pages, page_size=page_size)
    assert isinstance(cache, PagedCache)
    return cache


def run_prompt(cache: PagedCache, seq: Sequence) -> list[CopyOp]:
    """match -> admit the whole prompt -> commit it; returns admit's copies."""
    ops = cache.admit(seq, cache.match(seq), len(seq))
    assert ops is not None
    cache.commit(seq, len(seq))
    cache.check_invariants()
    return ops


def step(cache: PagedCache, seq: Sequence, token: int) -> list[CopyOp]:
    """One decode step: append a token, grow the table over it, write it."""
    seq.append([token])
    ops = cache.grow(seq, len(seq))
    assert ops is not None
    cache.commit(seq, len(seq))
    cache.check_invariants()
    return ops


def refs(cache: PagedCache, pages: list[int]) -> list[int]:
    return [cache.ref_count(p) for p in pages]


def assert_unchanged(cache: PagedCache, call, exc: type[Exception]) -> None:
    """`call()` raises `exc` and leaves stats, tables and invariants exactly as they were."""
    cache.check_invariants()
    before = (cache.stats(), list(cache._free), list(cache._ref), {k: list(t.blocks) for k, t in cache._live.items()})
    with pytest.raises(exc):
        call()
    after = (cache.stats(), list(cache._free), list(cache._ref), {k: list(t.blocks) for k, t in cache._live.items()})
    assert after == before
    cache.check_invariants()


# -- fork and copy-on-write -----------------------------------------------------------


def test_fork_then_append_to_both_copies_the_partial_block_once() -> None:
    cache = make()
    parent = Sequence("p", np.arange(10))
    assert run_prompt(cache, parent) == []
    assert parent.page_table == [0, 1, 2]  # 4 + 4 + 2 tokens: block 2 is partial
    child = parent.fork("c")
    assert cache.fork(parent, child) == []
    assert child.page_table == [0, 1, 2] and child.num_computed == 10
    assert refs(cache, [0, 1, 2]) == [2, 2, 2]
    cache.check_invariants()

    # the first writer into the shared partial block copies it; the last writes in place
    assert step(cache, parent, 100) == [CopyOp(2, 3)]
    assert parent.page_table == [0, 1, 3]
    assert step(cache, child, 200) == []
    assert child.page_table == [0, 1, 2]
    assert refs(cache, [0, 1, 2, 3]) == [2, 2, 1, 1]
    s = cache.stats()
    assert (s.copied_pages, s.pages_pinned, s.extra["shared_pages"]) == (1, 4, 2)

    # both fill their blocks and move on to private new blocks: no more copies
    assert step(cache, parent, 101) == [] and step(cache, child, 201) == []
    assert step(cache, parent, 102) == [] and parent.page_table == [0, 1, 3, 4]
    assert step(cache, child, 202) == [] and child.page_table == [0, 1, 2, 5]
    assert cache.stats().copied_pages == 1

    # releasing the parent frees only its private blocks; the child's stay intact
    cache.release(parent)
    cache.check_invariants()
    assert child.page_table == [0, 1, 2, 5]
    assert refs(cache, [0, 1, 2, 5, 3, 4]) == [1, 1, 1, 1, 0, 0]
    assert list(cache._free)[-2:] == [3, 4]
    assert cache.stats().pages_pinned == 4
    cache.release(child)
    cache.check_invariants()
    assert cache.stats().pages_free == 16 and cache.stats().pages_pinned == 0


def test_child_writes_first_then_parent_keeps_original() -> None:
    cache = make()
    parent = Sequence("p", np.arange(6))
    run_prompt(cache, parent)
    child = parent.fork("c")
    cache.fork(parent, child)
    assert step(cache, child, 7) == [CopyOp(1, 2)]
    assert (parent.page_table, child.page_table) == ([0, 1], [0, 2])
    assert step(cache, parent, 8) == []
    assert refs(cache, [0, 1, 2]) == [2, 1, 1]


def test_fork_at_a_block_boundary_never_copies() -> None:
    cache = make()
    parent = Sequence("p", np.arange(8))
    run_prompt(cache, parent)
    children = [parent.fork(f"c{i}") for i in range(3)]
    for c in children:
        assert cache.fork(parent, c) == []
    assert refs(cache, [0, 1]) == [4, 4]
    ops = [step(cache, s, 50 + i) for i, s in enumerate([parent, *children])]
    assert ops == [[], [], [], []]
    assert [s.page_table[-1] for s in [parent, *children]] == [2, 3, 4, 5]


def test_fork_of_a_fork_shares_through_the_chain() -> None:
    cache = make()
    a = Sequence("a", np.arange(5))
    run_prompt(cache, a)
    b = a.fork("b")
    cache.fork(a, b)
    c = b.fork("c")
    cache.fork(b, c)
    assert refs(cache, [0, 1]) == [3, 3]
    assert step(cache, a, 9) == [CopyOp(1, 2)]
    assert step(cache, b, 9) == [CopyOp(1, 3)]
    assert step(cache, c, 9) == []  # the last holder of block 1 writes in place
    assert [a.page_table, b.page_table, c.page_table] == [[0, 2], [0, 3], [0, 1]]


def test_fork_while_parent_holds_a_write_grant_copies_for_the_child() -> None:
    cache = make()
    parent = Sequence("p", np.arange(6))
    run_prompt(cache, parent)
    parent.append([40])
    assert cache.grow(parent, 7) == []  # parent may now write slot 6 of block 1 in place
    child = Sequence("c", parent.tokens[:6])
    assert cache.fork(parent, child) == [CopyOp(1, 2)]
    assert (parent.page_table, child.page_table) == ([0, 1], [0, 2])
    cache.check_invariants()
    cache.commit(parent, 7)
    assert step(cache, child, 41) == []


def test_grow_returns_none_when_the_copy_does_not_fit() -> None:
    cache = make(num_pages=2)
    parent = Sequence("p", np.arange(6))
    run_prompt(cache, parent)
    child = parent.fork("c")
    cache.fork(parent, child)
    parent.append([9])
    before = cache.stats()
    assert cache.grow(parent, 7) is None
    assert cache.stats() == before and parent.page_table == [0, 1]
    cache.check_invariants()
    cache.release(child)
    assert cache.grow(parent, 7) == []  # sole holder now: writes in place


def test_commit_into_a_shared_block_without_grow_is_refused() -> None:
    cache = make()
    parent = Sequence("p", np.arange(6))
    run_prompt(cache, parent)
    child = parent.fork("c")
    cache.fork(parent, child)
    child.append([3])
    assert_unchanged(cache, lambda: cache.commit(child, 7), InvalidRequestError)


# -- beam search through fork and release only -----------------------------------------


def test_beam_search_width_4_over_10_steps_frees_everything() -> None:
    width, steps = 4, 10
    cache = make(num_pages=64)
    rng = np.random.default_rng(7)
    root = Sequence("beam", rng.integers(0, 1000, 9))
    run_prompt(cache, root)
    beams = [root]
    names = itertools.count()
    max_shared = 0
    for t in range(steps):
        # top-k keeps favour the best beams: parents drawn with weight 2^-rank
        w = 0.5 ** np.arange(len(beams))
        parents = np.sort(rng.choice(len(beams), size=width, p=w / w.sum()))
        kept: list[Sequence] = []
        for i, beam in enumerate(beams):
            k = int((parents == i).sum())
            for _ in range(k - 1):  # extra continuations of this beam are forks
                child = beam.fork(f"beam.{next(names)}")
                assert cache.fork(beam, child) is not None
                cache.check_invariants()
                kept.append(child)
            if k:
                kept.append(beam)
        for beam in beams:
            if not (parents == beams.index(beam)).any():
                cache.release(beam)  # pruned
                cache.check_invariants()
        beams = kept
        assert len(beams) == width
        for j, beam in enumerate(beams):
            step(cache, beam, 1000 + 10 * t + j)
        max_shared = max(max_shared, cache.stats().extra["shared_pages"])
        logical = sum(len(b.page_table) for b in beams)
        assert cache.stats().pages_pinned < logical  # sharing saves blocks
    assert max_shared > 0
    for beam in beams:
        cache.release(beam)
        cache.check_invariants()
    s = cache.stats()
    assert (s.pages_free, s.pages_pinned) == (64, 0)
    assert all(cache.ref_count(p) == 0 for p in range(64))


# -- declared prefixes --------------------------------------------------------------


def declare(cache: PagedCache, tokens, extra: ExtraKeys = NO_EXTRA) -> int:
    pid = cache.register_prefix(tokens, extra)
    assert pid is not None
    pseq = cache.prefix_sequence(pid)
    cache.commit(pseq, len(pseq))  # the engine computed its KV into prefix_pages(pid)
    cache.check_invariants()
    return pid


def test_declared_prefix_maps_first_blocks_and_copies_the_partial_one() -> None:
    cache = make()
    system = np.arange(100, 110)  # 10 tokens: blocks 0, 1 full, block 2 partial
    pid = declare(cache, system)
    assert cache.prefix_pages(pid) == (0, 1, 2)
    assert cache.stats().pages_pinned == 3 and cache.stats().extra["prefix_pages_idle"] == 3
    r1 = Sequence("r1", np.concatenate([system, [1, 2, 3, 4, 5]]), prefix_id=pid)
    m = cache.match(r1)
    assert (m.num_tokens, m.pages) == (10, (0, 1, 2))
    assert cache.admit(r1, m, len(r1)) == [CopyOp(2, 3)]
    assert r1.page_table == [0, 1, 3, 4] and r1.num_computed == 10
    cache.commit(r1, len(r1))
    r2 = Sequence("r2", np.concatenate([system, [9, 9]]), prefix_id=pid)
    assert run_prompt(cache, r2) == [CopyOp(2, 5)]
    assert r2.page_table == [0, 1, 5]
    assert refs(cache, [0, 1, 2]) == [3, 3, 1]  # the registration keeps the original
    s = cache.stats()
    assert (s.hit_tokens, s.pages_cached, s.extra["prefix_pages_idle"]) == (20, 0, 1)
    cache.release(r1)
    cache.release(r2)
    cache.check_invariants()
    assert cache.stats().pages_pinned == 3  # only the registered prefix stays pinned
    cache.unregister_prefix(pid)
    cache.check_invariants()
    assert cache.stats().pages_pinned == 0


def test_prefix_on_a_block_boundary_and_prompt_equal_to_prefix() -> None:
    cache = make()
    system = np.arange(8)
    pid = declare(cache, system)
    r = Sequence("r", np.concatenate([system, [50, 51]]), prefix_id=pid)
    assert run_prompt(cache, r) == [] and r.page_table == [0, 1, 2]
    same = Sequence("same", system, prefix_id=pid)  # whole prompt is the prefix
    m = cache.match(same)
    assert m.num_tokens == 7  # the last token is always recomputed, for its logits
    assert cache.admit(same, m, 8) == [CopyOp(1, 3)]
    assert same.page_table == [0, 3]


def test_undeclared_repeats_and_uncomputed_prefixes_are_not_hits() -> None:
    cache = make()
    a = Sequence("a", np.arange(12))
    run_prompt(cache, a)
    cache.release(a)
    b = Sequence("b", np.arange(12))
    assert cache.match(b).num_tokens == 0  # no automatic detection, by design
    pid = cache.register_prefix(np.arange(8))
    c = Sequence("c", np.arange(12), prefix_id=pid)
    assert cache.match(c).num_tokens == 0  # its KV is not computed yet
    cache.commit(cache.prefix_sequence(pid), 8)
    assert cache.match(c).num_tokens == 8


def test_unregister_while_in_use_defers_the_free() -> None:
    cache = make()
    pid = declare(cache, np.arange(6))
    r = Sequence("r", np.arange(9), prefix_id=pid)
    run_prompt(cache, r)
    stale = cache.match(Sequence("late", np.arange(9), prefix_id=pid))
    cache.unregister_prefix(pid)
    cache.check_invariants()
    assert r.page_table == [0, 2, 3] and refs(cache, [0, 1]) == [1, 0]
    assert cache.stats().pages_pinned == 3
    with pytest.raises(StaleMatchError):
        cache.admit(Sequence("late", np.arange(9), prefix_id=pid), stale, 9)
    with pytest.raises(InvalidRequestError, match="unknown prefix"):
        cache.match(Sequence("late", np.arange(9), prefix_id=pid))
    cache.release(r)
    assert cache.stats().pages_pinned == 0
    cache.check_invariants()


def test_register_prefix_that_does_not_fit_changes_nothing() -> None:
    cache = make(num_pages=2)
    before = cache.stats()
    assert cache.register_prefix(np.arange(9)) is None
    assert cache.stats() == before


# -- bad input ------------------------------------------------------------------------


def test_bad_input_raises_and_leaves_the_cache_unchanged() -> None:
    cache = make()
    pid = declare(cache, np.arange(6), ExtraKeys(cache_salt="t1"))
    live = Sequence("live", np.arange(6))
    run_prompt(cache, live)
    gone = Sequence("gone", np.arange(5))
    run_prompt(cache, gone)
    cache.release(gone)

    unknown = Sequence("u", np.arange(9), ExtraKeys(cache_salt="t1"), prefix_id=99)
    assert_unchanged(cache, lambda: cache.match(unknown), InvalidRequestError)
    wrong = Sequence("w", np.arange(1, 10), ExtraKeys(cache_salt="t1"), prefix_id=pid)
    assert_unchanged(cache, lambda: cache.match(wrong), InvalidRequestError)
    short = Sequence("s", np.arange(4), ExtraKeys(cache_salt="t1"), prefix_id=pid)
    assert_unchanged(cache, lambda: cache.match(short), InvalidRequestError)
    other_tenant = Sequence("o", np.arange(9), ExtraKeys(cache_salt="t2"), prefix_id=pid)
    assert_unchanged(cache, lambda: cache.match(other_tenant), InvalidRequestError)
    assert_unchanged(cache, lambda: cache.fork(gone, gone.fork("g2")), UnknownSequenceError)
    assert_unchanged(cache, lambda: cache.release(gone), UnknownSequenceError)
    assert_unchanged(cache, lambda: cache.fork(live, Sequence("x", np.arange(1, 7))), InvalidRequestError)
    assert_unchanged(cache, lambda: cache.fork(live, live), InvalidRequestError)
    assert_unchanged(cache, lambda: cache.release(cache.prefix_sequence(pid)), InvalidRequestError)
    assert_unchanged(cache, lambda: cache.unregister_prefix(99), InvalidRequestError)
    assert_unchanged(cache, lambda: cache.evict(-1), InvalidRequestError)
    assert_unchanged(cache, lambda: cache.register_prefix([]), InvalidRequestError)
    assert cache.evict(5) == 0


def test_without_sharing_paged_hands_out_the_same_pages_as_none() -> None:
    caches = [create_cache(n, num_pages=12, page_size=PS) for n in ("none", "paged")]
    tables = []
    for cache in caches:
        seqs = [Sequence(f"r{i}", np.arange(3 + 2 * i)) for i in range(4)]
        for s in seqs[:3]:
            cache.admit(s, cache.match(s), len(s))
        cache.release(seqs[1])
        cache.admit(seqs[3], cache.match(seqs[3]), len(seqs[3]))
        tables.append([s.page_table for s in seqs])
    assert tables[0] == tables[1]


# -- hypothesis state machine --------------------------------------------------------


class PagedMachine(RuleBasedStateMachine):
    """Random admit / fork / decode / commit / release / evict / prefix calls, invariants
    checked after every step; at teardown nothing but registered prefixes stays pinned."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedCache(num_pages=24, page_size=3)
        self.live: list[Sequence] = []
        self.prefixes: dict[int, np.ndarray] = {}
        self.names = itertools.count()

    def _name(self) -> str:
        return f"s{next(self.names)}"

    @rule(length=st.integers(1, 14), data=st.data())
    def admit(self, length: int, data) -> None:
        tokens = np.array(data.draw(st.lists(st.integers(0, 5), min_size=length, max_size=length)), dtype=np.int32)
        pid = None
        if self.prefixes and data.draw(st.booleans()):
            pid = data.draw(st.sampled_from(sorted(self.prefixes)))
            tokens = np.concatenate([self.prefixes[pid], tokens])
        seq = Sequence(self._name(), tokens, prefix_id=pid)
        m = self.cache.match(seq)
        n = data.draw(st.integers(max(m.num_tokens, 1), len(seq)))
        if self.cache.admit(seq, m, n) is not None:
            assert seq.num_computed == m.num_tokens
            self.cache.commit(seq, n)
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(self.live))
        child = Sequence(self._name(), parent.tokens[: parent.num_computed] if parent.num_computed else [0])
        if parent.num_computed == 0:
            return
        before = self.cache.stats().pages_pinned
        ops = self.cache.fork(parent, child)
        if ops is not None:
            assert self.cache.stats().pages_pinned == before + len(ops)
            self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 5))
    def decode(self, data, k: int) -> None:
        seq = data.draw(st.sampled_from(self.live))
        if len(seq) < seq.num_computed + k:
            seq.append(np.full(seq.num_computed + k - len(seq), 7))
        ops = self.cache.grow(seq, seq.num_computed + k)
        if ops is not None:
            for op in ops:  # the writer got a private copy; the original is still held
                assert self.cache.ref_count(op.dst_page) == 1 and self.cache.ref_count(op.src_page) >= 1
            self.cache.commit(seq, seq.num_computed + data.draw(st.integers(0, k)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.cache.release(seq)

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        assert self.cache.evict(n) == 0

    @rule(length=st.integers(1, 8), data=st.data())
    def register(self, length: int, data) -> None:
        tokens = np.array(data.draw(st.lists(st.integers(0, 5), min_size=length, max_size=length)), dtype=np.int32)
        pid = self.cache.register_prefix(tokens)
        if pid is not None:
            pseq = self.cache.prefix_sequence(pid)
            self.cache.commit(pseq, len(pseq))
            self.prefixes[pid] = tokens

    @precondition(lambda self: self.prefixes)
    @rule(data=st.data())
    def unregister(self, data) -> None:
        pid = data.draw(st.sampled_from(sorted(self.prefixes)))
        del self.prefixes[pid]
        self.cache.unregister_prefix(pid)

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()

    def teardown(self) -> None:
        for seq in self.live:
            self.cache.release(seq)
            self.cache.check_invariants()
        s = self.cache.stats()
        assert s.pages_pinned == sum(self.cache.pages_for(t.size) for t in self.prefixes.values())
        for pid in list(self.prefixes):
            self.cache.unregister_prefix(pid)
        assert self.cache.stats().pages_pinned == 0
        self.cache.check_invariants()


TestPagedMachine = PagedMachine.TestCase
TestPagedMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
