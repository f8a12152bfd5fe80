"""radix: SGLang RadixAttention (reference: SGLang 0.5.x `RadixCache` and its scheduler calls).

The tree (`backends/radix_tree.py`) holds runs of tokens and their pages; this module is the
`PrefixCache` contract over it and a pool of pages. What it reproduces:

- `match`: the prompt's first `len - 1` tokens, rounded down to whole pages, walked from
  the namespace's root; stamps the path (logical clock) and splits the node where the match
  ends (`match_prefix`).
- `admit`: locks the matched node up to the root (`inc_lock_ref`) and allocates pages for
  the rest. When free pages are short it asks the tree to evict the *whole* number of new
  pages, not the shortfall, as SGLang's prefill allocation does (`evict(extend_tokens)`).
  All or nothing: `None` when free + evictable-off-this-path pages cannot cover it.
- `commit(seq, n)`: inserts the full pages of the first `n` tokens (`cache_unfinished_req`
  after prefill, the finish-time insert at the end). Pages the request computed for tokens
  the tree already held are duplicates: they are freed and the request's table is pointed
  at the tree's pages (same tokens, same prefix, hence the same KV), and the lock moves to
  the node ending at the inserted prefix. The partial last page stays private.
- `grow`: decode pages; when short, evicts the shortfall, which is what SGLang's
  one-token-at-a-time decode allocation adds up to for one request.
- `release`: unlocks (`dec_lock_ref`) and frees the private pages (the unaligned tail and
  anything not committed). `evict(n)` pops unlocked leaves in policy order.
- `fork`: inserts the parent's computed full pages, locks them for the child too, and
  copies only a partial last page (`CopyOp`).

Deviation on purpose: SGLang's paged allocator adds one page per request to its eviction
threshold and amount (`extend + page_size` tokens); at `page_size > 1` this backend uses
the exact page need, the same rule as at page size 1, so backends compare at equal memory.
"""

from __future__ import annotations

import numpy as np

from backends.radix_tree import EVICTION_POLICIES, RadixNode, RadixTree
from cachelib.errors import InvalidRequestError, StaleMatchError
from cachelib.interface import PrefixCache
from cachelib.registry import register_backend
from cachelib.types import CacheStats, CopyOp, Match, Sequence

# Modelled bytes of index metadata, as a compact native tree would keep it: per node
# parent/child links, lock ref, clock stamps, hit count (48); per token its id (4); per page
# its id (4).
_NODE_BYTES = 48
_TOKEN_BYTES = 4
_PAGE_ID_BYTES = 4


class _Held:
    """An admitted sequence: the node its lock hangs on and how many leading tokens that
    path covers (SGLang's `last_node` and `cache_protected_len`)."""

    __slots__ = ("seq", "node", "protected")

    def __init__(self, seq: Sequence, node: RadixNode, protected: int) -> None:
        self.seq = seq
        self.node = node
        self.protected = protected


