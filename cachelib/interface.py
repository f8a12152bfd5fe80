"""The `PrefixCache` contract every backend implements (DESIGN §3).

A cache owns `num_pages` physical pages of `page_size` token slots and the index that says
which pages hold the KV of which token prefix. It never touches tensors: it hands out page
ids and asks the executor, through `CopyOp`s, to copy a page before it is written.

Every call either succeeds or leaves the cache exactly as it was (an error, or `None` for
"does not fit"). Calls on one sequence come in this order::

    m = cache.match(seq)              # read-only lookup
    cache.admit(seq, m, n)            # pin the hit, allocate pages for n tokens
    cache.commit(seq, k)              # KV of the first k tokens is written: publish it
    cache.grow(seq, n2); cache.commit(seq, k2) ...   # decode / next prefill chunk
    cache.release(seq)                # finished or preempted
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from cachelib.errors import InvalidRequestError, UnknownSequenceError
from cachelib.types import CacheStats, CopyOp, Match, Sequence


class PrefixCache(ABC):
    """Abstract prefix cache over a pool of `num_pages` pages of `page_size` tokens."""

    #: registry name (`--backend NAME`)
    name: ClassVar[str] = "abstract"
    #: True when, for a sequence whose page table already holds its next generated token,
    #: `grow` is a no-op and `commit` publishes nothing before the page fills. An engine may
    #: then batch those decode steps: it calls `commit` before the next `grow`, `fork` or
    #: `release` of the sequence. False (the safe default) = call both every step.
    decode_steps_are_noops: ClassVar[bool] = False

    def __init__(self, num_pages: int, page_size: int) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise InvalidRequestError(f"page_size must be a positive int, got {page_size!r}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise InvalidRequestError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self.page_size = page_size

    # -- the contract ---------------------------------------------------------------

    @abstractmethod
    def match(self, seq: Sequence) -> Match:
        """Longest cached prefix of `seq` that can be reused. Pins nothing.

        At most `len(seq) - 1` tokens: the last token is always computed, for its logits.
        A backend may reorganise its index (split a node, refresh recency); it never
        changes which pages are free, cached or pinned.
        """

    @abstractmethod
    def admit(self, seq: Sequence, match: Match, num_tokens: int) -> list[CopyOp] | None:
        """Pin `match`'s pages and allocate pages so the table covers `num_tokens` tokens.

        Evicts unpinned cached pages as the design does. Returns the copies the executor
        must do first, or `None` (and changes nothing) when the pages do not fit.
        Raises `StaleMatchError` if the cache evicted since `match` was made.
        """

    @abstractmethod
    def grow(self, seq: Sequence, num_tokens: int) -> list[CopyOp] | None:
        """Extend an admitted sequence's table to cover `num_tokens` tokens; `None` if no room."""

    @abstractmethod
    def commit(self, seq: Sequence, num_computed: int) -> None:
        """The KV of the first `num_computed` tokens is written; publish what the design publishes."""

    @abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> list[CopyOp] | None:
        """Let `child` continue from `parent`'s computed tokens and KV (sampling, beam search).

        `child` must hold the parent's tokens and must not be admitted. Returns the copies
        to do, or `None` when the pages for them do not fit.
        """

    @abstractmethod
    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: unpin its pages. Releasing twice raises."""

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` unpinned cached pages if there are that many; returns
        how many were freed. `evict(0)` is always safe and frees nothing."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """Counters and occupancy. Read-only."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise `InvariantViolation` on any broken invariant. Read-only, O(size of cache)."""

    def pages_pinned(self) -> int:
        """Pages held by live sequences (or pinned registrations): `stats().pages_pinned`.
        Engines ask this every step; a backend whose `stats()` is not O(1) overrides it."""
        return self.stats().pages_pinned

    def pages_reclaimable(self) -> int:
        """Pages an allocation can get without touching a live sequence: free + cached."""
        st = self.stats()
        return st.pages_free + st.pages_cached

    # -- helpers for backends ---------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def _check_new(self, seq: Sequence, live: dict) -> None:
        if not isinstance(seq, Sequence):
            raise InvalidRequestError(f"expected a Sequence, got {type(seq).__name__}")
        if seq.request_id in live:
            raise InvalidRequestError(f"request {seq.request_id!r} is already admitted")

    def _check_live(self, seq: Sequence, live: dict):
        state = live.get(seq.request_id)
        if state is None:
            raise UnknownSequenceError(f"request {seq.request_id!r} is not admitted (never, or already released)")
        return state

    def _check_num_tokens(self, seq: Sequence, num_tokens: int, lo: int) -> None:
        if type(num_tokens) is int and lo <= num_tokens <= len(seq):
            return  # the hot path: one type check, one comparison
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise InvalidRequestError(f"num_tokens must be an int, got {num_tokens!r}")
        raise InvalidRequestError(f"request {seq.request_id!r}: num_tokens {num_tokens} outside [{lo}, {len(seq)}]")

    def _check_match(self, seq: Sequence, match: Match) -> None:
        if not isinstance(match, Match) or match.request_id != seq.request_id:
            raise InvalidRequestError(f"match does not belong to request {seq.request_id!r}")
