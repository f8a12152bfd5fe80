"""apc: vLLM V1 Automatic Prefix Caching (reference: vLLM 0.33, `vllm/v1/core/`).

A pool of blocks with ref counts, a table from chained block hash to cached block, and the
free queue as the LRU order (DESIGN §4 apc). What it reproduces, decision for decision:

- Only full blocks are hashed and cached. Lookup walks the request's block hashes from the
  first and stops at the first miss; the hit is capped at `len - 1` tokens and rounded down
  to a block, so a fully cached prompt still recomputes its last block.
- A cached block with no user waits in the free queue. A hit removes it from the queue
  (`touch`); new blocks come from the head, and a head block that still has a hash is
  evicted only then (lazy eviction). Admission is all-or-nothing, and hit blocks sitting in
  the free queue count against the blocks available for the new ones.
- Release walks the table last to first; a block whose ref count drops to 0 goes to the
  tail if hashed (evicted late) or to the head if not (reused first).
- Blocks that fill during decode are cached too. A block recomputed while an equal one is
  cached becomes a duplicate (tables are append-only); lookups return the oldest.

Differences from vLLM, on purpose: there is no reserved null block (vLLM gives block 0 to
it, so vLLM's pool of P blocks has P - 1 usable ones; compare at equal *usable* blocks), and
`evict(n)` exists for the contract (vLLM only evicts lazily): it clears the first `n` cached
blocks of the queue in LRU order and moves them to the head.

Options beyond vLLM: `hash_algorithm` (`xxh3_128` default, `sha256`), and
`verify_tokens=True`, which stores each cached block's tokens, extra keys and parent, and
accepts a hit only when they equal the request's, so a hash collision can never return
wrong KV. (With it, a block whose parent was a *duplicate* of the block the walk chose is
treated as a miss: conservative, never wrong.)
"""

from __future__ import annotations

from itertools import islice

import numpy as np

from cachelib.errors import InvalidRequestError
from cachelib.free_queue import FreeBlockQueue, KVBlock
from cachelib.hashing import BlockHash, BlockHasher, HashFn
from cachelib.interface import LiveState, Occupancy, PagePartition, PrefixCache
from cachelib.registry import register_backend
from cachelib.types import CopyOp, Match, Sequence

# Modelled bytes of index metadata, as a compact native implementation would keep it:
# per block a ref count (4), links (2 x 4) and a hash (16); per table entry key + block id.
_BLOCK_BYTES = 28
_ENTRY_BYTES = 20


class _Held(LiveState):
    """An admitted sequence: its blocks, and how many leading ones are hashed (published)."""

    __slots__ = ("blocks", "num_cached")

    def __init__(self, seq: Sequence, blocks: list[KVBlock], num_cached: int) -> None:
        self.seq = seq
        self.blocks = blocks
        self.num_cached = num_cached


