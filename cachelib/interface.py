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

import numpy as np

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
        #: stamped on every `Match` this cache makes (`Match.owner`): one `is` tells a match
        #: from another cache instance apart before anything else is looked at
        self.match_token = object()

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

    # Every backend keeps its admitted sequences in a dict `request id -> state`, where the
    # state's `seq` is the exact `Sequence` object admit (or fork) was given. Calls find the
    # state by id and then insist on that object: a second `Sequence` carrying a live id
    # (another request, a re-created one) would otherwise grow, publish or free pages
    # through a table that is not its own.

    def _check_new(self, seq: Sequence, live: dict) -> None:
        if not isinstance(seq, Sequence) or not isinstance(seq.request_id, str):
            raise InvalidRequestError(f"expected a Sequence with a str request id, got {seq!r}")
        if seq.request_id in live:
            raise InvalidRequestError(f"request {seq.request_id!r} is already admitted")

    def _check_live(self, seq: Sequence, live: dict):
        """The live state of `seq`; raises unless `seq` is the very object admitted."""
        try:
            state = live[seq.request_id]
        except (AttributeError, KeyError, TypeError):
            state = None
        if state is None or state.seq is not seq:
            self._refuse_live(seq, live)
        return state

    def _refuse_live(self, seq: object, live: dict) -> None:
        """Raise the error that says why `seq` is not a live sequence of this cache."""
        if not isinstance(seq, Sequence) or not isinstance(seq.request_id, str):
            raise InvalidRequestError(f"expected a Sequence with a str request id, got {seq!r}")
        if seq.request_id not in live:
            raise UnknownSequenceError(f"request {seq.request_id!r} is not admitted (never, or already released)")
        raise InvalidRequestError(
            f"request {seq.request_id!r} is admitted as another Sequence object; pass the one given to admit/fork"
        )

    def _check_fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` must continue `parent`: its computed tokens, under the same extra keys
        (salt, LoRA, multimodal inputs change the KV, so a child under other keys cannot
        share a single page of it)."""
        computed = parent.num_computed
        if len(child) < computed or not np.array_equal(child.tokens[:computed], parent.tokens[:computed]):
            raise InvalidRequestError(
                f"fork: {child.request_id!r} does not hold {parent.request_id!r}'s computed tokens"
            )
        if child.extra is not parent.extra and child.extra != parent.extra:
            raise InvalidRequestError(
                f"fork: {child.request_id!r} has other extra keys than {parent.request_id!r} "
                f"({child.extra} vs {parent.extra}); its KV cannot come from the parent's"
            )

    def _check_num_tokens(self, seq: Sequence, num_tokens: int, lo: int) -> None:
        if type(num_tokens) is int and lo <= num_tokens <= len(seq):
            return  # the hot path: one type check, one comparison
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise InvalidRequestError(f"num_tokens must be an int, got {num_tokens!r}")
        raise InvalidRequestError(f"request {seq.request_id!r}: num_tokens {num_tokens} outside [{lo}, {len(seq)}]")

    def _check_match(self, seq: Sequence, match: Match) -> None:
        """Refuse a `Match` that does not describe `seq`'s prefix in this cache now.

        The generic part (type, request id, a sane token count and page tuple) is checked
        here; `_verify_match` then proves the hit against the backend's own index, so a
        match made for other tokens under the same id, by another cache, or forged can
        never pin a page that does not hold `seq`'s KV. A match made stale by the cache
        changing in between raises `StaleMatchError`.
        """
        if match.__class__ is not Match:
            raise InvalidRequestError(f"request {seq.request_id!r}: expected a Match, got {type(match).__name__}")
        rid, n, pages, handle, _, owner = match  # one unpack: this runs on every admit
        if rid != seq.request_id:
            raise InvalidRequestError(f"match does not belong to request {seq.request_id!r}")
        if owner is not self.match_token:
            raise InvalidRequestError(f"request {seq.request_id!r}: the match was made by another cache (or forged)")
        if (
            n.__class__ is not int
            or not 0 <= n < len(seq)
            or pages.__class__ is not tuple
            or len(pages) != -(-n // self.page_size)
        ):
            raise InvalidRequestError(
                f"request {seq.request_id!r}: match of {n!r} tokens over {len(pages) if isinstance(pages, tuple) else pages!r} "
                f"pages is not a match of this {len(seq)}-token sequence"
            )
        if n or (handle is not None and not (handle.__class__ is list and not handle)):
            # a hit, or a miss with a handle (radix's namespace root): neither may smuggle a
            # node or blocks of another cache, sequence or namespace into admit
            self._verify_match(seq, match)

    def _verify_match(self, seq: Sequence, match: Match) -> None:
        """Prove a match against the index (backends that reuse KV override this).

        Called for a hit (`num_tokens > 0`) and for a miss that carries a handle (None and
        an empty list are no handle). The default is for backends that never return either:
        such a match is another cache's, or forged."""
        raise InvalidRequestError(
            f"request {seq.request_id!r}: a {self.name} cache never reuses KV, but the match claims "
            f"{match.num_tokens} cached tokens / handle {match.handle!r:.40} (made by another cache, or forged)"
        )
