"""paged's own invariants, checked for real: ref counts recomputed from every table and
registration, no writable block with a second holder, and all holders of a shared block
agreeing on its position and content. (Free and held blocks disjoint and together every page
is the shared partition check, `cachelib.invariants`.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cachelib.errors import InvariantViolation

if TYPE_CHECKING:
    from backends.paged import PagedCache, _Table


def check_paged(cache: PagedCache) -> None:
    """Raise `InvariantViolation` on the first broken invariant of `cache`."""

    def fail(msg: str) -> None:
        raise InvariantViolation(f"paged: {msg}")

    ps = cache.page_size
    tables = list(cache._live.items()) + [(p.table.seq.request_id, p.table) for p in cache._prefixes.values()]
    holders: list[list[tuple[_Table, int]]] = [[] for _ in range(cache.num_pages)]
    for rid, t in tables:
        seq = t.seq
        if seq.page_table != t.blocks:
            fail(f"{rid}: page table {seq.page_table} differs from its blocks {t.blocks}")
        if not seq.num_computed <= t.granted <= len(t.blocks) * ps:
            fail(f"{rid}: computed {seq.num_computed} <= granted {t.granted} <= covered {len(t.blocks) * ps} broken")
        if len(set(t.blocks)) != len(t.blocks):
            fail(f"{rid}: a block appears twice in one table")
        for i, b in enumerate(t.blocks):
            if not 0 <= b < cache.num_pages:
                fail(f"{rid}: block id {b} out of range")
            holders[b].append((t, i))
    # no shared block may be written: every block overlapping a table's granted window
    # [num_computed, granted) has that table as its only holder (counted afresh here)
    for rid, t in tables:
        lo = t.seq.num_computed
        for i in range(lo // ps, cache.pages_for(t.granted) if t.granted > lo else 0):
            if len(holders[t.blocks[i]]) > 1:
                fail(f"{rid}: block {t.blocks[i]} is granted for writing but has {len(holders[t.blocks[i]])} holders")
    for b in range(cache.num_pages):
        if cache._ref[b] != len(holders[b]):
            fail(f"block {b}: ref {cache._ref[b]} but held by {len(holders[b])} tables/prefixes")
        _check_content(cache, b, holders[b], fail)
    for pid, p in cache._prefixes.items():
        if len(p.table.blocks) != cache.pages_for(p.tokens.size) or p.prefix_id != pid:
            fail(f"prefix {pid}: {len(p.table.blocks)} blocks for {p.tokens.size} tokens")


def _check_content(cache: PagedCache, block: int, holders: list[tuple[_Table, int]], fail) -> None:
    """Every holder of a shared block maps it at the same position, and the tokens whose
    KV is in it (each holder's computed slots) agree on the slots they have in common."""
    if len(holders) < 2:
        return
    ps = cache.page_size
    positions = {i for _, i in holders}
    if len(positions) != 1:
        fail(f"block {block} sits at table positions {sorted(positions)}: KV depends on position")
    (i,) = positions
    start = i * ps
    common = min(min(t.seq.num_computed, start + ps) for t, _ in holders) - start
    if common <= 0:
        return
    first = holders[0][0].seq.tokens[start : start + common]
    for t, _ in holders[1:]:
        if not np.array_equal(t.seq.tokens[start : start + common], first):
            fail(f"block {block} is shared by sequences whose tokens differ in it")
