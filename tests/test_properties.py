"""Random operation sequences against every registered backend (hypothesis).

A shadow KV store stands in for the GPU: every computed slot holds a value that identifies
the whole prefix up to it, as real KV does. After every step the backend's own invariants
are checked, and so is the shadow: every live sequence's computed tokens must read back
their own prefix through its page table, and every match must return pages holding exactly
the matched prefix. Copy-on-write bugs, wrong hits and lost pages all show up here.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cachelib import ExtraKeys, Sequence, available_backends, create_cache

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 7, 7], [4, 4, 4, 4, 4, 4], []]


def prefix_value(tokens: np.ndarray, t: int) -> bytes:
    """What the KV at position t holds: a function of tokens 0..t (causal attention)."""
    return hashlib.blake2b(tokens[: t + 1].tobytes(), digest_size=8).digest()


class CacheMachine(RuleBasedStateMachine):
    backend = "apc"
    page_size = 4
    num_pages = 10

    @initialize()
    def setup(self):
        self.cache = create_cache(self.backend, num_pages=self.num_pages, page_size=self.page_size)
        self.kv: dict[int, list[bytes | None]] = {}
        self.live: dict[str, Sequence] = {}
        self.counter = 0

    # -- shadow KV ------------------------------------------------------------------

    def _apply(self, ops):
        for op in ops:
            self.kv[op.dst_page] = list(self.kv.get(op.src_page, [None] * self.page_size))

    def _write(self, s: Sequence, upto: int):
        B = self.page_size
        toks = s.tokens
        for t in range(s.num_computed, upto):
            page = s.page_table[t // B]
            self.kv.setdefault(page, [None] * B)[t % B] = prefix_value(toks, t)

    def _reads_back(self, s: Sequence, pages, n: int) -> bool:
        B = self.page_size
        toks = s.tokens
        return all(self.kv.get(pages[t // B], [None] * B)[t % B] == prefix_value(toks, t) for t in range(n))

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    # -- operations -----------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 9), max_size=8),
        salt=st.sampled_from([None, None, "t1"]),
        partial=st.booleans(),
    )
    def admit(self, prefix, suffix, salt, partial):
        tokens = prefix + suffix
        if not tokens:
            tokens = [0]
        s = Sequence(self._new_id(), tokens, ExtraKeys(cache_salt=salt))
        m = self.cache.match(s)
        assert m.num_tokens <= len(s) - 1
        assert self._reads_back(s, m.pages, m.num_tokens), "match returned pages holding other KV"
        n = len(s) if not partial else max(m.num_tokens, 1, len(s) // 2)
        ops = self.cache.admit(s, m, n)
        if ops is None:
            return
        assert s.num_computed == m.num_tokens
        self._apply(ops)
        self.live[s.request_id] = s
        self._write(s, n)
        self.cache.commit(s, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 9), min_size=0, max_size=6))
    def grow(self, data, new):
        s = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda q: q.request_id)))
        s.append(new)
        ops = self.cache.grow(s, len(s))
        if ops is None:
            return
        self._apply(ops)
        self._write(s, len(s))
        self.cache.commit(s, len(s))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda q: q.request_id)))
        child = parent.fork(self._new_id())
        ops = self.cache.fork(parent, child)
        if ops is None:
            return
        self._apply(ops)
        assert child.num_computed == parent.num_computed
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        s = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda q: q.request_id)))
        self.cache.release(s)
        del self.live[s.request_id]

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        before = self.cache.stats().pages_cached
        freed = self.cache.evict(n)
        assert freed == min(n, before) or freed >= n
        assert self.cache.stats().pages_cached == before - freed

    # -- checks after every step -----------------------------------------------------

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        for s in self.live.values():
            assert self._reads_back(s, s.page_table, s.num_computed), f"{s.request_id} lost its KV"
        st_ = self.cache.stats()
        assert st_.pages_free + st_.pages_cached + st_.pages_pinned == self.num_pages

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for s in list(self.live.values()):
            self.cache.release(s)
        self.cache.check_invariants()
        assert self.cache.stats().pages_pinned == 0, "pages stay pinned after every sequence is released"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("backend", available_backends())
def test_random_operation_sequences(backend, page_size):
    machine = type(f"{backend}_{page_size}", (CacheMachine,), {"backend": backend, "page_size": page_size})
    machine.TestCase.settings = settings(
        max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
    )
    machine.TestCase().runTest()
