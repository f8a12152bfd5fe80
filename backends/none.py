"""none: the no-reuse baseline. Every request computes its whole prompt.

A page is free or pinned, never cached. `fork` copies every computed page (no sharing),
so memory-saved-by-sharing measurements have their zero. Pages are handed out in id order
and returned to the back of the free list (FIFO), which keeps runs reproducible.
"""

from __future__ import annotations

from cachelib.errors import InvalidRequestError, InvariantViolation
from cachelib.interface import PrefixCache
from cachelib.page_pool import FifoPagePool
from cachelib.registry import register_backend
from cachelib.types import CacheStats, CopyOp, Match, Sequence

_PAGE_BYTES = 4  # one int32 page id per table entry; no index at all


class _Held:
    """An admitted sequence (the exact object admitted: `_check_live` insists on it)."""

    __slots__ = ("seq",)

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq


@register_backend("none")
class NoCache(PrefixCache):
    """A plain page allocator with no prefix index."""

    decode_steps_are_noops = True  # nothing is ever published

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self._free = FifoPagePool(num_pages)
        self._live: dict[str, _Held] = {}
        self._counters = dict(lookups=0, lookup_tokens=0, admitted=0, admitted_tokens=0, copied_pages=0)

    def match(self, seq: Sequence) -> Match:
        if not isinstance(seq, Sequence):
            raise InvalidRequestError(f"expected a Sequence, got {type(seq).__name__}")
        self._counters["lookups"] += 1
        self._counters["lookup_tokens"] += len(seq)
        return Match(seq.request_id, 0, (), None, 0, self.match_token)

    def admit(self, seq: Sequence, match: Match, num_tokens: int) -> list[CopyOp] | None:
        self._check_new(seq, self._live)
        self._check_match(seq, match)
        self._check_num_tokens(seq, num_tokens, 1)
        need = self.pages_for(num_tokens)
        if need > len(self._free):
            return None
        seq.page_table = self._free.take(need)
        seq.num_computed = 0
        self._live[seq.request_id] = _Held(seq)
        self._counters["admitted"] += 1
        self._counters["admitted_tokens"] += len(seq)
        return []

    def grow(self, seq: Sequence, num_tokens: int) -> list[CopyOp] | None:
        self._check_live(seq, self._live)
        self._check_num_tokens(seq, num_tokens, 0)
        need = self.pages_for(num_tokens) - len(seq.page_table)
        if need > len(self._free):
            return None
        if need > 0:
            seq.page_table.extend(self._free.take(need))
        return []

    def commit(self, seq: Sequence, num_computed: int) -> None:
        self._check_live(seq, self._live)
        self._check_num_tokens(seq, num_computed, seq.num_computed)
        if num_computed > len(seq.page_table) * self.page_size:
            raise InvalidRequestError(f"request {seq.request_id!r}: {num_computed} tokens computed beyond its pages")
        seq.num_computed = num_computed

    def fork(self, parent: Sequence, child: Sequence) -> list[CopyOp] | None:
        self._check_live(parent, self._live)
        self._check_new(child, self._live)
        self._check_fork(parent, child)
        computed = parent.num_computed
        need = self.pages_for(computed)
        if need > len(self._free):
            return None
        child.page_table = self._free.take(need)
        child.num_computed = computed
        self._live[child.request_id] = _Held(child)
        self._counters["copied_pages"] += need
        return [CopyOp(src, dst) for src, dst in zip(parent.page_table, child.page_table, strict=False)]

    def release(self, seq: Sequence) -> None:
        self._check_live(seq, self._live)
        del self._live[seq.request_id]
        self._free.give(seq.page_table)

    def evict(self, num_pages: int) -> int:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise InvalidRequestError(f"evict: num_pages must be a non-negative int, got {num_pages!r}")
        return 0  # nothing is ever cached

    def stats(self) -> CacheStats:
        pinned = self.num_pages - len(self._free)
        return CacheStats(
            backend=self.name,
            num_pages=self.num_pages,
            page_size=self.page_size,
            pages_free=len(self._free),
            pages_pinned=pinned,
            metadata_bytes=pinned * _PAGE_BYTES,
            **self._counters,
        )

    def check_invariants(self) -> None:
        held = [p for h in self._live.values() for p in h.seq.page_table]
        everything = sorted(held + list(self._free))
        if everything != list(range(self.num_pages)):
            raise InvariantViolation("none: pages are lost, duplicated, or held twice")
        for rid, h in self._live.items():
            seq = h.seq
            if seq.request_id != rid:
                raise InvariantViolation(f"none: table keyed {rid!r} holds {seq.request_id!r}")
            if seq.num_computed > len(seq.page_table) * self.page_size:
                raise InvariantViolation(f"none: {rid} computed beyond its pages")
