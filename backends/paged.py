"""paged: PagedAttention block tables (reference: Kwon et al., SOSP'23, §4.3-4.4, §6.3-6.4).

Per-sequence block tables over physical blocks with reference counts and a FIFO free list
(docs/design.md §4 paged). Sharing is explicit, never automatic:

- `fork(parent, child)` maps the child onto every block holding the parent's KV (the first
  `pages_for(parent.num_computed)` blocks), the partial last one included: ref +1 each.
- Copy-on-write happens where the write is granted. `admit(seq, m, n)` and `grow(seq, n)`
  allow the executor to write the KV of tokens `[seq.num_computed, n)`; every block of the
  table that overlaps that range and has ref > 1 is first replaced, in this table only, by
  a fresh block, and a `CopyOp(old, new)` is returned. Other holders keep the original; the
  last holder writes in place. `commit` cannot return copies, so a commit that covers
  tokens never granted by `admit`/`grow` and lying in a shared block raises.
- Declared prefixes: `register_prefix(tokens, extra) -> prefix id` allocates pinned blocks.
  The engine computes the prefix's KV once, through `prefix_sequence(pid)` (a `Sequence`
  whose page table is those blocks), then `commit(prefix_seq, len)`. A request whose
  `prefix_id` names a fully computed prefix, and whose tokens and extra keys really start
  with it, gets those blocks from `match` (up to `len - 1` tokens, *not* rounded to a block:
  a partial last prefix block is shared and copied on the first write). Until the prefix is
  fully committed, `match` returns no hit (the request computes everything itself).
  An undeclared repeat is never detected: that is the design.
- `unregister_prefix(pid)` drops the registration's hold at once; blocks still mapped by
  live sequences stay until their last holder releases them (ref counting defers the free),
  and a `Match` naming the prefix made before becomes stale.

Occupancy: a block is *free* (ref 0, in the free list) or *pinned* (held by a table or a
registration). Nothing is ever cached-unpinned: prefix blocks are not evictable, so
`pages_cached` is 0 and `evict` frees nothing. Idle prefix blocks (held only by their
registration) are reported in `stats().extra["prefix_pages_idle"]`.

Free blocks are handed out in id order and returned to the back of the list, as `none`
does: a workload without forks or prefixes gets exactly the page ids it gets on `none`.
"""

from __future__ import annotations

from itertools import count
from operator import itemgetter

import numpy as np

from cachelib.errors import InvalidRequestError
from cachelib.interface import DECODE_NOOPS_IF_PRIVATE, LiveState, Occupancy, PagePartition, PrefixCache
from cachelib.page_pool import FifoPagePool
from cachelib.registry import register_backend
from cachelib.types import NO_EXTRA, CopyOp, ExtraKeys, Match, Sequence, as_token_ids

# Modelled metadata bytes: a 4-byte ref count per block, a 4-byte id per table entry, and
# the token ids of each declared prefix (kept to verify requests that name it).
_REF_BYTES = 4
_ENTRY_BYTES = 4


class _Table(LiveState):
    """A sequence's block table and `granted`: the executor may write tokens up to there."""

    __slots__ = ("blocks", "granted", "prefix_id")

    def __init__(self, seq: Sequence, blocks: list[int], granted: int, prefix_id: int | None) -> None:
        self.seq = seq
        self.blocks = blocks
        self.granted = granted
        self.prefix_id = prefix_id


class _Prefix:
    """A declared prefix: its tokens, extra keys and the sequence that computes its KV."""

    __slots__ = ("prefix_id", "tokens", "extra", "table")

    def __init__(self, prefix_id: int, tokens: np.ndarray, extra: ExtraKeys, table: _Table) -> None:
        self.prefix_id = prefix_id
        self.tokens = tokens
        self.extra = extra
        self.table = table

    @property
    def computed(self) -> bool:
        return self.table.seq.num_computed == self.tokens.size


