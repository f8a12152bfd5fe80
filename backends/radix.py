"""radix: SGLang RadixAttention (reference: SGLang 0.5.23 `RadixCache`, its allocators and
the scheduler's calls into them).

The tree (`backends/radix_tree.py`) holds runs of tokens and their pages; this module is the
`PrefixCache` contract over it and a pool of pages. Under the replay protocol it makes
SGLang 0.5.23's decisions request for request: the same hit for every request and the same
evicted nodes in the same order, for every policy, page sizes 1 and 16, any concurrency
(`tests/test_radix_sglang.py` against recorded runs of the real code,
`tests/test_radix_fidelity.py` against an independent model). What it reproduces:

- `match`: the prompt's first `len - 1` tokens, rounded down to whole pages, walked from
  the namespace's root; stamps the path and splits the node where the match ends
  (`match_kv_cache` -> `match_prefix`).
- `admit`: locks the matched node up to the root (`inc_lock_ref`), then evicts as the
  allocator's `evict_to_free_tokens` does: only the *shortfall*, demand minus free tokens,
  where the demand is the new tokens, plus one page at page size > 1 (the per-request
  over-estimate of `alloc_paged_token_slots_extend`). All or nothing: `None` when free +
  evictable-off-this-path pages cannot hold the new pages.
- `commit(seq, n)` while prefilling: SGLang's `checkpoint`: inserts the full pages of the
  first `n` tokens. A node the walk passes or creates gains an LFU hit only if it ends
  beyond what this request inserted before (`cache_inserted_len`), so a request counts each
  node once. Pages the request computed for tokens the tree already held are duplicates:
  they are freed and the table points at the tree's pages (same tokens, same prefix, hence
  the same KV); the lock moves to the node ending at the inserted prefix. The partial last
  page stays private.
- `grow`: a further prefill chunk evicts like admission; decode tokens are SGLang's decode
  steps, one per token: each first makes its demand available (one token at page size 1;
  a whole page at larger sizes, even for a token inside a page the request holds: free
  pages 0 means one leaf goes), then takes a page if the token starts one.
- `release`: SGLang's `release_kv_cache(checkpoint=True)`: *always* inserts what has KV
  (prompt + output − 1 tokens, whole pages), a walk that refreshes the path's recency even
  when nothing is new (output length 1); then unlocks (`dec_lock_ref`) and frees the
  private pages. `evict(n)` pops unlocked leaves in policy order (SGLang's heap of leaves;
  a parent that becomes an unlocked leaf joins the same eviction).

Page ids, for speed (no decision depends on which page ids a table holds): int32 arrays
throughout (`backends/radix_pages.py`). A sequence's `page_table` is a `PageTable` (read as
a list of ints, held as a growable int32 buffer), the free pages a `PagePool` (evicted
nodes' arrays kept as they are, then never-used ids created on demand), and a node the tree
creates takes its pages as a view of the table that computed them (`RadixTree._node_pages`).
Moving page ids is a `memcpy`, never a reference count per page, and each id is copied once
per use: from the pool into the table that takes it. A released sequence is left with an empty
`page_table`. A subclass may build list tables instead (radix-hicache): the calls it
inherits take both (`_page_ids`).

Options, each a named variant, never a silent change: `eviction_policy` (lru, lfu, fifo,
mru, filo: SGLang's `evict_policy.py`; its priority, slru and tlru policies are not offered);
`admission_eviction="extend"` evicts the whole new-page count whenever free pages are short
(older SGLang releases, and this backend before it followed 0.5.23); `reserve_page=False`
drops the one-page over-estimate at page size > 1 (admission and decode ask for exactly
what they take), so radix competes at exactly the memory the other backends get.

Remaining differences from SGLang 0.5.23, all deliberate:
- Time is a logical clock (one tick per walk) instead of `time.monotonic()`, so runs are
  reproducible; SGLang stamps a node it creates or splits a moment after the walk's stamp,
  which orders every eviction candidate the same way (the independent model ticks as
  SGLang does, and agrees).
- The finish-time insert of a request whose output extends its prompt re-inserts the
  prompt (`split_prompt`) in SGLang: the prompt boundary is already a node boundary (the
  request's lock sits on it), and its only other effects are a priority (read only by the
  priority policy) and a recency stamp that the checkpoint's re-match overwrites; not done.
- Whether a prompt fits is the engine's protocol (free + evictable pages), not SGLang's
  `PrefillAdder` budget, which also reserves future decode tokens of running requests.
- A preempted request (serving protocol) goes through the same `release`, which inserts
  its computed tokens; SGLang retracts with `checkpoint=False`. The contract does not say
  why a sequence is released.
- `fork` (parallel sampling, beam search) has no SGLang counterpart (SGLang serves samples
  as separate requests sharing the prompt through the tree): it inserts the parent's full
  pages, locks them for the child, copies only a partial last page (`CopyOp`), and the
  child counts its own LFU hits once, as a separate request would.
- Page ids: no padded slot 0, no request-to-token pool; which ids a table holds differs,
  no hit or eviction does.
- The model is `RadixCache`, the class the reference names. A 0.5.23 server builds
  `UnifiedRadixCache` by default (`mem_cache/registry.py`), whose tree core gives a split's
  new upper node the lower node's creation time and re-stamps the lower node's access:
  run through the same harness it agrees with `RadixCache` request for request on 76 of 80
  synthetic configs and all Mooncake page-1 configs; FILO at concurrency 4 differs.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from backends.radix_match import verify_radix_match
from backends.radix_pages import PagePool, PageTable
from backends.radix_policy import EvictionPolicy, make_policy
from backends.radix_tree import RadixNode, RadixTree
from cachelib.errors import InvalidRequestError, StaleMatchError
from cachelib.interface import DECODE_NOOPS_WHILE_FREE, LiveState, Occupancy, PagePartition, PrefixCache
from cachelib.kv_events import PageKeys, PagesRemoved, PagesStored
from cachelib.registry import register_backend
from cachelib.types import CopyOp, ExtraKeys, Match, Sequence

#: how admission (and a further prefill chunk) evicts when free pages are short:
#: `shortfall` = SGLang 0.5.23's `evict_to_free_tokens` (the demand minus what is free),
#: `extend` = older SGLang (the whole new-page count)
ADMISSION_EVICTION = ("shortfall", "extend")

#: how many recent match ends keep their `Match.pages` tuple (`RadixCache._match_pages`): a
#: few hot prefixes, with memory bounded by a few paths (a tuple per node would grow with the
#: square of a deep conversation's path)
_MATCH_PAGES_KEPT = 8

# Modelled bytes of index metadata, as a compact native tree would keep it: per node
# parent/child links, lock ref, clock stamps, hit count (48); per token its id (4); per page
# its id (4).
_NODE_BYTES = 48
_TOKEN_BYTES = 4
_PAGE_ID_BYTES = 4


def _page_ids(table: PageTable | list[int]) -> np.ndarray | list[int]:
    """The ids of a table, to slice and read: a `PageTable`'s array view, or the list itself
    (a subclass's list tables)."""
    return table.array() if table.__class__ is PageTable else table


def _joined(runs: list) -> np.ndarray | list[int]:
    """The page runs of a walk (node page arrays, or lists) as one sequence of ids."""
    if len(runs) == 1:
        return runs[0]
    if runs[0].__class__ is np.ndarray:
        return np.concatenate(runs)
    return list(chain.from_iterable(runs))


class _Held(LiveState):
    """An admitted sequence: the node its lock hangs on, how many leading tokens that path
    covers (SGLang's `last_node` and `cache_protected_len`), how many it has inserted so far
    (`cache_inserted_len`: LFU counts a node once per request) and how many tokens its
    allocations have covered (SGLang allocates decode slots one step at a time)."""

    __slots__ = ("node", "protected", "inserted", "covered")

    def __init__(self, seq: Sequence, node: RadixNode, protected: int, inserted: int, covered: int) -> None:
        self.seq = seq
        self.node = node
        self.protected = protected
        self.inserted = inserted
        self.covered = covered


class RadixEvents:
    """The radix cache's KV events, as SGLang 0.5.23 publishes them
    (`mem_cache/events.py`, `KVCacheEventRecorder`): a node the tree creates is stored
    (`record_store`, from `_insert_helper`), a node it evicts removed (`record_remove`,
    from `evict`), one key per page. A split changes no page's key (SGLang slices the
    node's `hash_value` list, `split_node_hash_value`); the node's keys are kept on it
    (`RadixNode.page_keys`) from its creation, so its eviction names what was stored.

    The keys chain over the prefix as SGLang's do (`get_hash_str(page, prior_hash)`, the
    first page of a node chained from its parent's last): here with the apc hasher
    (xxh3-128 over the page's int32 tokens, `cache_salt` on the first page and `lora_id`
    on every page: the namespace the tree keeps requests apart by) where SGLang hashes
    SHA-256 and publishes its first 64 bits; the same prefix gets the same key either way.
    """

    __slots__ = ("keys", "emit", "_hasher", "_extra")

    def __init__(self, keys: PageKeys, emit) -> None:
        self.keys = keys
        self.emit = emit  # the cache's listener call
        self._hasher = keys.hasher()
        self._extra: dict[tuple, ExtraKeys] = {}  # namespace -> the extra keys that enter its keys

    def stored(self, leaf: RadixNode, tokens: np.ndarray, pos: int, end: int) -> None:
        parent = leaf.parent
        prior = parent.page_keys[-1] if parent.parent is not None else None
        ns = leaf.namespace
        extra = self._extra.get(ns)
        if extra is None:
            extra = self._extra[ns] = ExtraKeys(cache_salt=ns[0], lora_id=ns[1])
        ps = self.keys.page_size
        leaf.page_keys = self._hasher.hash_blocks(tokens, extra, pos // ps, end // ps, prior)
        self.emit(PagesStored(leaf.page_keys, prior))

    def removed(self, node: RadixNode) -> None:
        self.emit(PagesRemoved(node.page_keys))


@register_backend("radix")
class RadixCache(PrefixCache):
    """SGLang RadixAttention over `num_pages` pages of `page_size` tokens.

    `eviction_policy`: `lru` (default), `lfu`, `fifo`, `mru`, `filo`, or an
    `EvictionPolicy` object (how a variant brings its own order: radix-aged).
    `admission_eviction`: `shortfall` (SGLang 0.5.23, default) or `extend` (older SGLang).
    `reserve_page`: SGLang's one-page over-estimate at page size > 1 (default True).
    `track_contents=True` records which token each page slot was written with, so
    `check_invariants` can prove that tree entries point only at pages holding their tokens
    (tests; it costs time).
    """

    decode_steps_are_noops = True  # decode tokens enter the tree at release, as in SGLang
    # so a commit past the prompt only moves the count (with `track_contents`, a later commit
    # records the same tokens into the same held pages)
    commit_publishes_decode = False
    reuses_kv = True
    # prefill admits the match it has just made, with nothing in between: `_verify_match`
    # only checks (it prepares nothing admit reads), and of the cache's own fresh match it
    # would find the memo and an unevicted node; a subclass's full proof (radix-hicache
    # keeps no memo) could only pass too. So prefill does not call it
    proves_fresh_match = False
    emits_kv_events = True  # RadixEvents: a node's pages stored when created, removed when evicted

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        eviction_policy: str | EvictionPolicy = "lru",
        admission_eviction: str = "shortfall",
        reserve_page: bool = True,
        track_contents: bool = False,
    ) -> None:
        super().__init__(num_pages, page_size)
        policy = eviction_policy if isinstance(eviction_policy, EvictionPolicy) else make_policy(eviction_policy)
        if admission_eviction not in ADMISSION_EVICTION:
            raise InvalidRequestError(
                f"admission_eviction must be one of {', '.join(ADMISSION_EVICTION)}, got {admission_eviction!r}"
            )
        if not isinstance(reserve_page, bool):
            raise InvalidRequestError(f"reserve_page must be a bool, got {reserve_page!r}")
        self.admission_eviction = admission_eviction
        # SGLang's paged allocator asks eviction for one page more than it allocates; at page
        # size 1 there is nothing to reserve.
        self.reserve_page = reserve_page and page_size > 1
        if self.reserve_page:
            # a decode step inside a held page still evicts when nothing is free: an engine
            # calls grow every step unless a page is free then (`_decode_steps`; declared per
            # instance, the class default is True)
            self.decode_steps_are_noops = False
            self.decode_noops_when = DECODE_NOOPS_WHILE_FREE
        #: tokens of the over-estimate every extend allocation asks eviction for
        self._reserve_tokens = page_size if self.reserve_page else 0
        self.tree = RadixTree(page_size, policy)
        self.eviction_policy = policy.name
        # Free pages: recycled ids, then never-used ones created when first handed out (an
        # unlimited pool costs nothing up front).
        self._pool = PagePool(num_pages)
        self._num_free = num_pages
        self._contents = np.full(num_pages * page_size, -1, dtype=np.int64) if track_contents else None
        #: node -> the page ids of root..node as a tuple, for the last few matches that ended
        #: there: a hot prefix builds its `Match.pages` once, not per request. Valid while the
        #: node is in the tree: a path keeps its pages while its nodes live (a split cuts a
        #: node's array, not the path's run of ids), and an evicted node is never matched again
        self._match_pages: dict[RadixNode, tuple[int, ...]] = {}

    # -- pages ------------------------------------------------------------------------

    def _new_table(self, seq: Sequence) -> PageTable:
        """An empty table with room for `seq`'s pages and, for most requests, their decode
        pages: outgrowing a long table costs a copy of it into a buffer twice its size."""
        n = -(-len(seq) // self.page_size)
        return PageTable(n + n // 8 + 16)

    def _take(self, n: int) -> list[int]:
        """Hand out `n` free pages (the caller checked there are that many) as a list of
        ints: for a subclass's list tables and single pages."""
        self._num_free -= n
        return self._pool.take(n).tolist()

    def _extend_table(self, table: PageTable | list[int], n: int) -> None:
        """Append `n` free pages to `table` (the caller checked there are that many)."""
        if table.__class__ is PageTable:
            self._num_free -= n
            self._pool.take_into(table.append_slots(n))  # straight into the table's buffer
        else:
            table += self._take(n)

    def _give(self, pages: np.ndarray | list[int]) -> None:
        """Return pages to the pool, which keeps a long array as it is: the caller hands it
        over and never writes it again (`PagePool.give`)."""
        self._num_free += len(pages)
        self._pool.give(pages)

    def _free_pages(self) -> list[int]:
        """Every free page id (for invariants and tests)."""
        return self._pool.free_ids()

    @property
    def _free_runs(self) -> list[list[int]]:
        """The free ids as runs, none empty (one run now): what the free pool was before it
        became `PagePool`, still read by `radix_hicache_invariants`."""
        ids = self._pool.free_ids()
        return [ids] if ids else []

    def _evict_tokens(self, num_tokens: int) -> int:
        # the pool takes the evicted pages straight (`_give` less its count, settled here
        # once: a node's pages are its tokens over the page size)
        freed = self.tree.evict(num_tokens, self._pool.give) // self.page_size
        self._num_free += freed
        self._counters["evicted_pages"] += freed
        return freed

    def _evictable_pages(self) -> int:
        return self.tree.evictable_tokens // self.page_size

    def _namespace(self, seq: Sequence) -> tuple:
        return seq.extra.namespace

    # -- the contract: the hooks the base class calls after its checks -----------------

    def _match(self, seq: Sequence) -> tuple[int, tuple[int, ...], RadixNode | None]:
        ps = self.page_size
        limit = (seq.num_tokens - 1) // ps * ps  # `len(seq)`, less its Python call
        if limit <= 0:
            return 0, (), None
        node, hit = self.tree.match(seq.extra.namespace, seq.tokens, limit)  # `_namespace`
        if not hit:
            return 0, (), node
        kept = self._match_pages
        pages = kept.get(node)  # `node` ends at the hit: its path's ids are the match's
        if pages is None:
            ids = _joined(self.tree.path_pages(node))
            pages = tuple(ids.tolist() if ids.__class__ is np.ndarray else ids)
            if len(kept) >= _MATCH_PAGES_KEPT:
                del kept[next(iter(kept))]  # the oldest kept
            kept[node] = pages
        # what `_verify_match` needs to recognise this very match (see there)
        seq.cache_memo = (self.match_token, id(seq), seq.extra, node, hit, pages)
        return hit, pages, node

    def _can_admit(self, seq: Sequence, match: Match, num_tokens: int) -> bool:
        """The new pages fit in free pages plus evictable ones, less the unlocked pages on
        the hit's own path (admission locks them: they cannot be evicted for it)."""
        ps = self.page_size
        need = -(-num_tokens // ps) - match.num_tokens // ps  # `pages_for`
        free = self._num_free
        if need <= free:
            return True
        node: RadixNode | None = match.handle  # proven live and on seq's path by _verify_match
        tree = self.tree
        on_path = tree.unlocked_on_path(node) if node is not None else 0
        return free + tree.evictable_tokens // ps - on_path // ps >= need  # `_evictable_pages`

    def _admit(self, seq: Sequence, match: Match, num_tokens: int) -> tuple[_Held, list[CopyOp]] | None:
        ps = self.page_size
        hit = match.num_tokens
        hit_pages = hit // ps
        need = -(-num_tokens // ps) - hit_pages
        free = self._num_free
        # `_can_admit` decides; its first test (the new pages are free) answers most admissions
        if need > free and not self._can_admit(seq, match, num_tokens):
            return None
        node: RadixNode | None = match.handle
        tree = self.tree
        if node is None:
            node = tree.root(self._namespace(seq), create=True)
        tree.lock(node)
        if num_tokens - hit + self._reserve_tokens > free * ps or need > free:
            self._evict_for_extend(num_tokens - hit, need)  # else it would evict nothing
        n = -(-seq.num_tokens // ps)  # `_new_table`, inlined
        table = PageTable(n + n // 8 + 16)
        slots = table.append_slots(hit_pages + need)  # the whole table, filled in place
        self._num_free -= need
        if hit_pages:  # the hit's pages: the tree's, proven equal to match.pages
            tree.copy_path_pages(node, slots)
            self._pool.take_into(slots[hit_pages:])
        else:
            self._pool.take_into(slots)
        seq.page_table = table
        seq.num_computed = hit
        return _Held(seq, node, hit, 0, num_tokens), []

    def _grow(self, seq: Sequence, held: _Held, num_tokens: int) -> list[CopyOp] | None:
        table = seq.page_table
        have = len(table)
        need = -(-num_tokens // self.page_size) - have
        free = self._num_free
        if need > free and free + self._evictable_pages() < need:
            return None
        start = held.covered
        if num_tokens <= start:
            return []
        held.covered = num_tokens
        if 0 < free and need < free and start >= seq.prompt_len:
            # decode steps of which none finds nothing free (`_decode_steps`' first case,
            # inlined: nearly every grow): the new pages are taken at once, nothing evicted
            if need > 0:
                if table.__class__ is PageTable:  # `_extend_table`, inlined
                    self._num_free = free - need
                    self._pool.take_into(table.append_slots(need))
                else:
                    self._extend_table(table, need)
            return []
        if start < seq.prompt_len:  # a further prefill chunk: one extend allocation
            end = min(num_tokens, seq.prompt_len)
            extend_pages = max(self.pages_for(end) - len(table), 0)
            self._evict_for_extend(end - start, extend_pages)
            self._extend_table(table, extend_pages)
            start = end
            have = len(table)
        if start < num_tokens:
            self._decode_steps(table, have, start, num_tokens)
        return []

    def _evict_for_extend(self, extend_tokens: int, need_pages: int) -> None:
        """Evict before an extend (prefill) allocation of `need_pages` pages for `extend_tokens`
        new tokens, as the allocator's `evict_to_free_tokens` does (see the module docstring)."""
        ps = self.page_size
        reserve = self._reserve_tokens
        if self.admission_eviction == "extend":  # older SGLang: ask for the whole extend when short
            if need_pages > self._num_free:
                self._evict_tokens(need_pages * ps + reserve)
            return
        shortfall = extend_tokens + reserve - self._num_free * ps
        if shortfall > 0:
            self._evict_tokens(shortfall)

    def _decode_steps(self, table: list[int], have: int, start: int, end: int) -> None:
        """Decode slots for tokens `start..end-1`, one SGLang decode step each, onto `table`
        of `have` pages (the caller checked the pages fit). A step first makes its demand
        available (1 token at page size 1; a whole page at larger sizes with
        `reserve_page`, even when the step needs no new page), then takes a page when the
        token starts one."""
        ps = self.page_size
        want = -(-end // ps)  # pages the table ends with
        if not self.reserve_page:
            # the demand is exactly the new pages: step by step or at once, the same leaves go
            need = want - have
            if need > self._num_free:
                self._evict_tokens((need - self._num_free) * ps)
            self._extend_table(table, need)
            return
        need = want - have
        free = self._num_free
        if 0 < free and need < free:
            # no step finds nothing free (a page stays free after the last is taken): the
            # loop below would take the new pages at once, evicting nothing (`_grow` makes
            # this test first, inlined; here it serves a prefill chunk that ends in decode)
            if need > 0:
                self._extend_table(table, need)
            return
        pos = start
        while pos < end:
            if self._num_free == 0:
                self._evict_tokens(ps)  # the step at `pos` finds nothing free
            need = want - have
            if need <= 0:
                return  # the remaining steps find a page free (or nothing to evict)
            # Until free pages run out again no step evicts: take them at once. The k-th is
            # taken by the step at token `have * page_size + (k - 1) * page_size`.
            k = min(self._num_free, need)
            if k == 0:
                raise AssertionError("radix: decode steps ran out of pages after the fit check")
            self._extend_table(table, k)
            pos = (have + k - 1) * ps + 1
            have += k

    def _commit(self, seq: Sequence, held: _Held, num_computed: int) -> None:
        ps = self.page_size
        if self._contents is not None and num_computed > seq.num_computed:
            self._record_contents(seq, seq.num_computed, num_computed)
        seq.num_computed = num_computed
        if num_computed <= seq.prompt_len:
            # after a prefill chunk (SGLang's checkpoint); decode tokens wait for release
            self._insert(held, num_computed // ps * ps, lend=True)

    def _insert(self, held: _Held, end: int, lend: bool) -> np.ndarray | list[int]:
        """Insert the sequence's first `end` (page-aligned) tokens; free duplicates, move the lock.
        With `lend` a new leaf borrows its pages from the table (the sequence runs on).
        Returns the table's ids as it read them (`_page_ids`), for `_release` to cut its
        private pages from."""
        seq = held.seq
        ps = self.page_size
        tree = self.tree
        table = seq.page_table
        start = held.protected
        old = held.node
        if table.__class__ is PageTable:  # `_page_ids`
            pages = table.array()
            lend = False  # an array's slice is a view already: the new leaf takes one
        else:
            pages = table
        new, matched, runs = tree.insert(old, start, seq.tokens, end, pages, held.inserted, lend)
        if end > held.inserted:
            held.inserted = end
        if matched > start:
            # the tree already held [start, matched): our pages there are duplicates, freed
            # before their slots take the tree's pages (for an array they are a view of them)
            lo, hi = start // ps, matched // ps
            self._give(pages[lo:hi].copy() if pages is not table else pages[lo:hi])
            table[lo:hi] = _joined(runs)[: hi - lo]
        held.node = new  # the insert moved our lock down to it
        held.protected = end
        return pages

    def _fork(self, parent: Sequence, held: _Held, child: Sequence) -> tuple[_Held, list[CopyOp]] | None:
        computed = parent.num_computed
        ps = self.page_size
        full = computed // ps
        partial = computed % ps != 0
        if partial and not self._num_free and self._evictable_pages() < 1:
            return None
        self._insert(held, full * ps, lend=True)  # the child shares through the tree
        self.tree.lock(held.node)
        parent_table = parent.page_table
        if parent_table.__class__ is PageTable:
            pages = self._new_table(child)
            pages.extend(parent_table.array()[:full])
        else:
            pages = parent_table[:full]
        ops: list[CopyOp] = []
        if partial:
            if not self._num_free:
                self._evict_tokens(ps)
            (copy,) = self._take(1)
            src = parent_table[full]
            ops.append(CopyOp(src, copy))
            pages.append(copy)
            if self._contents is not None:
                self._contents[copy * ps : (copy + 1) * ps] = self._contents[src * ps : (src + 1) * ps]
        child.page_table = pages
        child.num_computed = computed
        # The child counts its own LFU hits once, as a separate SGLang request would.
        return _Held(child, held.node, full * ps, 0, computed), ops

    def _release(self, seq: Sequence, held: _Held) -> None:
        # SGLang's release_kv_cache -> checkpoint: what has KV goes into the tree when the
        # request ends, always (a walk that refreshes recency even when no page is new)
        ps = self.page_size
        ids = self._insert(held, max(seq.num_computed // ps * ps, held.protected), lend=False)
        table = seq.page_table
        if table.__class__ is PageTable:  # nodes view its buffer: nothing to settle
            pages = ids[held.protected // ps :]  # the private pages (`ids` is the table's array)
            self._num_free += len(pages)
            self._pool.give(pages)
            seq.page_table = []
        else:
            self._give(table[held.protected // ps :])
            self._settle_borrowers(held)
        self.tree.unlock(held.node)

    def _settle_borrowers(self, held: _Held) -> None:
        """The sequence ends and is left with an empty table. With a list table (a
        subclass's), the nodes that borrow pages from it (all on its locked path) get lists
        of their own: the longest takes the table's list itself, cut down to its slots (no
        reference count moves but for the cut ends); the others copy theirs."""
        seq = held.seq
        table = seq.page_table
        if table.__class__ is PageTable:  # nodes view the buffer: nothing to hand over
            seq.page_table = []
            return
        borrowers = []
        x = held.node
        while x.parent is not None:
            if x.lender is table:
                borrowers.append(x)
            x = x.parent
        if not borrowers:
            return
        keep = borrowers[0] if len(borrowers) == 1 else max(borrowers, key=lambda x: len(x.key))
        for x in borrowers:
            if x is not keep:
                x.pages = self.tree.pages_of(x)
                x.lender = None
        lo = keep.start // self.page_size
        del table[lo + len(keep.key) // self.page_size :]
        del table[:lo]
        keep.pages = table
        keep.lender = None
        seq.page_table = []

    def _evict(self, num_pages: int) -> int:
        return self._evict_tokens(num_pages * self.page_size)

    # -- KV events --------------------------------------------------------------------

    def page_keys(self) -> PageKeys:
        """Chained page keys over the tokens and the namespace (`RadixEvents`)."""
        return PageKeys(self.page_size, namespace_only=True)

    def _kv_subscribed(self) -> None:
        if self.tree.num_nodes:
            raise InvalidRequestError(
                f"subscribe to a radix cache's KV events before it holds a page (it holds {self.tree.num_nodes} nodes)"
            )
        if self.tree.events is None:
            self.tree.events = RadixEvents(self.page_keys(), self._emit_kv_event)

    # -- observation ------------------------------------------------------------------

    @property
    def on_evict(self):
        """Optional callback `(namespace, start_token, key)` called for every evicted node."""
        return self.tree.on_evict

    @on_evict.setter
    def on_evict(self, fn) -> None:
        self.tree.on_evict = fn

    def _occupancy(self) -> Occupancy:
        tree = self.tree
        ps = self.page_size
        tree_tokens = tree.evictable_tokens + tree.protected_tokens
        return Occupancy(
            pages_free=self._num_free,
            pages_cached=tree.evictable_tokens // ps,
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
        )

    def pages_pinned(self) -> int:
        return self.num_pages - self._num_free - self.tree.evictable_tokens // self.page_size  # O(1)

    def pages_free(self) -> int:
        return self._num_free  # O(1)

    def _page_partition(self) -> PagePartition:
        cached: list[int] = []
        pinned: list[int] = []
        for node in self.tree.nodes():
            (pinned if node.lock_ref else cached).extend(self.tree.page_ids(node))
        for held in self._live.values():  # private pages: past the tree's part of the table
            pinned += held.seq.page_table[held.protected // self.page_size :]
        return PagePartition(free=self._free_pages(), cached=cached, pinned=pinned)

    def _record_contents(self, seq: Sequence, lo: int, hi: int) -> None:
        ps = self.page_size
        t = np.arange(lo, hi)
        pages = np.asarray(seq.page_table, dtype=np.int64)[t // ps]
        self._contents[pages * ps + t % ps] = seq.tokens[lo:hi]

    def _check_invariants(self) -> None:
        from backends.radix_invariants import check_radix

        check_radix(self)

    def evictable_leaves_in_order(self) -> list[tuple[int, int]]:
        """(start token, length) of each eviction candidate, next evicted first."""
        return [(k[-1].start, len(k[-1].key)) for k in self.tree.candidates]

    def _verify_match(self, seq: Sequence, match: Match) -> None:
        """`_check_match`'s proof of a hit against the tree (O(hit), backends/radix_match.py).

        A match this cache made for this very sequence object is recognised in O(1): `_match`
        left its node, token count and page tuple (by identity) in `seq.cache_memo`. What it
        proved then still holds while the node is in the tree: a sequence's first tokens
        never change, a node keeps its pages until it is evicted, and a split keeps the
        pages and the end of every path through it. Only eviction is left to check. Any
        other match (edited, another sequence's, a copied memo) gets the full proof."""
        memo = seq.cache_memo
        if memo.__class__ is tuple and len(memo) == 6:
            token, seq_id, extra, node, hit, pages = memo
            if (
                token is self.match_token
                and seq_id == id(seq)
                and extra is seq.extra
                and node is match.handle
                and hit == match.num_tokens
                and pages is match.pages
            ):
                if node.pages is None and node.lender is None:
                    raise StaleMatchError(
                        f"request {seq.request_id!r}: the matched prefix was evicted since; match again"
                    )
                return
        verify_radix_match(self, seq, match)
