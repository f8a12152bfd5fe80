"""none: the no-reuse baseline. Every request computes its whole prompt.

A page is free or pinned, never cached. `fork` copies every computed page (no sharing),
so memory-saved-by-sharing measurements have their zero. Pages are handed out in id order
and returned to the back of the free list (FIFO), which keeps runs reproducible.
"""

from __future__ import annotations

from cachelib.interface import LiveState, Occupancy, PagePartition, PrefixCache
from cachelib.page_pool import FifoPagePool
from cachelib.registry import register_backend
from cachelib.types import CopyOp, Match, Sequence

_PAGE_BYTES = 4  # one int32 page id per table entry; no index at all


@register_backend("none")
class NoCache(PrefixCache):
    """A plain page allocator with no prefix index."""

    decode_steps_are_noops = True  # nothing is ever published
    commit_publishes_decode = False  # (nor when a decode step fills a page)
    emits_kv_events = False  # so no KV events: a router that needs them is refused

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self._free = FifoPagePool(num_pages)

    def _match(self, seq: Sequence) -> tuple[int, tuple[int, ...], None]:
        return 0, (), None

    def _can_admit(self, seq: Sequence, match: Match, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= len(self._free)

    def _admit(self, seq: Sequence, match: Match, num_tokens: int) -> tuple[LiveState, list[CopyOp]] | None:
        if not self._can_admit(seq, match, num_tokens):
            return None
        seq.page_table = self._free.take(self.pages_for(num_tokens))
        seq.num_computed = 0
        return LiveState(seq), []

    def _grow(self, seq: Sequence, state: LiveState, num_tokens: int) -> list[CopyOp] | None:
        need = self.pages_for(num_tokens) - len(seq.page_table)
        if need > len(self._free):
            return None
        if need > 0:
            seq.page_table.extend(self._free.take(need))
        return []

    def _commit(self, seq: Sequence, state: LiveState, num_computed: int) -> None:
        seq.num_computed = num_computed

    def _fork(self, parent: Sequence, state: LiveState, child: Sequence) -> tuple[LiveState, list[CopyOp]] | None:
        computed = parent.num_computed
        need = self.pages_for(computed)
        if need > len(self._free):
            return None
        child.page_table = self._free.take(need)
        child.num_computed = computed
        return LiveState(child), [
            CopyOp(src, dst) for src, dst in zip(parent.page_table, child.page_table, strict=False)
        ]

    def _release(self, seq: Sequence, state: LiveState) -> None:
        self._free.give(seq.page_table)

    def _evict(self, num_pages: int) -> int:
        return 0  # nothing is ever cached

    def pages_pinned(self) -> int:
        return self.num_pages - len(self._free)  # O(1): engines ask every step; no Occupancy built

    def pages_free(self) -> int:
        return len(self._free)

    def _occupancy(self) -> Occupancy:
        pinned = self.num_pages - len(self._free)
        return Occupancy(pages_free=len(self._free), pages_cached=0, metadata_bytes=pinned * _PAGE_BYTES, extra={})

    def _page_partition(self) -> PagePartition:
        return PagePartition(
            free=list(self._free), cached=[], pinned=[p for s in self._live.values() for p in s.seq.page_table]
        )

    def _check_invariants(self) -> None:
        pass  # a page table and a free list: the shared partition check is all there is