@register_backend("paged")
class PagedCache(PrefixCache):
    """PagedAttention block manager: explicit sharing by fork and declared prefixes, CoW."""

    reuses_kv = True  # a declared prefix's blocks
    declares_prefixes = True
    #: no KV events: what it shares is declared up front, not published as requests run
    emits_kv_events = False
    #: a decode write inside a held block is free of effects unless the block is shared (a
    #: fork's, a declared prefix's partial last block): then `_grow` copies it. Per sequence:
    #: `decode_steps_private`
    decode_noops_when = DECODE_NOOPS_IF_PRIVATE

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self._ref = [0] * num_pages
        self._free = FifoPagePool(num_pages)
        self._prefixes: dict[int, _Prefix] = {}
        self._prefix_ids = count(1)  # from 1, so a prefix id is never falsy

    # -- declared prefixes ------------------------------------------------------------

    def register_prefix(self, tokens: object, extra: ExtraKeys = NO_EXTRA) -> int | None:
        """Declare a shared prefix; allocate and pin its blocks. Returns its id, or `None`
        (changing nothing) when the blocks do not fit. Compute its KV through
        `prefix_sequence(pid)` and `commit`; requests hit it only once fully committed."""
        toks = as_token_ids(tokens, what="declared prefix").copy()
        if not isinstance(extra, ExtraKeys):
            raise InvalidRequestError(f"register_prefix: extra must be ExtraKeys, got {type(extra).__name__}")
        need = self.pages_for(toks.size)
        if need > len(self._free):
            return None
        pid = next(self._prefix_ids)
        blocks = self._take(need)
        seq = Sequence(f"<prefix {pid}>", toks, extra)
        seq.page_table = list(blocks)
        self._prefixes[pid] = _Prefix(pid, toks, extra, _Table(seq, blocks, toks.size, None))
        return pid

    def prefix_sequence(self, prefix_id: int) -> Sequence:
        """The sequence whose page table holds the prefix's blocks: prefill it like an
        admitted sequence, then `commit(seq, len(seq))`. Do not release it."""
        return self._prefix(prefix_id).table.seq

    def prefix_pages(self, prefix_id: int) -> tuple[int, ...]:
        """The physical blocks pinned for a registered prefix."""
        return tuple(self._prefix(prefix_id).table.blocks)

    def unregister_prefix(self, prefix_id: int) -> None:
        """Drop the prefix: new requests naming it are refused, its blocks are freed when
        their last holder (this registration, or a live sequence mapped onto them) lets go."""
        prefix = self._prefix(prefix_id)
        del self._prefixes[prefix_id]
        self._drop(prefix.table.blocks)
        self._epoch += 1  # a Match naming it, made before, is stale

    def _prefix(self, prefix_id: object) -> _Prefix:
        prefix = self._prefixes.get(prefix_id) if prefix_id.__class__ is int else None  # not True
        if prefix is None:
            raise InvalidRequestError(
                f"unknown prefix id {prefix_id!r} (never registered, or unregistered); registered: {sorted(self._prefixes)}"
            )
        return prefix

    def _verify_prefix(self, seq: Sequence, prefix: _Prefix) -> None:
        """Raise unless `seq` really starts with the prefix's tokens under the same KV conditions."""
        p = prefix.tokens.size
        rid = seq.request_id
        if len(seq) < p or not np.array_equal(seq.tokens[:p], prefix.tokens):
            raise InvalidRequestError(
                f"request {rid!r} names prefix {prefix.prefix_id} but does not start with its {p} tokens"
            )
        e, pe = seq.extra, prefix.extra
        if e.cache_salt != pe.cache_salt or e.lora_id != pe.lora_id:
            raise InvalidRequestError(
                f"request {rid!r}: extra keys (salt {e.cache_salt!r}, lora {e.lora_id!r}) differ from prefix "
                f"{prefix.prefix_id}'s (salt {pe.cache_salt!r}, lora {pe.lora_id!r})"
            )
        if tuple(s for s in e.mm if s.offset < p) != pe.mm:
            raise InvalidRequestError(f"request {rid!r}: multimodal inputs inside prefix {prefix.prefix_id} differ")

    # -- the contract: the hooks the base class calls after its checks -----------------

    def _match(self, seq: Sequence) -> tuple[int, tuple[int, ...], int | None]:
        """The declared prefix's blocks if `seq.prefix_id` names one; never anything else."""
        hit, pages = 0, ()
        if seq.prefix_id is not None:
            prefix = self._prefix(seq.prefix_id)
            self._verify_prefix(seq, prefix)  # raises before any counter moves
            if prefix.computed:
                hit = min(prefix.tokens.size, len(seq) - 1)
                pages = tuple(prefix.table.blocks[: self.pages_for(hit)])
        return hit, pages, seq.prefix_id if hit else None

    def _verify_match(self, seq: Sequence, match: Match) -> None:
        """A hit is the first blocks of the fully computed prefix `seq` names and really
        starts with; anything else (another prefix, another cache's, forged pages) is refused.
        (A prefix unregistered since moved the epoch: the base refused the match as stale.)"""
        prefix = self._prefixes.get(match.handle) if match.handle.__class__ is int else None
        if prefix is None or match.handle != seq.prefix_id or not match.num_tokens:
            raise InvalidRequestError(
                f"request {seq.request_id!r}: match is for prefix {match.handle!r}, not {seq.prefix_id!r}"
            )
        self._verify_prefix(seq, prefix)
        n = match.num_tokens
        if (
            not prefix.computed
            or n > prefix.tokens.size
            or match.pages != tuple(prefix.table.blocks[: self.pages_for(n)])
        ):
            raise InvalidRequestError(
                f"request {seq.request_id!r}: the match's pages are not prefix {prefix.prefix_id}'s (forged?)"
            )

    def _admit_plan(self, match: Match, num_tokens: int) -> tuple[int, list[int]] | None:
        """(new blocks, indices of hit blocks to copy on write) for admitting `match` over
        `num_tokens` tokens, or `None` when they do not fit: the one fit test of `_admit`
        and `_can_admit`."""
        num_new = self.pages_for(num_tokens) - len(match.pages)
        # a hit block always has ref >= 1 (the registration), so with us it is shared
        cow = self._shared_in(match.pages, match.num_tokens, num_tokens, extra_ref=1)
        if num_new + len(cow) > len(self._free):
            return None
        return num_new, cow

    def _can_admit(self, seq: Sequence, match: Match, num_tokens: int) -> bool:
        return self._admit_plan(match, num_tokens) is not None

    def _admit(self, seq: Sequence, match: Match, num_tokens: int) -> tuple[_Table, list[CopyOp]] | None:
        plan = self._admit_plan(match, num_tokens)
        if plan is None:
            return None
        num_new, cow = plan
        hit = list(match.pages)
        for b in hit:
            self._ref[b] += 1
        table = _Table(seq, hit, match.num_tokens, match.handle)
        seq.page_table = list(hit)
        seq.num_computed = match.num_tokens
        ops = self._copy_on_write(table, cow)
        new = self._take(num_new)
        table.blocks.extend(new)
        seq.page_table.extend(new)
        table.granted = num_tokens
        return table, ops

    def _grow(self, seq: Sequence, table: _Table, num_tokens: int) -> list[CopyOp] | None:
        num_new = max(0, self.pages_for(num_tokens) - len(table.blocks))
        cow = self._shared_in(table.blocks, seq.num_computed, num_tokens)
        if num_new + len(cow) > len(self._free):
            return None
        ops = self._copy_on_write(table, cow)
        if num_new:
            new = self._take(num_new)
            table.blocks.extend(new)
            seq.page_table.extend(new)
        table.granted = max(table.granted, num_tokens)
        return ops

    def _commit(self, seq: Sequence, table: _Table, num_computed: int) -> None:
        unguarded = self._shared_in(table.blocks, max(seq.num_computed, table.granted), num_computed)
        if unguarded:
            raise InvalidRequestError(
                f"request {seq.request_id!r}: tokens up to {num_computed} land in shared block(s) "
                f"{[table.blocks[i] for i in unguarded]} never granted by admit/grow (no copy-on-write done)"
            )
        seq.num_computed = num_computed
        table.granted = max(table.granted, num_computed)

    def _fork(self, parent: Sequence, held: _Table, child: Sequence) -> tuple[_Table, list[CopyOp]] | None:
        computed = parent.num_computed
        blocks = held.blocks[: self.pages_for(computed)]
        ops: list[CopyOp] = []
        # The parent was granted writes into its partial last block and may be writing it
        # now: sharing it would put a write into a shared block. Give the child a copy; its
        # computed slots are final, so copying before or after the parent's write is exact.
        if computed % self.page_size and held.granted > computed:
            if not self._free:
                return None
            (dst,) = self._take(1)
            ops.append(CopyOp(blocks[-1], dst))
            blocks = blocks[:-1] + [dst]
        for b in blocks[: len(blocks) - len(ops)]:
            self._ref[b] += 1
        child.page_table = list(blocks)
        child.num_computed = computed
        return _Table(child, blocks, computed, held.prefix_id), ops

    def _release(self, seq: Sequence, table: _Table) -> None:
        self._drop(table.blocks)

    def _evict(self, num_pages: int) -> int:
        """Nothing is ever cached-unpinned here (prefix blocks are pinned), so this frees 0."""
        return 0

    # -- block bookkeeping ------------------------------------------------------------

    def _take(self, n: int) -> list[int]:
        """Pop `n` free blocks (the caller checked there are enough) and give each ref 1."""
        out = self._free.take(n)
        ref = self._ref
        if n == 1:  # a decode step's block
            (b,) = out
            assert not ref[b], f"paged: block {b} handed out while referenced"
            ref[b] = 1
            return out
        # (the refs read in one C-level gather: a prompt takes hundreds of blocks)
        assert not out or not any(itemgetter(*out)(ref)), "paged: a block handed out while referenced"
        for b in out:
            ref[b] = 1
        return out

    def _drop(self, blocks: list[int]) -> None:
        """One holder lets go of `blocks`; a block whose last holder left returns to the pool
        (in table order)."""
        ref = self._ref
        if len(blocks) > 1 and max(itemgetter(*blocks)(ref)) == 1:
            # every block was this holder's alone (a finished request's private table, the
            # common case): all return, read in one C-level gather, no test per block
            for b in blocks:
                ref[b] = 0
            self._free.give(blocks)
            return
        freed = []
        for b in blocks:
            ref[b] -= 1
            if ref[b] == 0:
                freed.append(b)
        self._free.give(freed)

    def _shared_in(self, blocks: list[int] | tuple[int, ...], lo: int, hi: int, extra_ref: int = 0) -> list[int]:
        """Indices of `blocks` overlapping tokens `[lo, hi)` whose ref (plus `extra_ref`) > 1."""
        if hi <= lo:
            return []
        ps, ref = self.page_size, self._ref
        stop = min(len(blocks), self.pages_for(hi))
        return [i for i in range(lo // ps, stop) if ref[blocks[i]] + extra_ref > 1]

    def _copy_on_write(self, table: _Table, indices: list[int]) -> list[CopyOp]:
        """Give `table` private copies of its blocks at `indices`; the others keep the originals."""
        ops = []
        for i in indices:
            src = table.blocks[i]
            (dst,) = self._take(1)
            self._ref[src] -= 1  # still >= 1: it was shared
            table.blocks[i] = dst
            table.seq.page_table[i] = dst
            ops.append(CopyOp(src, dst))
        return ops

    def _commit_state(self, seq: Sequence) -> _Table:
        """A live sequence's table, or a declared prefix's (so the engine can commit it)."""
        for prefix in self._prefixes.values():
            if prefix.table.seq is seq:
                return prefix.table
        return self._check_live(seq)

    def _refuse_live(self, seq: object) -> None:
        if any(p.table.seq is seq for p in self._prefixes.values()):
            raise InvalidRequestError(f"{seq.request_id} is a declared prefix: use unregister_prefix")
        super()._refuse_live(seq)

    # -- observation ----------------------------------------------------------------

    def _occupancy(self) -> Occupancy:
        ref = self._ref
        prefix_pages = sum(len(p.table.blocks) for p in self._prefixes.values())
        idle = sum(1 for p in self._prefixes.values() for b in p.table.blocks if ref[b] == 1)
        entries = sum(len(t.blocks) for t in self._live.values()) + prefix_pages
        return Occupancy(
            pages_free=len(self._free),
            pages_cached=0,
            metadata_bytes=self.num_pages * _REF_BYTES
            + entries * _ENTRY_BYTES
            + 4 * sum(p.tokens.size for p in self._prefixes.values()),
            extra={
                "prefixes": len(self._prefixes),
                "prefix_pages": prefix_pages,
                "prefix_pages_idle": idle,
                "shared_pages": sum(1 for r in ref if r > 1),
                "table_entries": entries,
            },
        )

    def pages_pinned(self) -> int:
        return self.num_pages - len(self._free)  # O(1); stats() walks every ref count

    def pages_free(self) -> int:
        return len(self._free)

    def decode_steps_private(self, seq: Sequence) -> bool:
        """No block from the one holding token `seq.num_computed` on is shared: a grow within
        the table then copies nothing (`_shared_in` is empty) and moves only `granted`, which
        the commit that follows brings to the same value; a commit publishes nothing here."""
        table = self._check_live(seq)
        ref = self._ref
        blocks = table.blocks
        for i in range(seq.num_computed // self.page_size, len(blocks)):
            if ref[blocks[i]] != 1:
                return False
        return True

    def pages_reclaimable(self) -> int:
        return len(self._free)  # nothing is cached: declared prefixes stay pinned

    def ref_count(self, page: int) -> int:
        """How many tables and prefix registrations hold `page` (0 = free)."""
        return self._ref[page]

    def _page_partition(self) -> PagePartition:
        return PagePartition(free=list(self._free), cached=[], pinned=[b for b, r in enumerate(self._ref) if r > 0])

    def _registered_pages(self) -> list[int]:
        return [b for p in self._prefixes.values() for b in p.table.blocks]

    def _check_invariants(self) -> None:
        from backends.paged_invariants import check_paged

        check_paged(self)
