"""apc: vLLM V1 Automatic Prefix Caching (reference: vLLM 0.33, `vllm/v1/core/`).

A pool of blocks with ref counts, a table from chained block hash to cached block, and the
free queue as the LRU order (docs/design.md §4 apc). What it reproduces, decision for decision:

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
- KV events (`subscribe`): the blocks a commit hashes are stored (vLLM's `BlockStored` from
  `cache_full_blocks`, duplicates included, with the parent block's hash), each evicted
  block removed (`BlockRemoved` from `_maybe_evict_cached_block`), keyed by block hash.

Differences from vLLM, on purpose: there is no reserved null block (vLLM gives block 0 to
it, so vLLM's pool of P blocks has P - 1 usable ones; compare at equal *usable* blocks), and
`evict(n)` exists for the contract (vLLM only evicts lazily): it clears the first `n` cached
blocks of the queue in LRU order and moves them to the head.

How the state is kept (speed, not behaviour): per block a ref count in an array indexed by
block id, the free queue a `BlockQueue` of ids (`cachelib/free_queue.py`), and the hash
table an index (`cachelib/hashing.py`) that holds per block whether it is cached and
answers, per chain position, the oldest cached block of a hash: `RunIndex` for the
built-in hashes, which chain (one entry per run: a commit's blocks, continued by the
sequence's later commits, its next prefill chunks and decode steps; publishing and evicting
do no operation per block on a hash table), `DictIndex` for a custom `hash_fn` (one dict entry
per hash). So admit, commit, release and eviction handle a request's blocks with a fixed
number of numpy calls instead of a Python step per block. `RunIndex` keeps a run's hashes as
one numpy void array and compares them as machine words; with poly128 they are made as
such an array (`_index_keys`), so at page 1 no Python object per block is made or freed
for the hashes (a list of bytes is built only for KV events, the host tier or
verify_tokens). A decode step's page and block take scalar paths (one free id popped,
an evicted block uncached as an int, the held table grown in place, one block hashed from
the memo's last hash and its token bytes, the run continued by one entry: `_take_one`,
`_commit_one`). Arrays grow with the highest
block id handed out, so a pool of 10**9 blocks (`replay` with unlimited capacity) costs
nothing until its blocks are used. For inspection and tests, `cache.blocks[i]` is a view
of block i (`block_id`, `ref_cnt`, `block_hash`) and `cache._table` a view of the hash
table (hash -> oldest block).

Options beyond vLLM: `hash_algorithm`: `poly128` (the chain computed for all of a call's
blocks in a few numpy calls, 128 bits from two 64-bit lanes; its construction and collision
argument are in `cachelib/hashing.py`), vLLM's byte chains `xxh3_128` and `sha256` (one
hash call per block), or `auto` (the default): `poly128` at page sizes up to
`POLY128_MAX_PAGE` (8), where a Python call per block costs more than numpy's fixed cost
per call, `xxh3_128` above (at page 16 the vectorised pass saves little on a prompt and
loses on the few blocks a decode step fills). Decisions are the same with each, a hash
collision aside (tests/test_poly128.py compares them); the events name blocks by the
algorithm in use (`page_keys()`). `hash_kernel`: how an `xxh3_128` chain of many blocks is
computed, `numba` (one compiled loop, cachelib/xxh3_chain.py, the `fast` extra) or `python`
(the `xxhash` package per block, vLLM's way); `auto` (the default) takes numba where it is
installed. Same digests either way: only the time differs. And
`verify_tokens=True`, which stores each cached block's tokens, extra keys and parent, and
accepts a hit only when they equal the request's, so a hash collision can never return
wrong KV. (With it, a block whose parent was a *duplicate* of the block the walk chose is
treated as a miss: conservative, never wrong.)
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from backends.apc_offload import HostTierSpec, OffloadTier
from cachelib.errors import InvalidRequestError
from cachelib.free_queue import BlockQueue
from cachelib.hashing import VECTOR_ALGORITHMS, BlockHash, BlockHasher, DictIndex, HashFn, RunIndex, as_keys
from cachelib.interface import LiveState, Occupancy, PagePartition, PrefixCache
from cachelib.kv_events import PageKeys, PagesRemoved, PagesStored
from cachelib.page_table import PageTable
from cachelib.registry import register_backend
from cachelib.tiers import (
    H200_HOST_READ_GBPS,
    H200_HOST_WRITE_GBPS,
    LLAMA3_8B_KV_BYTES_PER_TOKEN,
    HostTier,
    TierTransfer,
)
from cachelib.types import CopyOp, Match, Sequence

# Modelled bytes of index metadata, as a compact native implementation would keep it:
# per block a ref count (4), links (2 x 4) and a hash (16); per table entry key + block id.
_BLOCK_BYTES = 28
_ENTRY_BYTES = 20

_NO_BLOCKS = np.empty(0, dtype=np.int64)
_NO_KEYS = np.empty(0, dtype="V16")  # no hashes yet (never concatenated: the first ones replace it)
_NOT_PROVEN = (None, _NO_BLOCKS)  # a memo's last proven match and its block ids: none yet
_NOT_MATCHED = (None, None, -1)  # a memo's last hit made by `_match` (pages, handle, epoch): none yet

#: `hash_algorithm="auto"` hashes with poly128 up to this page size, xxh3_128 above: measured
#: on the conversation trace, poly128 takes a 14k-token prompt's blocks at page 1 in about
#: a third of xxh3's time and at page 8 in about half, but at page 16 it saves ~15% on a
#: prompt and costs several times more on the 1-60 blocks of a decode commit
POLY128_MAX_PAGE = 8

#: the host-tier options with their defaults (no host tier): one given without a capacity is an error
_NO_HOST: dict[str, Any] = dict(
    host_capacity_tokens=0,
    host_capacity_gb=0.0,
    host_eviction="lru",
    host_block_size=0,
    offload_prompt_only=True,
    host_read_gbps=H200_HOST_READ_GBPS,
    host_write_gbps=H200_HOST_WRITE_GBPS,
    kv_bytes_per_token=LLAMA3_8B_KV_BYTES_PER_TOKEN,
)


class _Held(LiveState):
    """An admitted sequence: its block ids (`table`, the sequence's own `page_table`, int64),
    how many leading ones are hashed (published), and, with a host tier, its offload state.

    `blocks` is a view of the table's buffer, which grows geometrically: a decode step adding
    a block writes one entry instead of copying the table, and the ids are never copied into
    a list of Python ints (`PageTable`)."""

    __slots__ = ("table", "num_cached", "offload")

    def __init__(self, seq: Sequence, table: PageTable, num_cached: int, offload: Any = None) -> None:
        self.seq = seq
        self.table = seq.page_table = table
        self.num_cached = num_cached
        self.offload = offload

    @property
    def blocks(self) -> np.ndarray:
        return self.table.array()


class BlockView:
    """Block `block_id` of an `APCCache`, seen through the cache's arrays: `ref_cnt`,
    `block_hash` (None = not cached). For inspection and tests; assigning `block_hash`
    re-indexes the block under that hash (tests corrupt a cache on purpose that way)."""

    __slots__ = ("_cache", "block_id")

    def __init__(self, cache: APCCache, block_id: int) -> None:
        self._cache = cache
        self.block_id = block_id

    @property
    def ref_cnt(self) -> int:
        ref = self._cache._ref
        return int(ref[self.block_id]) if self.block_id < ref.size else 0

    @property
    def block_hash(self) -> BlockHash | None:
        index = self._cache.index
        return index.digests([self.block_id])[0] if self.block_id < index.cached.size else None

    @block_hash.setter
    def block_hash(self, value: BlockHash | None) -> None:
        """Re-index the block under `value` (None: uncached) as the youngest of its hash."""
        self._cache._cover(self.block_id + 1)
        self._cache.index.reindex(self.block_id, value)

    def __index__(self) -> int:
        return self.block_id

    def __repr__(self) -> str:
        return f"BlockView({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class _BlockViews:
    """`APCCache.blocks`: block i's `BlockView` at index i, for every block of the pool."""

    __slots__ = ("_cache",)

    def __init__(self, cache: APCCache) -> None:
        self._cache = cache

    def __len__(self) -> int:
        return self._cache.num_pages

    def __getitem__(self, block_id: int) -> BlockView:
        if not 0 <= block_id < self._cache.num_pages:
            raise IndexError(f"block {block_id} outside [0, {self._cache.num_pages})")
        return BlockView(self._cache, block_id)

    def __iter__(self) -> Iterator[BlockView]:
        return (BlockView(self._cache, i) for i in range(self._cache.num_pages))


class _TableView:
    """`APCCache._table`: the hash table as a mapping, hash -> its oldest cached block.
    Assigning `table[h] = block` makes `block` (cached under h) the oldest of h's blocks."""

    __slots__ = ("_index",)

    def __init__(self, index: RunIndex | DictIndex) -> None:
        self._index = index

    def __getitem__(self, h: BlockHash) -> int:
        members = self._index.members(h)
        if not members:
            raise KeyError(h)
        return members[0]

    def __setitem__(self, h: BlockHash, block: object) -> None:
        self._index.make_oldest(h, operator.index(block))

    def __len__(self) -> int:
        return len(self._index.items())

    def __iter__(self) -> Iterator[BlockHash]:
        return (h for h, _ in self._index.items())

    def __contains__(self, h: object) -> bool:
        return isinstance(h, bytes) and bool(self._index.members(h))

    def items(self) -> list[tuple[BlockHash, int]]:
        return [(h, members[0]) for h, members in self._index.items()]


@register_backend("apc")
class APCCache(PrefixCache):
    """vLLM V1 automatic prefix caching over `num_pages` blocks of `page_size` tokens."""

    decode_steps_are_noops = True  # full blocks are published only when they fill
    reuses_kv = True
    emits_kv_events = True  # vLLM's BlockStored when blocks are hashed, BlockRemoved when evicted
    #: the hash table for the built-in (chained) hashes: `RunIndex` (one entry per run of commits)
    #: or `DictIndex` (one per block, what a `hash_fn` always gets: it need not chain).
    #: Speed only: both answer alike, and the tests run on both.
    index_type: ClassVar[type] = RunIndex

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        hash_algorithm: str = "auto",
        hash_kernel: str = "auto",
        hash_fn: HashFn | None = None,
        verify_tokens: bool = False,
        host_capacity_tokens: int = 0,
        host_capacity_gb: float = 0.0,
        host_eviction: str = "lru",
        host_block_size: int = 0,
        offload_prompt_only: bool = True,
        host_read_gbps: float = H200_HOST_READ_GBPS,
        host_write_gbps: float = H200_HOST_WRITE_GBPS,
        kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN,
    ) -> None:
        super().__init__(num_pages, page_size)
        if not isinstance(verify_tokens, bool):
            raise InvalidRequestError(f"verify_tokens must be a bool, got {verify_tokens!r}")
        given = dict(
            host_capacity_tokens=host_capacity_tokens,
            host_capacity_gb=host_capacity_gb,
            host_eviction=host_eviction,
            host_block_size=host_block_size,
            offload_prompt_only=offload_prompt_only,
            host_read_gbps=host_read_gbps,
            host_write_gbps=host_write_gbps,
            kv_bytes_per_token=kv_bytes_per_token,
        )
        #: vLLM 0.33's CPU KV offloading below the GPU blocks (backends/apc_offload.py), or None
        self.host: OffloadTier | None = self._host_tier(page_size, num_pages * page_size, verify_tokens, given)
        if self.host is not None:
            self.memory_tiers = ("gpu", "host")  # per instance: the tier is an option of apc
            self.load_timing = "async"  # vLLM: a request waits for its load (cachelib/tiers.py)
        #: serving's transfer clock (`time_transfers`): the loads and stores not yet taken
        self._transfers: list[TierTransfer] | None = None
        if hash_algorithm == "auto":
            hash_algorithm = "poly128" if page_size <= POLY128_MAX_PAGE else "xxh3_128"
        self.hasher = BlockHasher(page_size, hash_algorithm, hash_fn, hash_kernel)
        self._page_keys = PageKeys(page_size, hash_algorithm, hash_fn)  # what events name blocks by
        self.verify_tokens = verify_tokens
        self.free_queue = BlockQueue(num_pages)
        # per block id, for the ids handed out so far (`_cover`): how many tables hold it
        self._ref = np.zeros(0, dtype=np.int32)
        # the hash table: per block its hash while cached, per hash its blocks, oldest first
        index = DictIndex if self.hasher.algorithm == "custom" else self.index_type
        self.index: RunIndex | DictIndex = index()
        self._key_arrays = self.index.takes_arrays  # how `_index_keys` hands hashes to it
        self._arrays_native = self.hasher.algorithm in VECTOR_ALGORITHMS  # poly128 makes arrays
        self._byte_fn = self.hasher.byte_fn
        #: a decode step's one-block commit takes `_commit_one`: byte chains into a `RunIndex`,
        #: with no contents to record
        self._scalar_commit = self._key_arrays and not self._arrays_native and not verify_tokens
        self._num_cached_free = 0  # hashed blocks with ref 0 (in the free queue)
        self._num_hashed = 0  # hashed blocks = table entries (each hashed block is one entry)
        self._memo_key = object()
        if verify_tokens:
            # what each cached block was computed from: tokens, extra keys, parent instance
            self._tokens = np.zeros((0, page_size), dtype=np.int32)
            self._extra: list[bytes] = []
            self._parent: list[tuple[int, int] | None] = []
            # the parent's hash when recorded: lets check_invariants rehash each cached block
            # from its recorded content, even after its parent block was evicted
            self._parent_hash: list[BlockHash | None] = []
            self._generation: list[int] = []

    @staticmethod
    def _host_tier(page_size: int, gpu_tokens: int, verify_tokens: bool, given: dict[str, Any]) -> OffloadTier | None:
        """The host tier the options ask for (None without a host capacity); a host option
        given without a capacity is an error, not silently dropped."""
        if given["host_capacity_tokens"] == 0 and given["host_capacity_gb"] == 0:
            if type(given["host_capacity_tokens"]) is not int:
                raise InvalidRequestError(f"host_capacity_tokens must be an int, got {given['host_capacity_tokens']!r}")
            stray = [
                k for k, v in given.items() if v != _NO_HOST[k] or isinstance(v, bool) != isinstance(_NO_HOST[k], bool)
            ]
            if stray:
                raise InvalidRequestError(
                    f"{', '.join(stray)} given without host_capacity_tokens or host_capacity_gb (no host tier)"
                )
            return None
        if verify_tokens:
            raise InvalidRequestError(
                "verify_tokens does not cover the host tier (it keys chunks by block hash, as vLLM does): "
                "use one or the other"
            )
        tier = HostTier.build(
            page_size,
            gpu_tokens,
            capacity_tokens=given["host_capacity_tokens"],
            capacity_gb=given["host_capacity_gb"],
            read_gbps=given["host_read_gbps"],
            write_gbps=given["host_write_gbps"],
            kv_bytes_per_token=given["kv_bytes_per_token"],
        )
        spec = HostTierSpec.from_options(
            page_size, tier, given["host_eviction"], given["host_block_size"], given["offload_prompt_only"]
        )
        return OffloadTier(spec)

    @property
    def blocks(self) -> _BlockViews:
        """Every block as a `BlockView` (`cache.blocks[i].ref_cnt`, `.block_hash`)."""
        return _BlockViews(self)

    @property
    def _table(self) -> _TableView:
        """The hash table as a mapping view: hash -> its oldest cached block."""
        return _TableView(self.index)

    def _cover(self, need: int) -> None:
        """Make the per-block arrays cover ids `0 .. need - 1` (doubling, at most num_pages)."""
        have = self._ref.size
        if need <= have:
            return
        size = min(self.num_pages, max(need, 2 * have, 1024))
        more = size - have
        self._ref = np.concatenate([self._ref, np.zeros(more, dtype=np.int32)])
        self.index.cover(size)
        if self.verify_tokens:
            self._tokens = np.concatenate([self._tokens, np.zeros((more, self.page_size), dtype=np.int32)])
            self._extra += [b""] * more
            self._parent += [None] * more
            self._parent_hash += [None] * more
            self._generation += [0] * more

    # -- hashing --------------------------------------------------------------------

    def _hashed(self, seq: Sequence, num_blocks: int) -> list:
        """`seq`'s memo, `[owner, hashes as a list, hashes as a void array, (the last match
        `_verify_match` proved, its block ids as an int64 array), (the pages tuple and handle
        of the last hit `_match` made for it, the epoch then)]`, with the
        hasher's own form (poly128: the array; the byte chains: the list) covering at least
        its first `num_blocks` full blocks. The other form is brought up to date on demand
        (`_block_hashes`, `_index_keys`), so each call converts only what is new. (The byte
        chain by the compiled loop computes many blocks as an array: it fills both forms.)"""
        memo = seq.cache_memo
        if memo is None or memo[0] is not self._memo_key:
            memo = seq.cache_memo = [self._memo_key, [], _NO_KEYS, _NOT_PROVEN, _NOT_MATCHED]
        hasher = self.hasher
        if self._arrays_native:
            keys = memo[2]
            have = keys.size
            if have < num_blocks:
                new = hasher.hash_keys(
                    seq.tokens, seq.extra, have, num_blocks, keys[have - 1 : have].tobytes() if have else None
                )
                memo[2] = np.concatenate([keys, new]) if have else new
        else:
            keys = memo[1]
            have = len(keys)
            if have + 1 == num_blocks:  # one block (a decode step's): no array round trip
                size = self.page_size
                block = seq.token_bytes(have * size, num_blocks * size)
                keys.append(hasher.hash_block(keys[-1] if have else None, block, hasher.extra_bytes(seq.extra, have)))
            elif have < num_blocks:
                # (the compiled chain makes the array too, the index's form: no join later)
                new, new_keys = hasher.hash_blocks_and_keys(
                    seq.tokens, seq.extra, have, num_blocks, keys[-1] if have else None
                )
                if have:
                    keys.extend(new)
                else:  # (the list made is the memo's: no copy into it)
                    memo[1] = new
                if new_keys is not None and memo[2].size == have:
                    memo[2] = np.concatenate([memo[2], new_keys]) if have else new_keys
        return memo

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of `seq`'s first `num_blocks` full blocks (at least; memoised
        on seq) as a list of bytes: KV events, the host tier, verify_tokens, `DictIndex`."""
        memo = self._hashed(seq, num_blocks)
        hashes, keys = memo[1], memo[2]
        if len(hashes) < keys.size:
            hashes.extend(keys[len(hashes) :].tolist())
        return hashes

    def _index_keys(self, seq: Sequence, num_blocks: int) -> np.ndarray | list[BlockHash]:
        """The same hashes as the index takes them: `RunIndex` a void array (one buffer,
        no Python object per block: with poly128 none is ever made on this path), `DictIndex`
        the list."""
        if not self._key_arrays:
            return self._block_hashes(seq, num_blocks)
        return self._keys_of(self._hashed(seq, num_blocks))

    @staticmethod
    def _keys_of(memo: list) -> np.ndarray:
        """The memo's array form brought up to its list (byte chains: the hashes not yet
        in it joined once)."""
        hashes, keys = memo[1], memo[2]
        if keys.size < len(hashes):
            new = as_keys(hashes[keys.size :] if keys.size else hashes)
            keys = memo[2] = np.concatenate([keys, new]) if keys.size else new
        return keys

    def _commit_keys(
        self, seq: Sequence, start: int, full: int
    ) -> tuple[np.ndarray | list[BlockHash], BlockHash | None]:
        """The hashes of blocks `start .. full - 1` as the index takes them, and the hash of
        block `start - 1` (None for the first block, or for `DictIndex`, which chains nothing).
        A decode step's block comes as a one-item list when the byte chain's list has it
        and the array does not: no copy of the sequence's whole array to add one item."""
        if not self._key_arrays:
            return self._block_hashes(seq, full)[start:full], None
        memo = self._hashed(seq, full)
        hashes, keys = memo[1], memo[2]
        if keys.size <= start:  # the array has none of them: the list has them all
            return hashes[start:full], hashes[start - 1] if start else None
        keys = self._keys_of(memo)
        return keys[start:full], keys[start - 1 : start].tobytes() if start else None

    # -- the contract: the hooks the base class calls after its checks -----------------

    def _match(self, seq: Sequence) -> tuple[int, tuple[int, ...], list[int]]:
        max_blocks = (len(seq) - 1) // self.page_size
        if self.verify_tokens:
            hit = self._verified_walk(seq, self._block_hashes(seq, max_blocks)[:max_blocks])
        else:  # the oldest block of each hash, up to the first miss
            keys = self._index_keys(seq, max_blocks)[:max_blocks]
            listed = seq.cache_memo[1]  # the byte chains' own form (poly128: empty, not passed)
            hit = self.index.first_run(keys, listed if len(listed) >= max_blocks else None)
        pages = tuple(hit)
        if hit:  # what `_verify_match` need not prove again (the tuple is immutable: `is` names it)
            seq.cache_memo[4] = (pages, hit, self._epoch)
        return len(hit) * self.page_size, pages, hit

    def _verified_walk(self, seq: Sequence, hashes: list[BlockHash], chosen: list[int] | None = None) -> list[int]:
        """The longest run of cached blocks whose recorded contents are `seq`'s first blocks.
        With `chosen`, only those blocks are candidates (re-checking a match's hit)."""
        size = self.page_size
        tokens = seq.tokens
        hit: list[int] = []
        found_at = None if chosen is not None else self.index.candidates(hashes)
        for i in range(len(hashes)):
            if chosen is not None:
                candidates = [chosen[i]]
            elif i < len(found_at):
                candidates = found_at[i]
            else:
                break
            want_parent = None if i == 0 else (hit[-1], self._generation[hit[-1]])
            extra = self.hasher.extra_bytes(seq.extra, i)
            block_tokens = tokens[i * size : (i + 1) * size]
            found = None
            for bid in candidates:
                if (
                    self._parent[bid] == want_parent
                    and self._extra[bid] == extra
                    and np.array_equal(self._tokens[bid], block_tokens)
                ):
                    found = bid
                    break
            if found is None:
                break
            hit.append(found)
        return hit

    def _verify_match(self, seq: Sequence, match: Match) -> None:
        """The hit must be this cache's blocks (not evicted since: the epoch says so), holding
        `seq`'s first blocks: their hashes equal the sequence's chained hashes (and, with
        `verify_tokens`, their recorded tokens, extra keys and parents equal its own).
        A match proven already (`can_admit`, then `admit` with the same match) is proven
        still: the base class found its epoch current, so no block was evicted since, and
        the sequence's first blocks cannot change."""
        memo = seq.cache_memo
        ours = memo is not None and memo[0] is self._memo_key
        if ours and memo[3][0] is match:
            return
        hit, pages = match.handle, match.pages
        if ours and memo[4][0] is pages and memo[4][1] is hit and memo[4][2] == self._epoch:
            # the very pages `_match` found for this sequence, at this epoch: nothing was
            # evicted since, so they still hold its blocks (no need to re-read the index)
            if len(pages) * self.page_size == match.num_tokens:
                memo[3] = (match, np.array(pages, dtype=np.int64))  # for `_hit_ids`
                return
        n = len(pages)
        ids = np.asarray(pages)
        if (
            hit.__class__ is not list
            or len(hit) != n
            or n * self.page_size != match.num_tokens
            or hit != list(pages)
            or (n and (ids.dtype != np.int64 or ids.view(np.uint64).max() >= self._ref.size))
        ):
            raise InvalidRequestError(
                f"request {seq.request_id!r}: the match's blocks are not this cache's (another cache's match, or forged)"
            )
        if (n and not self.index.holds(ids, self._index_keys(seq, n)[:n])) or (
            self.verify_tokens and len(self._verified_walk(seq, self._block_hashes(seq, n)[:n], hit)) != n
        ):
            raise InvalidRequestError(
                f"request {seq.request_id!r}: the match's blocks hold other tokens (a match made for another sequence)"
            )
        if n:
            self._hashed(seq, 0)[3] = (match, ids)  # for `_hit_ids` (scratch: not cache state)

    def _hit_ids(self, seq: Sequence, match: Match) -> np.ndarray:
        """The hit's block ids as an array: the one `_verify_match` just made for this very
        match (it runs first in `admit` and `can_admit`), else made here."""
        if not match.num_tokens:
            return _NO_BLOCKS
        memo = seq.cache_memo
        if memo is not None and memo[0] is self._memo_key and memo[3][0] is match:
            return memo[3][1]
        return np.array(match.pages, dtype=np.int64)

    def _can_admit(self, seq: Sequence, match: Match, num_tokens: int) -> bool:
        """vLLM's `allocate_slots` check: the new blocks fit in the free queue, less the hit
        blocks still in it (they are about to leave it: they are not free for us)."""
        return self._fits(self._hit_ids(seq, match), num_tokens)

    def _host_load(self, seq: Sequence, match: Match, num_tokens: int) -> int:
        """Tokens to load from the host after the GPU hit (rules R2, R3 of apc_offload).
        Read-only. A first chunk (serving) that ends inside the load recomputes instead,
        so the table never passes `num_tokens` (vLLM would load the whole hit outside the
        token budget); the replay admits whole prompts, where this never happens."""
        size = self.page_size
        loaded = self.host.lookup_tokens(self._block_hashes(seq, len(seq) // size), match.num_tokens, len(seq))
        # the whole prompt admitted: a load may reach its end (R3); a first chunk: only a
        # load that leaves something of the chunk to compute
        return loaded if match.num_tokens + loaded < num_tokens or num_tokens == len(seq) else 0

    def _fits(self, hit: np.ndarray, num_tokens: int) -> bool:
        return self._fits_with(hit.size, int(np.count_nonzero(self._ref[hit] == 0)) if hit.size else 0, num_tokens)

    def _fits_with(self, num_hit: int, num_free_hit: int, num_tokens: int) -> bool:
        """The fit test of `_fits`, given the hit's size and how many of its blocks are in
        the free queue (`_admit` has those blocks at hand: it takes them out next)."""
        return self.pages_for(num_tokens) - num_hit <= self.free_queue.num_free - num_free_hit

    def _admit(self, seq: Sequence, match: Match, num_tokens: int) -> tuple[_Held, list[CopyOp]] | None:
        hit = self._hit_ids(seq, match)
        if hit.size:
            ref = self._ref
            waiting = hit[ref[hit] == 0]  # cached blocks nobody uses: a hit takes them out of the queue
            if not self._fits_with(hit.size, waiting.size, num_tokens):
                return None
            if waiting.size:
                self.free_queue.remove_queued(waiting)  # (ref 0: queued; a match's blocks are distinct)
                self._num_cached_free -= waiting.size
            ref[hit] += 1
            table = PageTable.of(hit, self._take_new(self.pages_for(num_tokens) - hit.size))
        else:
            if not self._fits_with(0, 0, num_tokens):
                return None
            table = PageTable.of(self._take_new(self.pages_for(num_tokens)))
        held = _Held(seq, table, hit.size)  # the sequence's page table from here
        seq.num_computed = match.num_tokens
        if self.host is not None:  # R4: the load (instantaneous); the loaded blocks are hashed at commit
            size = self.page_size
            loaded = self._host_load(seq, match, num_tokens)
            held.offload = self.host.admit(
                self._block_hashes(seq, len(seq) // size), match.num_tokens, loaded, seq.page_table
            )
            # R3: every token not recomputed (a load reaching the whole prompt recomputes the last)
            seq.num_computed = min(match.num_tokens + loaded, len(seq) - 1)
            if loaded and self._transfers is not None:
                self._transfers.append(TierTransfer("host", "gpu", loaded, seq.request_id))
            return held, self.host.take_moves()
        return held, []

    def _take_one(self) -> int:
        """`_take_new(1)` as a plain int: a decode step's block, with scalar steps."""
        queue = self.free_queue
        block = queue.popleft_one()
        ref = self._ref
        if block >= ref.size:  # (ids are handed out in order: this one is the highest)
            self._cover(block + 1)
            ref = self._ref
        elif self.index.is_cached(block):  # lazy eviction, as in `_take_new`
            self._uncache_one(block)
        ref[block] = 1
        return block

    def _uncache_one(self, block: int) -> None:
        """`_uncache` of one block given as an int."""
        listener = self._kv_listener
        keys = self.index.digests([block]) if listener is not None else None
        self.index.remove_one(block)
        if self.verify_tokens:
            self._evicted(np.array([block], dtype=np.int64))
        else:  # `_evicted`'s book-keeping, for one block
            self._num_cached_free -= 1
            self._num_hashed -= 1
            self._counters["evicted_pages"] += 1
            self._epoch += 1
        if keys is not None:
            listener.on_kv_event(PagesRemoved(keys))

    def _take_new(self, n: int) -> np.ndarray:
        """Pop `n` blocks from the queue head, evicting those that still hold a cached block."""
        queue = self.free_queue
        new = queue.popleft_n(n)
        if queue.num_used > self._ref.size:
            self._cover(queue.num_used)
        # lazy eviction: a block leaves the table only now
        if self._kv_listener is None:  # (one pass over the blocks' index entries)
            victims = self.index.remove_cached(new)
            if victims.size:
                self._evicted(victims)
        else:  # (the events name the victims by hash: read before they leave the index)
            cached = self.index.cached_among(new)
            if cached.any():
                self._uncache(new[cached])
        # (a queued block has no user: check_invariants proves it, no per-call test here)
        self._ref[new] = 1
        return new

    def _uncache(self, victims: np.ndarray) -> None:
        """Take the cached blocks `victims` out of the hash table: vLLM's
        `_maybe_evict_cached_block`, which emits a `BlockRemoved` for each."""
        listener = self._kv_listener
        keys = self.index.digests(victims) if listener is not None else None
        self.index.remove(victims)
        self._evicted(victims)
        if keys is not None:
            listener.on_kv_event(PagesRemoved(keys))

    def _evicted(self, blocks: np.ndarray) -> None:
        """Book-keeping for the cached blocks just evicted."""
        count = blocks.size
        self._num_cached_free -= count
        self._num_hashed -= count
        self._counters["evicted_pages"] += count
        self._epoch += 1
        if self.verify_tokens:
            for block in blocks.tolist():
                # a new instance of this block id: children recorded against the old one no longer match
                self._generation[block] += 1
                self._parent[block] = None
                self._parent_hash[block] = None

    def _grow(self, seq: Sequence, held: _Held, num_tokens: int) -> list[CopyOp] | None:
        table = held.table
        num_new = -(-num_tokens // self.page_size) - len(table)  # (`pages_for`, inlined)
        if num_new > self.free_queue.num_free:
            return None
        if num_new == 1:  # a decode step's page
            table.append(self._take_one())
        elif num_new > 0:
            table.extend(self._take_new(num_new))
        if self.host is not None and self.host.moves:  # host stores decided since the last call
            return self.host.take_moves()
        return []

    def _commit(self, seq: Sequence, held: _Held, num_computed: int) -> None:
        seq.num_computed = num_computed
        full = num_computed // self.page_size
        start = held.num_cached
        if held.offload is not None:
            self._offer_host(seq, held, num_computed)
        if full <= start:
            return
        if full == start + 1 and start and self._scalar_commit and self._commit_one(seq, held, start):
            return
        ids = held.blocks[start:full]
        # write-once: a block's hash is set when it fills and cleared only on eviction
        # (check_invariants proves a table's first num_cached blocks are exactly its hashed ones)
        # an equal block cached already keeps answering lookups; this one is its duplicate
        # (tables are append-only)
        keys, parent = self._commit_keys(seq, start, full)
        self.index.add(ids, keys, start, None if parent is None else (int(held.blocks[start - 1]), parent))
        if self.verify_tokens:
            self._record_contents(seq, held.blocks, start, full)
        self._num_hashed += full - start
        held.num_cached = full
        if self._kv_listener is not None:  # vLLM's BlockStored from cache_full_blocks
            hashes = self._block_hashes(seq, full)
            self._emit_kv_event(PagesStored(hashes[start:full], hashes[start - 1] if start else None))

    def _commit_one(self, seq: Sequence, held: _Held, start: int) -> bool:
        """`_commit` of block `start` alone (a decode step's; start > 0), with scalar steps:
        hashed from the memo's last hash and the block's token bytes, added to the index as
        ints and bytes. False (nothing done) where the memo is not in the form this needs
        (its list ending at block `start - 1`, its array not past it): the general path
        then. Same hash, same index entry, same event as the general path."""
        memo = seq.cache_memo
        if memo is None or memo[0] is not self._memo_key:
            return False
        hashes = memo[1]
        if len(hashes) != start or memo[2].size > start:
            return False
        size = self.page_size
        parent = hashes[-1]
        extra = seq.extra
        data = parent + seq.token_bytes(start * size, start * size + size)
        if extra.lora_id is not None or extra.mm:  # (a salt enters block 0 only)
            data += self.hasher.extra_bytes(extra, start)
        h = self._byte_fn(data)
        hashes.append(h)
        table = held.table
        self.index.add_one(table.item(start), h, start, table.item(start - 1), parent)
        self._num_hashed += 1
        held.num_cached = start + 1
        if self._kv_listener is not None:  # vLLM's BlockStored from cache_full_blocks
            self._emit_kv_event(PagesStored([h], parent))
        return True

    def _offer_host(self, seq: Sequence, held: _Held, num_computed: int, final: bool = False) -> None:
        """R5: offer the chunks that are computed and allocated to the host tier (at release,
        `final`: the last offer, then the request's finish). A match is the GPU's alone, so
        a host eviction leaves earlier matches valid: the load is decided in `admit`."""
        host = self.host
        num_chunks = host.storable_chunks(min(num_computed, len(seq)), held.blocks.size, seq.prompt_len)
        offload = held.offload
        if num_chunks <= offload.next_stored and not final:
            return  # nothing new (every decode step of a prompt-only tier ends here)
        hashes = self._block_hashes(seq, num_chunks * host.spec.blocks_per_chunk)
        prompt_chunks = host.storable_chunks(seq.prompt_len, held.blocks.size, seq.prompt_len)
        blocks = seq.page_table
        stored = host.counters["stored_chunks"]
        if final:
            host.finish(offload, hashes, num_chunks, prompt_chunks, blocks)
        else:
            host.offer(offload, hashes, num_chunks, prompt_chunks, blocks)
        stored = host.counters["stored_chunks"] - stored
        if stored and self._transfers is not None:
            tokens = stored * host.spec.chunk_tokens
            self._transfers.append(TierTransfer("gpu", "host", tokens, seq.request_id))

    def _record_contents(self, seq: Sequence, blocks: np.ndarray, start: int, stop: int) -> None:
        size = self.page_size
        tokens = seq.tokens
        ids = blocks.tolist()
        for i in range(start, stop):
            bid = ids[i]
            self._tokens[bid] = tokens[i * size : (i + 1) * size]
            self._extra[bid] = self.hasher.extra_bytes(seq.extra, i)
            prev = ids[i - 1] if i else None
            self._parent[bid] = None if prev is None else (prev, self._generation[prev])
            self._parent_hash[bid] = None if prev is None else self.index.digests([prev])[0]

    def _fork(self, parent: Sequence, held: _Held, child: Sequence) -> tuple[_Held, list[CopyOp]] | None:
        computed = parent.num_computed
        full = computed // self.page_size
        partial_block = computed % self.page_size != 0
        if partial_block and self.free_queue.num_free < 1:
            return None
        shared = held.blocks[:full]
        self._ref[shared] += 1  # pinned blocks: none of them is in the free queue
        ops: list[CopyOp] = []
        if partial_block:
            copy = self._take_new(1)
            ops.append(CopyOp(int(held.blocks[full]), int(copy[0])))
            blocks = np.concatenate([shared, copy])
        else:
            blocks = shared.copy()
        child.num_computed = computed
        memo = parent.cache_memo
        if memo is not None and memo[0] is self._memo_key:
            child.cache_memo = [self._memo_key, memo[1][:full], memo[2][:full], _NOT_PROVEN, _NOT_MATCHED]
        if self.host is not None and self.host.moves:
            ops = [*self.host.take_moves(), *ops]
        return _Held(child, PageTable.of(blocks), full), ops

    def _release(self, seq: Sequence, held: _Held) -> None:
        if held.offload is not None:  # R5, R10: the final offer and the request's finish
            self._offer_host(seq, held, seq.num_computed, final=True)
        # vLLM frees the table last block first: of the blocks nobody uses any more, hashed
        # ones go to the tail in that order (evicted late), the others to the head (reused
        # first) (check_invariants proves a table's hashed blocks are exactly its first
        # num_cached, so the split needs no look at the index)
        blocks, k = held.blocks, held.num_cached
        left = self._ref[blocks]
        left -= 1
        self._ref[blocks] = left
        if np.count_nonzero(left):  # some are still another table's (a fork's, or a hit shared)
            unused = left == 0
            to_head, to_tail = blocks[k:][unused[k:]], blocks[:k][unused[:k]]
        else:
            to_head, to_tail = blocks[k:], blocks[:k]
        self.free_queue.appendleft_n(to_head)  # (the first of them ends up at the head)
        self.free_queue.append_n(to_tail[::-1])
        self._num_cached_free += to_tail.size

    def _evict(self, num_pages: int) -> int:
        queued = self.free_queue.ids(fresh=False)
        victims = queued[self.index.cached_among(queued)][:num_pages]
        if victims.size:
            self._uncache(victims)
            self.free_queue.remove_n(victims)
            self.free_queue.appendleft_n(victims)  # the first victim at the head
        return int(victims.size)

    # -- KV events ------------------------------------------------------------------

    def page_keys(self) -> PageKeys:
        """The block hashes themselves (vLLM's events carry them)."""
        return self._page_keys

    def _kv_subscribed(self) -> None:
        if self._num_hashed:
            raise InvalidRequestError(
                f"subscribe to an apc cache's KV events before it caches a block (it holds {self._num_hashed})"
            )
        if self.host is not None:  # the host tier publishes its chunks too (medium "CPU")
            self.host.emit = self._emit_kv_event

    # -- observation ----------------------------------------------------------------

    def _occupancy(self) -> Occupancy:
        extra: dict[str, Any] = {"table_entries": self._num_hashed}
        if self.host is not None:
            extra["host_cached_tokens"] = self.host.num_cached() * self.host.spec.chunk_tokens
        return Occupancy(
            pages_free=self.free_queue.num_free - self._num_cached_free,
            pages_cached=self._num_cached_free,
            metadata_bytes=self.num_pages * _BLOCK_BYTES + self._num_hashed * _ENTRY_BYTES,
            extra=extra,
        )

    # -- tiers ------------------------------------------------------------------------

    # -- transfer timing (serving) ------------------------------------------------------

    def time_transfers(self) -> None:
        """Record loads and stores for the serving clock (`TierTransfer`s with the request's
        id: vLLM's scheduler waits for a request's load, and keeps a finished request's blocks
        until its stores complete). The host side stays instantaneous: a chunk is ready as
        soon as its store is decided (vLLM's pending chunks, HIT_PENDING, are not modelled)."""
        if self.host is None:
            super().time_transfers()
        if self._live:
            raise InvalidRequestError("time_transfers: call it before the first request")
        self._transfers = []

    def take_transfers(self) -> list[TierTransfer]:
        if not self._transfers:
            return []
        out, self._transfers = self._transfers, []
        return out

    def _tier_link_seconds(self, src: str, dst: str, tokens: int) -> float:
        if self.host is not None and (src, dst) in (("host", "gpu"), ("gpu", "host")):
            return self.host.spec.tier.transfer_seconds(tokens, write=dst == "host")
        return super()._tier_link_seconds(src, dst, tokens)

    def tier_bytes(self, tokens: int) -> int:
        if self.host is None:
            return super().tier_bytes(tokens)
        return self.host.spec.tier.bytes_of(tokens)

    def tier_traffic(self) -> dict[str, int]:
        """Tokens (and bytes) moved between the GPU and the host so far, and what the host
        holds; empty without a host tier. `loaded` counts every token copied back, including
        a last prompt token then recomputed (rule R3)."""
        if self.host is None:
            return {}
        return self.host.traffic()

    def tier_capacities(self) -> dict[str, int]:
        gpu = {"gpu": self.num_pages * self.page_size}
        return gpu if self.host is None else gpu | {"host": self.host.capacity_tokens()}

    def pages_pinned(self) -> int:
        return self.num_pages - self.free_queue.num_free  # O(1), no stats dict

    def _page_partition(self) -> PagePartition:
        queued = self.free_queue.ids()
        hashed = np.zeros(queued.size, dtype=bool)
        cached = self.index.cached
        used = queued < cached.size
        hashed[used] = cached[queued[used]]
        return PagePartition(
            free=queued[~hashed].tolist(),
            cached=queued[hashed].tolist(),
            pinned=np.flatnonzero(self._ref > 0).tolist(),
        )

    def cached_blocks_in_lru_order(self) -> list[int]:
        """Ids of cached blocks with no user, next evicted first."""
        queued = self.free_queue.ids(fresh=False)
        return queued[self.index.cached_among(queued)].tolist()

    def _check_invariants(self) -> None:
        from backends.apc_invariants import check_apc

        check_apc(self)
