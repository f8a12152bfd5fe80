"""The invariants every backend shares (docs/design.md §3), checked once for all of them.

A backend reports every page by state from its own structures (`_page_partition`); this
module proves, against those and the live tables:

- every page id is in range and exactly one of free / cached-unpinned / pinned, and
  free + cached + pinned = `num_pages`;
- `stats()` reports exactly those counts (its counters agree with the structures);
- the pinned pages are exactly the pages of live tables plus registrations (paged's
  declared prefixes): a pinned page is never free or cached, no page is pinned without a
  holder, so after every sequence is released only registrations stay pinned;
- each live state is keyed by its own request id, its table holds a page at most once,
  and no sequence has computed beyond the pages its table covers.

What is specific to a backend (ref counts, a tree's locks, a hash table) stays in its own
`_check_invariants`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachelib.errors import InvariantViolation

if TYPE_CHECKING:
    from cachelib.interface import PrefixCache


def check_shared(cache: PrefixCache) -> None:
    """Raise `InvariantViolation` (naming the backend) on the first broken shared invariant."""
    name = cache.name

    def fail(msg: str) -> None:
        raise InvariantViolation(f"{name}: {msg}")

    n = cache.num_pages
    state = [""] * n
    part = cache._page_partition()
    for what, pages in (("free", part.free), ("cached", part.cached), ("pinned", part.pinned)):
        for p in pages:
            if p.__class__ is not int or not 0 <= p < n:
                fail(f"{what} page {p!r} is not a page id in [0, {n})")
            if state[p]:
                fail(f"page {p} is both {state[p]} and {what}")
            state[p] = what
    if "" in state:
        fail(f"page {state.index('')} is neither free, cached nor pinned (lost)")

    s = cache.stats()
    counts = (len(part.free), len(part.cached), len(part.pinned))
    if (s.pages_free, s.pages_cached, s.pages_pinned) != counts:
        fail(f"stats free/cached/pinned {s.pages_free}/{s.pages_cached}/{s.pages_pinned}, actual {counts}")

    held = set(cache._registered_pages())
    for rid, live in cache._live.items():
        seq = live.seq
        if seq.request_id != rid:
            fail(f"state keyed {rid!r} holds {seq.request_id!r}")
        table = seq.page_table
        if len(set(table)) != len(table):
            fail(f"{rid}: a page appears twice in its table")
        if seq.num_computed > len(table) * cache.page_size:
            fail(f"{rid}: computed {seq.num_computed} tokens beyond its {len(table)} pages")
        held.update(table)
    if held != set(part.pinned):
        wrong = sorted(held.symmetric_difference(part.pinned))[:8]
        fail(f"pinned pages are not exactly those of live tables and registrations (e.g. {wrong})")