@register_backend("apc")
class APCCache(PrefixCache):
    """vLLM V1 automatic prefix caching over `num_pages` blocks of `page_size` tokens."""

    decode_steps_are_noops = True  # full blocks are published only when they fill
    reuses_kv = True

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        hash_algorithm: str = "xxh3_128",
        hash_fn: HashFn | None = None,
        verify_tokens: bool = False,
    ) -> None:
        super().__init__(num_pages, page_size)
        if not isinstance(verify_tokens, bool):
            raise InvalidRequestError(f"verify_tokens must be a bool, got {verify_tokens!r}")
        self.hasher = BlockHasher(page_size, hash_algorithm, hash_fn)
        self.verify_tokens = verify_tokens
        self.blocks = [KVBlock(i) for i in range(num_pages)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # hash -> the cached block, or {block_id: block} once duplicates exist (oldest first)
        self._table: dict[BlockHash, KVBlock | dict[int, KVBlock]] = {}
        self._num_cached_free = 0  # hashed blocks with ref 0 (in the free queue)
        self._num_hashed = 0  # hashed blocks = table entries (each hashed block is one entry)
        self._memo_key = object()
        if verify_tokens:
            # what each cached block was computed from: tokens, extra keys, parent instance
            self._tokens = np.zeros((num_pages, page_size), dtype=np.int32)
            self._extra: list[bytes] = [b""] * num_pages
            self._parent: list[tuple[int, int] | None] = [None] * num_pages
            # the parent's hash when recorded: lets check_invariants rehash each cached block
            # from its recorded content, even after its parent block was evicted
            self._parent_hash: list[BlockHash | None] = [None] * num_pages
            self._generation = [0] * num_pages

    # -- hashing --------------------------------------------------------------------

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of `seq`'s first `num_blocks` full blocks (memoised on seq)."""
        memo = seq.cache_memo
        if memo is None or memo[0] is not self._memo_key:
            memo = (self._memo_key, [])
            seq.cache_memo = memo
        hashes = memo[1]
        have = len(hashes)
        if have < num_blocks:
            parent = hashes[-1] if hashes else None
            hashes.extend(self.hasher.hash_blocks(seq.tokens, seq.extra, have, num_blocks, parent))
        return hashes

    # -- the contract: the hooks the base class calls after its checks -----------------

    def _match(self, seq: Sequence) -> tuple[int, tuple[int, ...], list[KVBlock]]:
        max_blocks = (len(seq) - 1) // self.page_size
        hashes = self._block_hashes(seq, max_blocks)
        table = self._table
        hit: list[KVBlock] = []
        if self.verify_tokens:
            hit = self._verified_walk(seq, hashes[:max_blocks])
        else:
            append = hit.append
            for h in islice(hashes, max_blocks):
                block = table.get(h)
                if block is None:
                    break
                if block.__class__ is not KVBlock:
                    block = next(iter(block.values()))
                append(block)
        return len(hit) * self.page_size, tuple([b.block_id for b in hit]), hit

    def _verified_walk(
        self, seq: Sequence, hashes: list[BlockHash], chosen: list[KVBlock] | None = None
    ) -> list[KVBlock]:
        """The longest run of cached blocks whose recorded contents are `seq`'s first blocks.
        With `chosen`, only those blocks are candidates (re-checking a match's hit)."""
        size = self.page_size
        tokens = seq.tokens
        hit: list[KVBlock] = []
        for i, h in enumerate(hashes):
            if chosen is not None:
                candidates = [chosen[i]]
            else:
                entry = self._table.get(h)
                if entry is None:
                    break
                candidates = [entry] if entry.__class__ is KVBlock else list(entry.values())
            want_parent = None if i == 0 else (hit[-1].block_id, self._generation[hit[-1].block_id])
            extra = self.hasher.extra_bytes(seq.extra, i)
            block_tokens = tokens[i * size : (i + 1) * size]
            found = None
            for block in candidates:
                bid = block.block_id
                if (
                    self._parent[bid] == want_parent
                    and self._extra[bid] == extra
                    and np.array_equal(self._tokens[bid], block_tokens)
                ):
                    found = block
                    break
            if found is None:
                break
            hit.append(found)
        return hit

    def _verify_match(self, seq: Sequence, match: Match) -> None:
        """The hit must be this cache's blocks (not evicted since: the epoch says so), holding `seq`'s first
        blocks: their hashes equal the sequence's chained hashes (and, with
        `verify_tokens`, their recorded tokens, extra keys and parents equal its own)."""
        hit = match.handle
        blocks = self.blocks
        n = len(match.pages)
        foreign = other_tokens = False
        if hit.__class__ is not list or len(hit) != n or n * self.page_size != match.num_tokens:
            foreign = True
        else:
            hashes = self._block_hashes(seq, n)
            try:
                for block, page, h in zip(hit, match.pages, hashes, strict=False):
                    if blocks[block.block_id] is not block or block.block_id != page:
                        foreign = True
                        break
                    if block.block_hash != h:
                        other_tokens = True
            except (AttributeError, IndexError, TypeError):
                foreign = True
        if foreign:
            raise InvalidRequestError(
                f"request {seq.request_id!r}: the match's blocks are not this cache's (another cache's match, or forged)"
            )
        if other_tokens or (self.verify_tokens and len(self._verified_walk(seq, hashes[:n], hit)) != n):
            raise InvalidRequestError(
                f"request {seq.request_id!r}: the match's blocks hold other tokens (a match made for another sequence)"
            )

    def _can_admit(self, seq: Sequence, match: Match, num_tokens: int) -> bool:
        """vLLM's `allocate_slots` check: the new blocks fit in the free queue, less the hit
        blocks still in it (they are about to leave it: they are not free for us)."""
        hit: list[KVBlock] = match.handle if match.num_tokens else []
        num_free_hit = sum(1 for b in hit if b.ref_cnt == 0)
        return self.pages_for(num_tokens) - len(hit) <= self.free_queue.num_free - num_free_hit

    def _admit(self, seq: Sequence, match: Match, num_tokens: int) -> tuple[_Held, list[CopyOp]] | None:
        if not self._can_admit(seq, match, num_tokens):
            return None
        hit: list[KVBlock] = match.handle if match.num_tokens else []
        num_new = self.pages_for(num_tokens) - len(hit)
        queue = self.free_queue
        for block in hit:
            if block.ref_cnt == 0:
                queue.remove(block)
                self._num_cached_free -= 1
            block.ref_cnt += 1
        blocks = hit + self._take_new(num_new)
        seq.page_table = [b.block_id for b in blocks]
        seq.num_computed = match.num_tokens
        return _Held(seq, blocks, len(hit)), []

    def _take_new(self, n: int) -> list[KVBlock]:
        """Pop `n` blocks from the queue head, evicting those that still hold a cached block."""
        new = self.free_queue.popleft_n(n)
        table = self._table
        evicted = 0
        for block in new:
            h = block.block_hash
            if h is not None:  # lazy eviction: the block leaves the table only now
                entry = table.pop(h)
                if entry is not block:
                    self._keep_other_duplicates(h, entry, block)
                block.block_hash = None
                evicted += 1
            assert block.ref_cnt == 0, f"apc: block {block.block_id} handed out while referenced"
            block.ref_cnt = 1
        if evicted:
            self._evicted(new if self.verify_tokens else (), evicted)
        return new

    def _keep_other_duplicates(self, h: BlockHash, entry: dict[int, KVBlock], block: KVBlock) -> None:
        """`block` leaves a hash that other (duplicate) blocks still hold: put those back."""
        del entry[block.block_id]
        self._table[h] = next(iter(entry.values())) if len(entry) == 1 else entry

    def _evicted(self, blocks: list[KVBlock], count: int) -> None:
        """Book-keeping for `count` cached blocks just evicted (`blocks` only in verify mode)."""
        self._num_cached_free -= count
        self._num_hashed -= count
        self._counters["evicted_pages"] += count
        self._epoch += 1
        for block in blocks:
            # a new instance of this block id: children recorded against the old one no longer match
            self._generation[block.block_id] += 1
            self._parent[block.block_id] = None
            self._parent_hash[block.block_id] = None

    def _grow(self, seq: Sequence, held: _Held, num_tokens: int) -> list[CopyOp] | None:
        num_new = self.pages_for(num_tokens) - len(held.blocks)
        if num_new <= 0:
            return []
        if num_new > self.free_queue.num_free:
            return None
        new = self._take_new(num_new)
        held.blocks.extend(new)
        seq.page_table.extend([b.block_id for b in new])
        return []

    def _commit(self, seq: Sequence, held: _Held, num_computed: int) -> None:
        seq.num_computed = num_computed
        full = num_computed // self.page_size
        if full <= held.num_cached:
            return
        hashes = self._block_hashes(seq, full)
        table = self._table
        setdefault = table.setdefault
        for block, h in zip(held.blocks[held.num_cached : full], hashes[held.num_cached : full], strict=True):
            # write-once: a block's hash is set when it fills and cleared only on eviction
            assert block.block_hash is None, f"apc: block {block.block_id} is hashed already"
            block.block_hash = h
            entry = setdefault(h, block)
            if entry is not block:  # an equal block is cached already: keep both (append-only tables)
                if entry.__class__ is KVBlock:
                    table[h] = {entry.block_id: entry, block.block_id: block}
                else:
                    entry[block.block_id] = block
        if self.verify_tokens:
            self._record_contents(seq, held.blocks, held.num_cached, full)
        self._num_hashed += full - held.num_cached
        held.num_cached = full

    def _record_contents(self, seq: Sequence, blocks: list[KVBlock], start: int, stop: int) -> None:
        size = self.page_size
        tokens = seq.tokens
        for i in range(start, stop):
            bid = blocks[i].block_id
            self._tokens[bid] = tokens[i * size : (i + 1) * size]
            self._extra[bid] = self.hasher.extra_bytes(seq.extra, i)
            prev = blocks[i - 1].block_id if i else None
            self._parent[bid] = None if prev is None else (prev, self._generation[prev])
            self._parent_hash[bid] = None if prev is None else blocks[i - 1].block_hash

    def _fork(self, parent: Sequence, held: _Held, child: Sequence) -> tuple[_Held, list[CopyOp]] | None:
        computed = parent.num_computed
        full = computed // self.page_size
        partial = computed % self.page_size != 0
        if partial and self.free_queue.num_free < 1:
            return None
        shared = held.blocks[:full]
        for block in shared:
            block.ref_cnt += 1  # pinned blocks: none of them is in the free queue
        blocks = list(shared)
        ops: list[CopyOp] = []
        if partial:
            (copy,) = self._take_new(1)
            ops.append(CopyOp(held.blocks[full].block_id, copy.block_id))
            blocks.append(copy)
        child.page_table = [b.block_id for b in blocks]
        child.num_computed = computed
        if parent.cache_memo is not None and parent.cache_memo[0] is self._memo_key:
            child.cache_memo = (self._memo_key, parent.cache_memo[1][:full])
        return _Held(child, blocks, full), ops

    def _release(self, seq: Sequence, held: _Held) -> None:
        queue = self.free_queue
        to_tail: list[KVBlock] = []
        for block in reversed(held.blocks):
            ref = block.ref_cnt - 1
            block.ref_cnt = ref
            if ref == 0:
                if block.block_hash is not None:
                    to_tail.append(block)
                else:
                    queue.appendleft(block)
        queue.append_n(to_tail)
        self._num_cached_free += len(to_tail)

    def _evict(self, num_pages: int) -> int:
        victims = []
        for block in self.free_queue:
            if block.block_hash is not None:
                victims.append(block)
                if len(victims) == num_pages:
                    break
        for block in reversed(victims):
            entry = self._table.pop(block.block_hash)
            if entry is not block:
                self._keep_other_duplicates(block.block_hash, entry, block)
            block.block_hash = None
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)
        if victims:
            self._evicted(victims if self.verify_tokens else [], len(victims))
        return len(victims)

    # -- observation ----------------------------------------------------------------

    def _occupancy(self) -> Occupancy:
        return Occupancy(
            pages_free=self.free_queue.num_free - self._num_cached_free,
            pages_cached=self._num_cached_free,
            metadata_bytes=self.num_pages * _BLOCK_BYTES + self._num_hashed * _ENTRY_BYTES,
            extra={"table_entries": self._num_hashed},
        )

    def pages_pinned(self) -> int:
        return self.num_pages - self.free_queue.num_free  # O(1), no stats dict

    def _page_partition(self) -> PagePartition:
        queued = list(self.free_queue)
        return PagePartition(
            free=[b.block_id for b in queued if b.block_hash is None],
            cached=[b.block_id for b in queued if b.block_hash is not None],
            pinned=[b.block_id for b in self.blocks if b.ref_cnt > 0],
        )

    def cached_blocks_in_lru_order(self) -> list[int]:
        """Ids of cached blocks with no user, next evicted first."""
        return [b.block_id for b in self.free_queue if b.block_hash is not None]

    def _check_invariants(self) -> None:
        from backends.apc_invariants import check_apc

        check_apc(self)