@register_backend("radix")
class RadixCache(PrefixCache):
    """SGLang RadixAttention over `num_pages` pages of `page_size` tokens.

    `eviction_policy`: `lru` (default), `lfu`, `fifo`, `mru`, `filo`. `track_contents=True`
    records which token each page slot was written with, so `check_invariants` can prove
    that tree entries point only at pages holding their tokens (tests; it costs time).
    """

    decode_steps_are_noops = True  # decode tokens enter the tree at release, as in SGLang

    def __init__(
        self, num_pages: int, page_size: int, *, eviction_policy: str = "lru", track_contents: bool = False
    ) -> None:
        super().__init__(num_pages, page_size)
        if not isinstance(eviction_policy, str):
            raise InvalidRequestError(
                f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {eviction_policy!r}"
            )
        self.tree = RadixTree(page_size, eviction_policy)
        self.eviction_policy = self.tree.policy
        # Free pages: runs of recycled page ids (an evicted node's page list moves here whole,
        # so eviction does no per-page work), then the never-used ids `fresh..num_pages-1`,
        # created only when first handed out (an unlimited pool costs nothing up front).
        self._free_runs: list[list[int]] = []
        self._fresh = 0
        self._num_free = num_pages
        self._live: dict[str, _Held] = {}
        self._counters = dict(
            lookups=0, lookup_tokens=0, admitted=0, admitted_tokens=0, hit_tokens=0, evicted_pages=0, copied_pages=0
        )
        self._contents = np.full(num_pages * page_size, -1, dtype=np.int64) if track_contents else None

    # -- pages ------------------------------------------------------------------------

    def _take(self, n: int) -> list[int]:
        """Hand out `n` free pages (the caller checked there are that many): recycled first.

        Page order within a table is free to choose, so runs are joined by copying the
        shorter list into the longer one: the per-page work is the smaller side only.
        """
        if n <= 0:
            return []
        self._num_free -= n
        runs = self._free_runs
        out: list[int] = []
        while n and runs:
            run = runs[-1]
            k = len(run)
            if k <= n:
                runs.pop()
                n -= k
            elif n <= k - n:
                part = run[-n:]
                del run[-n:]
                run, n = part, 0
            else:  # keep the short remainder in the pool, hand out the long rest in place
                runs[-1] = run[: k - n]
                del run[: k - n]
                n = 0
            if len(run) > len(out):
                run[0:0] = out
                out = run
            else:
                out += run
        if n:
            out += range(self._fresh, self._fresh + n)
            self._fresh += n
        return out

    def _give(self, pages: list[int]) -> None:
        """Return pages to the pool (the list is kept as one run, not copied)."""
        if pages:
            self._free_runs.append(pages)
            self._num_free += len(pages)

    def _free_pages(self) -> list[int]:
        """Every free page id (for invariants and tests)."""
        out = [p for run in self._free_runs for p in run]
        out += range(self._fresh, self.num_pages)
        return out

    def _evict_tokens(self, num_tokens: int) -> int:
        freed = self.tree.evict(num_tokens, self._free_runs) // self.page_size
        self._num_free += freed
        self._counters["evicted_pages"] += freed
        return freed

    def _evictable_pages(self) -> int:
        return self.tree.evictable_tokens // self.page_size

    def _namespace(self, seq: Sequence) -> tuple:
        return seq.extra.namespace

    # -- the contract -----------------------------------------------------------------

    def match(self, seq: Sequence) -> Match:
        if not isinstance(seq, Sequence):
            raise InvalidRequestError(f"expected a Sequence, got {type(seq).__name__}")
        ps = self.page_size
        limit = (len(seq) - 1) // ps * ps
        c = self._counters
        c["lookups"] += 1
        c["lookup_tokens"] += len(seq)
        if limit <= 0:
            return Match(seq.request_id, 0, (), None)
        node, hit, runs = self.tree.match(self._namespace(seq), seq.tokens, limit)
        if len(runs) == 1:
            pages = tuple(runs[0])
        else:
            pages = tuple(p for run in runs for p in run)
        return Match(seq.request_id, hit, pages, node)

    def admit(self, seq: Sequence, match: Match, num_tokens: int) -> list[CopyOp] | None:
        self._check_new(seq, self._live)
        self._check_match(seq, match)
        node: RadixNode | None = match.handle
        if node is not None and node.pages is None:
            raise StaleMatchError(f"request {seq.request_id!r}: the matched prefix was evicted since; match again")
        self._check_num_tokens(seq, num_tokens, max(match.num_tokens, 1))
        tree = self.tree
        hit_pages = match.num_tokens // self.page_size
        need = self.pages_for(num_tokens) - hit_pages
        free = self._num_free
        if need > free:
            on_path = tree.unlocked_on_path(node) // self.page_size if node is not None else 0
            if free + self._evictable_pages() - on_path < need:
                return None
        if node is None:
            node = tree.root(self._namespace(seq), create=True)
        tree.lock(node)
        if need > free:
            self._evict_tokens(need * self.page_size)  # SGLang asks for the whole extend
        table = self._take(need)
        table[0:0] = match.pages  # one list: hit pages, then the new ones
        seq.page_table = table
        seq.num_computed = match.num_tokens
        self._live[seq.request_id] = _Held(seq, node, match.num_tokens)
        c = self._counters
        c["admitted"] += 1
        c["admitted_tokens"] += len(seq)
        c["hit_tokens"] += match.num_tokens
        return []

    def grow(self, seq: Sequence, num_tokens: int) -> list[CopyOp] | None:
        self._check_live(seq, self._live)
        self._check_num_tokens(seq, num_tokens, 0)
        need = self.pages_for(num_tokens) - len(seq.page_table)
        if need <= 0:
            return []
        free = self._num_free
        if need > free:
            if free + self._evictable_pages() < need:
                return None
            self._evict_tokens((need - free) * self.page_size)  # decode evicts step by step
        seq.page_table.extend(self._take(need))
        return []

    def commit(self, seq: Sequence, num_computed: int) -> None:
        held = self._check_live(seq, self._live)
        self._check_num_tokens(seq, num_computed, seq.num_computed)
        ps = self.page_size
        table = seq.page_table
        if num_computed > len(table) * ps:
            raise InvalidRequestError(
                f"request {seq.request_id!r}: {num_computed} tokens computed but pages cover {len(table) * ps}"
            )
        if self._contents is not None and num_computed > seq.num_computed:
            self._record_contents(seq, seq.num_computed, num_computed)
        seq.num_computed = num_computed
        if num_computed <= seq.prompt_len:
            # after a prefill chunk (SGLang's cache_unfinished_req); decode tokens wait for release
            self._insert(held, num_computed // ps * ps, chunked=num_computed < seq.prompt_len)

    def _insert(self, held: _Held, end: int, chunked: bool) -> None:
        """Insert the sequence's first `end` (page-aligned) tokens; free duplicates, move the lock."""
        seq = held.seq
        ps = self.page_size
        tree = self.tree
        table = seq.page_table
        start = held.protected
        old = held.node
        new, matched, runs = tree.insert(old, start, seq.tokens, end, table, count_hit=not chunked)
        if matched > start:
            # the tree already held [start, matched): our pages there are duplicates
            lo, hi = start // ps, matched // ps
            dups = table[lo:hi]
            tree_pages = runs[0] if len(runs) == 1 else [p for run in runs for p in run]
            table[lo:hi] = tree_pages[: hi - lo]
            self._give(dups)
        if new is not old:
            tree.lock(new, stop=old)  # old..root stay locked by us: only the new part changes
            held.node = new
        held.protected = end

    def fork(self, parent: Sequence, child: Sequence) -> list[CopyOp] | None:
        held = self._check_live(parent, self._live)
        self._check_new(child, self._live)
        computed = parent.num_computed
        if len(child) < computed or not np.array_equal(child.tokens[:computed], parent.tokens[:computed]):
            raise InvalidRequestError(
                f"fork: {child.request_id!r} does not hold {parent.request_id!r}'s computed tokens"
            )
        if child.extra.namespace != parent.extra.namespace:
            raise InvalidRequestError(f"fork: {child.request_id!r} has other extra keys than {parent.request_id!r}")
        ps = self.page_size
        full = computed // ps
        partial = computed % ps != 0
        if partial and not self._num_free and self._evictable_pages() < 1:
            return None
        self._insert(held, full * ps, chunked=False)  # the child shares through the tree
        self.tree.lock(held.node)
        pages = parent.page_table[:full]
        ops: list[CopyOp] = []
        if partial:
            if not self._num_free:
                self._evict_tokens(ps)
            (copy,) = self._take(1)
            ops.append(CopyOp(parent.page_table[full], copy))
            pages.append(copy)
            self._counters["copied_pages"] += 1
            if self._contents is not None:
                self._contents[copy * ps : (copy + 1) * ps] = self._contents[
                    parent.page_table[full] * ps : (parent.page_table[full] + 1) * ps
                ]
        child.page_table = pages
        child.num_computed = computed
        self._live[child.request_id] = _Held(child, held.node, full * ps)
        return ops

    def release(self, seq: Sequence) -> None:
        held = self._check_live(seq, self._live)
        if seq.num_computed > seq.prompt_len:
            # SGLang's cache_finished_req: prompt + output go into the tree when the request
            # ends (a walk that refreshes and counts the path even when no page is new)
            self._insert(held, seq.num_computed // self.page_size * self.page_size, chunked=False)
        del self._live[seq.request_id]
        self.tree.unlock(held.node)
        self._give(seq.page_table[held.protected // self.page_size :])

    def evict(self, num_pages: int) -> int:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise InvalidRequestError(f"evict: num_pages must be a non-negative int, got {num_pages!r}")
        if num_pages == 0:
            return 0
        return self._evict_tokens(num_pages * self.page_size)

    # -- observation ------------------------------------------------------------------

    @property
    def on_evict(self):
        """Optional callback `(namespace, start_token, key)` called for every evicted node."""
        return self.tree.on_evict

    @on_evict.setter
    def on_evict(self, fn) -> None:
        self.tree.on_evict = fn

    def stats(self) -> CacheStats:
        tree = self.tree
        ps = self.page_size
        cached = tree.evictable_tokens // ps
        free = self._num_free
        tree_tokens = tree.evictable_tokens + tree.protected_tokens
        return CacheStats(
            backend=self.name,
            num_pages=self.num_pages,
            page_size=ps,
            pages_free=free,
            pages_cached=cached,
            pages_pinned=self.num_pages - free - cached,
            metadata_bytes=tree.num_nodes * _NODE_BYTES
            + tree_tokens * _TOKEN_BYTES
            + (tree_tokens // ps) * _PAGE_ID_BYTES,
            extra={
                "eviction_policy": self.eviction_policy,
                "evictable_tokens": tree.evictable_tokens,
                "protected_tokens": tree.protected_tokens,
                "tree_nodes": tree.num_nodes,
                "namespaces": len(tree.roots),
            },
            **self._counters,
        )

    def _record_contents(self, seq: Sequence, lo: int, hi: int) -> None:
        ps = self.page_size
        t = np.arange(lo, hi)
        pages = np.asarray(seq.page_table, dtype=np.int64)[t // ps]
        self._contents[pages * ps + t % ps] = seq.tokens[lo:hi]

    def check_invariants(self) -> None:
        from backends.radix_invariants import check_radix

        check_radix(self)

    def evictable_leaves_in_order(self) -> list[tuple[int, int]]:
        """(start token, length) of each eviction candidate, next evicted first."""
        return [(k[-1].start, len(k[-1].key)) for k in self.tree.candidates]
