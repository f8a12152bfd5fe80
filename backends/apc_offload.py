"""apc's host tier: vLLM 0.33's CPU KV offloading (`OffloadingConnector` + `CPUOffloadingSpec`).

`--backend apc --backend-opt host_capacity_tokens=N [--backend-opt host_eviction=lru|arc]`
puts a host-memory tier of N tokens under apc's GPU blocks, deciding what vLLM 0.33.0 decides
(scheduler side; the worker's copies are instantaneous, see below). The tier's capacity,
bandwidths and KV bytes per token are `cachelib.tiers.HostTier` (shared with radix-hicache);
`HostTierSpec` adds what vLLM's CPU offloading decides by: its unit, eviction policy and
whether decode blocks are stored. A match is the GPU's alone; `admit` decides the load and
leaves `seq.num_computed` at every token not recomputed (the `PrefixCache.memory_tiers`
convention).

The rules, each with the vLLM 0.33.0 source it is read from (paths under `vllm/`):

R1  Unit. The offloaded unit is a *chunk* of `blocks_per_chunk` GPU blocks (extra config
    `block_size`, a multiple of the GPU block size; default one block), keyed by the block
    hash of its *last* block. (distributed/kv_transfer/kv_connector/v1/offloading/config.py:
    `build_offloading_config`; offloading/scheduler.py: `RequestOffloadState.update_offload_keys`)
    Capacity: `num_chunks = cpu_bytes_to_use // bytes per chunk` (v1/kv_offload/cpu/spec.py:
    `CPUOffloadingSpec.__init__`); here `host_capacity_tokens // chunk tokens`.
R2  Lookup after the GPU hit. The GPU prefix cache answers first (its hit capped at
    `len - 1`, rounded to a block); the connector then looks up chunks from
    `gpu_hit // chunk_tokens` on, counting consecutive ready chunks up to the first miss, bounded
    by `len(seq)` (not `len - 1`) and by the chunks the request's full blocks key. A hit of
    less than one chunk past the GPU hit is no hit. (offloading/scheduler.py:
    `_lookup_complete_chunks`, `_maximal_prefix_lookup`; v1/core/sched/scheduler.py:
    `Scheduler.schedule` "Get externally-cached tokens")
R3  A load that reaches the whole prompt recomputes its last token: the tokens not
    recomputed are `min(gpu + loaded, len - 1)`, while `loaded` tokens were copied back.
    A chunk the GPU also holds (the last block of a fully cached prompt, which the GPU hit's
    `len - 1` cap leaves out) is loaded again into a new block, which becomes a duplicate of
    the GPU's. (v1/core/sched/scheduler.py: `_update_waiting_for_remote_kv`
    "num_computed_tokens == request.num_tokens")
R4  Load. The loaded blocks are new GPU blocks (allocated as any others, so they may evict
    GPU-cached ones); the chunks they come from are pinned (`prepare_load`: ref count + 1,
    recorded as *reused* by the request) until the copy completes (`complete_load`). The host
    copy stays. After a load, the chunks the load reached (`cdiv(gpu + loaded, chunk)`) are
    not offered for storing again; without a load every chunk from 0 is offered.
    (offloading/scheduler.py: `update_state_after_alloc` "Skip prefix-hit chunks";
    cpu/manager.py: `prepare_load`, `complete_load`)
R5  Store: as blocks fill. Each step, the request's chunks whose blocks are all computed
    after the step and allocated, from `next_stored_chunk_idx`, are offered; with
    `offload_prompt_only` (vLLM's default, True) only prompt tokens count. A finished request
    is offered once more up to `max(prompt, num_tokens - 1)` (its computed tokens).
    (offloading/scheduler.py: `_build_store_jobs`, `_calc_num_offloadable_tokens`,
    `RequestOffloadState.storable_chunks`; v1/kv_offload/base.py: `offload_prompt_only`)
R6  `prepare_store` (cpu/manager.py): offered chunks already on the host and ready are
    *reused* (no copy); the others are stored. If the free chunks are short, the policy
    evicts the shortfall from ready, unpinned chunks, never one of the offered chunks; if it
    cannot (`shortfall > evictable`, or too few unprotected candidates), nothing is stored
    and `next_stored_chunk_idx` does not move: the offer is retried the next step.
    Otherwise `next_stored_chunk_idx` moves past the offered chunks.
R7  LRU (cpu/policies/lru.py): each chunk has a rank; eviction takes the lowest. A request
    gets one rank R at its first access; a chunk it stores or first touches (load, reuse at
    store) gets `(R, -end_token)` if that raises its rank, so within a request the deepest
    chunk goes first. At request finish, every chunk it touched that is still cached gets a
    fresh rank, tail first, so the head is the most recent (`on_request_finished`).
R8  ARC (cpu/policies/arc.py): T1/T2 (LRU order) and ghost lists B1/B2 (each at most
    capacity). A store inserts into T1 and removes the key from B1/B2; before it, a store
    miss found in B1 raises the T1 target by `max(1, |B2|/|B1|)`, one in B2 lowers it by
    `max(1, |B1|/|B2|)` (once per key per request, `on_store_miss`). At request finish,
    tail to head: a chunk only inserted by the request moves to the MRU end of its list; a
    reused one moves from T1 to T2's MRU end (or to T2's MRU end). Eviction: from T1's LRU
    end while `|T1| >= int(target)`, else from T2's, else T1's; evicted keys go to B1/B2.
R9  GPU eviction never writes to the host (stores happen as blocks fill, R5), and a host
    eviction never touches the GPU: the tiers are independent caches of the same keys.
R10 Request-finish order. A request's final offer (R5) and `on_request_finished` (R7, R8)
    run before the next request is scheduled (the engine flushes `finished_req_ids` in a
    step of their own when nothing else runs).

Where the decisions sit in the contract: `match` is the GPU's lookup alone; `admit` looks the
host up (vLLM: `get_num_new_matched_tokens` at scheduling), allocates the GPU blocks for the
GPU hit and `num_tokens`, loads (`update_state_after_alloc`) and sets `seq.num_computed` to every token not
recomputed (a first chunk in serving that ends inside the load recomputes instead: a
table never passes what admit was asked for); `commit` offers what filled; `release` makes
the final offer and ends the request. So `per_request_hits_by_tier` counts, per request, the tokens not recomputed that
were on the GPU and those loaded from the host; `tier_traffic()["loaded"]` counts every
token copied back, the last token of a prompt loaded whole (then recomputed) included, as
vLLM's `num_external_tokens` does.

The executor sees each copy as a `TierCopy` (cachelib/types.py): one per block stored
(GPU block -> host page) or loaded (host page -> new GPU block), host page = chunk slot x
blocks per chunk + the block's place in its chunk, handed out in decision order with the
next `admit`, `grow` or `fork` (before that call's own copies), so a GPU block is read
before anything reuses it.

Transfers are instantaneous on the host side (the replay protocol's optimistic timing; under
serving `APCCache.time_transfers` reports each load and store to the engine, which makes the
request wait for its load and a finished request keep its blocks until its stores end,
experiments/engine/transfers.py): a load's
`prepare_load` and `complete_load` happen inside `admit`, a store's `prepare_store` and
`complete_store` inside the `commit` that fills its blocks; so no chunk is ever pending
between calls, and vLLM's "delay while in flight" paths (HIT_PENDING, `_chunks_being_loaded`)
never trigger. KV events of the host tier follow the connector's default (legacy)
payloads (`offloading/events.py` `OffloadingEventsTracker`, `kv_offload/cpu/manager.py`):
medium "CPU", a `BlockStored` per chunk stored (its key, no parent) at `complete_store`,
a `BlockRemoved` of the chunks `prepare_store` evicts, each naming the chunk by its key
(its last block's hash: the block's own key at one block per chunk). Not modelled:
`store_threshold` (vLLM's default 0 = off), sliding-window / Mamba / EAGLE groups,
partial-tail chunks, `max_load_tokens`, sync loads, the self-describing event payloads
(opt-in), and preemption (a released request is a finished one; a re-admitted one is new).
A forked child (parallel sampling) shares its parent's blocks and offers nothing itself.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

from cachelib.errors import InvalidRequestError, InvariantViolation
from cachelib.kv_events import VLLM_CPU_MEDIUM, PagesRemoved, PagesStored
from cachelib.tiers import HostTier
from cachelib.types import TierCopy

HOST_EVICTION_POLICIES = ("lru", "arc")


@dataclass(frozen=True)
class HostTierSpec:
    """The host tier as vLLM's CPU offloading sees it: the tier (capacity, bandwidths, bytes
    per token), its unit, its eviction policy, whether decode blocks are stored."""

    tier: HostTier
    chunk_tokens: int  # the offloaded unit (vLLM's extra config `block_size`)
    page_size: int  # the GPU block size
    eviction: str = "lru"
    offload_prompt_only: bool = True

    @classmethod
    def from_options(
        cls, page_size: int, tier: HostTier, eviction: Any, block_size: Any, offload_prompt_only: Any
    ) -> HostTierSpec:
        """Check the options (a clear error before any work) and build the spec."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
            raise InvalidRequestError(f"host_block_size must be a non-negative int, got {block_size!r}")
        if not isinstance(offload_prompt_only, bool):
            raise InvalidRequestError(f"offload_prompt_only must be a bool, got {offload_prompt_only!r}")
        if eviction not in HOST_EVICTION_POLICIES:
            raise InvalidRequestError(
                f"host_eviction must be one of {', '.join(HOST_EVICTION_POLICIES)} (vLLM 0.33's CPU "
                f"offloading policies), got {eviction!r}"
            )
        chunk = block_size or page_size
        if chunk % page_size:
            raise InvalidRequestError(
                f"host_block_size {block_size} must be a multiple of the GPU page size {page_size} "
                f"(vLLM: 'block_size' must be a multiple of the GPU KV cache block size)"
            )
        if tier.capacity_tokens < chunk:
            raise InvalidRequestError(
                f"a host tier of {tier.capacity_tokens} tokens is smaller than one host block of {chunk} tokens"
            )
        return cls(tier, chunk, page_size, eviction, offload_prompt_only)

    @property
    def num_chunks(self) -> int:
        return self.tier.capacity_tokens // self.chunk_tokens

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.page_size


class _Chunk:
    """One host slot: `ref_cnt` -1 while its store is in flight, else the loads reading it."""

    __slots__ = ("ref_cnt", "chunk_id")

    def __init__(self, chunk_id: int) -> None:
        self.ref_cnt = -1
        self.chunk_id = chunk_id

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class _Request:
    """Per request: its offload keys and store progress (vLLM's `RequestOffloadState`) and
    what it touched on the host (`ReqContext` + `_RequestCacheAccess` + LRU's request rank)."""

    __slots__ = (
        "keys",
        "positions",
        "next_stored",
        "seen",
        "seen_order",
        "inserted",
        "reused",
        "store_miss",
        "lru_rank",
        "gpu_tokens",
        "loaded_tokens",
    )

    def __init__(self) -> None:
        self.keys: list[bytes] = []  # chunk i's key: the hash of its last block
        self.positions: dict[bytes, int] = {}  # key -> its end token ((i + 1) * chunk)
        self.next_stored = 0
        self.seen: set[bytes] = set()
        self.seen_order: list[bytes] = []
        self.inserted: set[bytes] = set()
        self.reused: set[bytes] = set()
        self.store_miss: set[bytes] = set()
        self.lru_rank: int | None = None
        self.gpu_tokens = 0
        self.loaded_tokens = 0


#: a rank `(R, -end)` is the int `R << _END_BITS) - end`, which orders as the pair does for
#: any end below 2**_END_BITS tokens (a sequence that long, 4 TB of int32 ids, cannot be
#: held): one int compared in C instead of a pair in a pair, which made the heap's pops and
#: pushes most of a long serving run's time
_END_BITS = 40


class _LruPolicy:
    """vLLM 0.33 `LRUCachePolicy` (rule R7): ranks, a lazily invalidated min-heap of the
    evictable chunks.

    A rank `(R, -end)` (R7) is stored as the int `(R << _END_BITS) - end` (a finish rank
    `(R, 0)` as `R << _END_BITS`), so the heap holds bare ints. A rank names its chunk: a
    request rank R with an end token names the request's chunk there, a finish rank is
    handed out once. So `owner` maps each chunk's current rank back to it, and a heap entry
    is live when its rank still has an owner that is evictable (an entry outlives its rank
    when the chunk is re-ranked or evicted, or stays while the chunk is pinned)."""

    name: ClassVar[str] = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.chunks: dict[bytes, _Chunk] = {}
        self.ranks: dict[bytes, int] = {}
        self.owner: dict[int, bytes] = {}  # the current rank of each chunk -> the chunk
        self.evictable: set[bytes] = set()
        self.heap: list[int] = []
        self.next_rank = 0

    def get(self, key: bytes) -> _Chunk | None:
        return self.chunks.get(key)

    def _request_rank(self, req: _Request) -> int:
        if req.lru_rank is None:
            self.next_rank += 1
            req.lru_rank = self.next_rank
        return req.lru_rank

    def _rerank(self, key: bytes, rank: int) -> None:
        old = self.ranks.get(key)
        if old is not None:
            del self.owner[old]
        self.ranks[key] = rank
        self.owner[rank] = key

    def insert(self, key: bytes, chunk: _Chunk, req: _Request) -> None:
        self.chunks[key] = chunk
        rank = (self._request_rank(req) << _END_BITS) - req.positions[key]
        self._rerank(key, rank)
        if chunk.ref_cnt == 0:
            self.evictable.add(key)
            heapq.heappush(self.heap, rank)

    def on_store_miss(self, keys: list[bytes], req: _Request) -> None:
        # the base policy's default is `touch`, which re-ranks only cached keys: a store
        # miss is never cached, so for LRU this is nothing
        return

    def on_request_access(self, keys: list[bytes], req: _Request) -> None:
        base = self._request_rank(req) << _END_BITS
        ranks, positions = self.ranks, req.positions
        for key in keys:
            old = ranks.get(key)
            if old is None:
                continue
            rank = base - positions[key]
            if old >= rank:
                continue
            self._rerank(key, rank)
            if key in self.evictable:
                heapq.heappush(self.heap, rank)

    def on_request_finished(self, ordered: list[bytes], inserted_only: set[bytes], reused: set[bytes]) -> None:
        chunks, evictable, heap, ranks, owner = self.chunks, self.evictable, self.heap, self.ranks, self.owner
        push = heapq.heappush
        next_rank = self.next_rank
        for key in reversed(ordered):  # tail first: the head ends up the most recent
            if key not in chunks:
                continue
            next_rank += 1
            rank = next_rank << _END_BITS
            del owner[ranks[key]]  # `_rerank` inlined: every chunk a request touched passes here
            ranks[key] = rank
            owner[rank] = key
            if key in evictable:
                push(heap, rank)
        self.next_rank = next_rank

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, _Chunk]] | None:
        if n == 0:
            return []
        heap, owner, evictable = self.heap, self.owner, self.evictable
        pop = heapq.heappop
        selected: list[int] = []
        chosen: set[bytes] = set()
        deferred: list[int] = []
        while heap and len(selected) < n:
            rank = pop(heap)
            key = owner.get(rank)
            if key is None or key not in evictable or key in chosen:
                continue  # a stale entry (re-ranked, pinned or gone since it was pushed)
            if key in protected:
                deferred.append(rank)
                continue
            selected.append(rank)
            chosen.add(key)
        if len(selected) < n:  # all or nothing: put every popped live entry back
            for rank in selected + deferred:
                heapq.heappush(heap, rank)
            return None
        for rank in deferred:
            heapq.heappush(heap, rank)
        out = []
        for rank in selected:
            key = owner.pop(rank)
            evictable.discard(key)
            del self.ranks[key]
            out.append((key, self.chunks.pop(key)))
        if len(heap) >= max(64, 2 * len(evictable)):  # compact (speed only)
            self.heap = [self.ranks[k] for k in evictable]
            heapq.heapify(self.heap)
        return out

    def mark_evictable(self, key: bytes) -> None:
        self.evictable.add(key)
        heapq.heappush(self.heap, self.ranks[key])

    def mark_non_evictable(self, key: bytes) -> None:
        self.evictable.remove(key)

    def order(self) -> list[bytes]:
        """Evictable chunks, next evicted first."""
        return sorted(self.evictable, key=self.ranks.__getitem__)

    def check(self, fail) -> None:
        if set(self.ranks) != set(self.chunks):
            fail("LRU ranks and chunks disagree")
        if len(self.owner) != len(self.ranks) or any(self.owner.get(r) != k for k, r in self.ranks.items()):
            fail("LRU: two chunks share a rank, or a rank names no chunk")
        want = {k for k, c in self.chunks.items() if c.ref_cnt == 0}
        if self.evictable != want:
            fail("LRU evictable set is not the ready, unpinned chunks")
        live = {self.owner[r] for r in self.heap if self.owner.get(r) in self.evictable}
        if live != self.evictable:
            fail("an evictable chunk has no current heap entry")


class _ArcPolicy:
    """vLLM 0.33 `ARCCachePolicy` (rule R8)."""

    name: ClassVar[str] = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target_t1 = 0.0
        self.t1: OrderedDict[bytes, _Chunk] = OrderedDict()
        self.t2: OrderedDict[bytes, _Chunk] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def get(self, key: bytes) -> _Chunk | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: bytes, chunk: _Chunk, req: _Request) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def on_store_miss(self, keys: list[bytes], req: _Request) -> None:
        for key in reversed(keys):
            if key in self.b1:
                self.target_t1 = min(self.target_t1 + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1.move_to_end(key)
            elif key in self.b2:
                self.target_t1 = max(self.target_t1 - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(key)

    def on_request_access(self, keys: list[bytes], req: _Request) -> None:
        return  # ARC learns at request finish only

    def on_request_finished(self, ordered: list[bytes], inserted_only: set[bytes], reused: set[bytes]) -> None:
        t1, t2 = self.t1, self.t2
        for key in reversed(ordered):
            if key in inserted_only:  # a store is not a frequency hit
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
                continue
            if key in reused and key in t1:
                t2[key] = t1.pop(key)
            elif key in reused and key in t2:
                t2.move_to_end(key)

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, _Chunk]] | None:
        if n == 0:
            return []
        t1_iter, t2_iter = iter(self.t1.items()), iter(self.t2.items())

        def next_candidate(entries):
            for key, chunk in entries:
                if chunk.ref_cnt == 0 and key not in protected:
                    return key, chunk
            return None

        picked: list[tuple[bytes, _Chunk, bool]] = []
        virtual_t1 = len(self.t1)
        for _ in range(n):
            found = None
            if virtual_t1 >= int(self.target_t1):
                entry = next_candidate(t1_iter)
                if entry is not None:
                    found = (*entry, True)
                    virtual_t1 -= 1
            if found is None:
                entry = next_candidate(t2_iter)
                if entry is not None:
                    found = (*entry, False)
            if found is None:
                entry = next_candidate(t1_iter)
                if entry is None:
                    return None
                found = (*entry, True)
                virtual_t1 -= 1
            picked.append(found)
        out = []
        for key, chunk, from_t1 in picked:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            out.append((key, chunk))
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        return out

    def mark_evictable(self, key: bytes) -> None:
        return

    def mark_non_evictable(self, key: bytes) -> None:
        return

    @property
    def chunks(self) -> dict[bytes, _Chunk]:
        return {**self.t1, **self.t2}

    def order(self) -> list[bytes]:
        """T1 then T2, each LRU first (what eviction scans; which list goes first depends on
        the target)."""
        return [k for k, c in self.t1.items() if c.ref_cnt == 0] + [k for k, c in self.t2.items() if c.ref_cnt == 0]

    def check(self, fail) -> None:
        if set(self.t1) & set(self.t2):
            fail("ARC: a chunk in both T1 and T2")
        if (set(self.t1) | set(self.t2)) & (set(self.b1) | set(self.b2)):
            fail("ARC: a cached chunk is also a ghost")
        if len(self.b1) > self.capacity or len(self.b2) > self.capacity:
            fail("ARC: a ghost list above capacity")
        if not 0 <= self.target_t1 <= self.capacity:
            fail(f"ARC: target {self.target_t1} outside [0, {self.capacity}]")


_POLICIES = {"lru": _LruPolicy, "arc": _ArcPolicy}


class OffloadTier:
    """The host tier of one apc cache: vLLM's `CPUOffloadingManager` (chunk pool, ref counts,
    policy) and the scheduler-side decisions of `OffloadingConnectorScheduler` (what to look
    up, load and offer), with instantaneous transfers. Every method names a decision."""

    def __init__(self, spec: HostTierSpec) -> None:
        self.spec = spec
        self.num_chunks = spec.num_chunks
        self.policy = _POLICIES[spec.eviction](self.num_chunks)
        self._num_allocated = 0  # chunk ids handed out so far (fresh ones first, as vLLM)
        self._free: list[int] = []
        self._num_evictable = 0
        self._num_pending = 0  # stores in flight (always 0 between calls here)
        #: the page moves decided and not yet handed to the executor, in decision order
        #: (host page = chunk slot x blocks per chunk + the block's place in its chunk)
        self.moves: list[TierCopy] = []
        #: the cache's listener call while someone listens to its KV events, else None
        self.emit = None
        self.counters = dict(
            loaded_tokens=0,
            loaded_chunks=0,
            stored_chunks=0,
            reused_chunks=0,
            evicted_chunks=0,
            failed_stores=0,
            load_hits=0,
        )

    # -- R2: the lookup (read-only) ----------------------------------------------------

    def lookup_tokens(self, hashes: list[bytes], gpu_tokens: int, num_tokens: int) -> int:
        """Tokens loadable past the GPU hit (`_lookup_complete_chunks`, one full-attention
        group): consecutive ready chunks from the one holding token `gpu_tokens`."""
        tpc, bpc = self.spec.chunk_tokens, self.spec.blocks_per_chunk
        num_keys = len(hashes) // bpc
        max_hit = min(num_tokens, num_keys * tpc)
        if max_hit - gpu_tokens < tpc:
            return 0
        num_chunks = min(-(-max_hit // tpc), num_keys)
        start = gpu_tokens // tpc
        get = self.policy.get
        hits = 0
        for i in range(start, num_chunks):
            chunk = get(hashes[(i + 1) * bpc - 1])
            if chunk is None or not chunk.is_ready:
                break  # (a pending chunk would defer the request; none is pending here)
            hits += 1
        max_hit = min(max_hit, tpc * (start + hits))
        loaded = max_hit - gpu_tokens
        return loaded if loaded >= tpc else 0

    # -- R4: the load at admission -----------------------------------------------------

    def admit(self, hashes: list[bytes], gpu_tokens: int, loaded_tokens: int, blocks: list[int]) -> _Request:
        """A request admitted with `gpu_tokens` from the GPU and `loaded_tokens` to load
        into its GPU `blocks` (its page table): pin the chunks, copy them (instantaneous,
        a `TierCopy` per block), and say where its stores start."""
        req = _Request()
        req.gpu_tokens, req.loaded_tokens = gpu_tokens, loaded_tokens
        self._extend_keys(req, hashes)
        if loaded_tokens:
            tpc = self.spec.chunk_tokens
            cached = gpu_tokens + loaded_tokens
            start_block = gpu_tokens // self.spec.page_size  # the first new block, which the load fills
            start_chunk = start_block // self.spec.blocks_per_chunk
            num_chunks = -(-cached // tpc)
            keys = req.keys[start_chunk:num_chunks]
            self._prepare_load(keys, req)
            bpc, get = self.spec.blocks_per_chunk, self.policy.get
            loads = range(start_block, cached // self.spec.page_size)
            if loads:
                self.moves.append(  # one move for the whole load: page b of the table <- its chunk's slot
                    TierCopy(
                        False,
                        tuple(blocks[b] for b in loads),
                        tuple(get(req.keys[b // bpc]).chunk_id * bpc + b % bpc for b in loads),
                    )
                )
            self._complete_load(keys)
            req.next_stored = num_chunks  # CHUNK_LEVEL: the chunks the load reached are not offered
            c = self.counters
            c["loaded_tokens"] += loaded_tokens
            c["loaded_chunks"] += len(keys)
            c["load_hits"] += 1
        return req

    def _extend_keys(self, req: _Request, hashes: list[bytes]) -> None:
        """`update_offload_keys`: a key for every chunk the request's full blocks cover."""
        bpc, tpc = self.spec.blocks_per_chunk, self.spec.chunk_tokens
        keys = req.keys
        for i in range(len(keys), len(hashes) // bpc):
            key = hashes[(i + 1) * bpc - 1]
            keys.append(key)
            req.positions[key] = (i + 1) * tpc

    def _prepare_load(self, keys: list[bytes], req: _Request) -> None:
        policy = self.policy
        for key in keys:
            chunk = policy.get(key)
            if chunk.ref_cnt == 0:
                policy.mark_non_evictable(key)
                self._num_evictable -= 1
            chunk.ref_cnt += 1
        self._record_access(keys, req, reused=keys)

    def _complete_load(self, keys: list[bytes]) -> None:
        policy = self.policy
        for key in keys:
            chunk = policy.get(key)
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self._num_evictable += 1
                policy.mark_evictable(key)

    def _record_access(self, keys, req: _Request, reused=()) -> None:
        """`_record_request_cache_access`: first sightings reach the policy, in order."""
        new = [k for k in keys if k not in req.seen]
        if new:
            req.seen.update(new)
            req.seen_order.extend(new)
            self.policy.on_request_access(new, req)
        req.reused.update(k for k in reused if k not in req.inserted)

    # -- R5, R6: stores as blocks fill ---------------------------------------------------

    def storable_chunks(self, num_offloadable: int, num_blocks: int, prompt_len: int) -> int:
        """`storable_chunks`: chunks whose blocks are computed (prompt only by default) and allocated."""
        if self.spec.offload_prompt_only:
            num_offloadable = min(num_offloadable, prompt_len)
        return min(num_offloadable // self.spec.chunk_tokens, num_blocks // self.spec.blocks_per_chunk)

    def offer(self, req: _Request, hashes: list[bytes], num_chunks: int, prompt_chunks: int, blocks: list[int]) -> int:
        """Offer what became storable up to chunk `num_chunks`, step by step as vLLM's
        `_build_store_jobs` does: the prompt's chunks in one offer (a prefill step), each chunk
        past the prompt in one of its own (a decode step fills at most one), a refused offer
        retried within the next; returns how many host chunks were evicted."""
        self._extend_keys(req, hashes)
        limit = min(num_chunks, len(req.keys))
        first = min(prompt_chunks, limit)
        targets = [first] if first > req.next_stored else []
        targets += range(max(first, req.next_stored) + 1, limit + 1)
        evicted = 0
        for target in targets:
            if target > req.next_stored:
                evicted += self._offer_step(req, target, blocks)
        return evicted

    def _offer_step(self, req: _Request, num_chunks: int, blocks: list[int]) -> int:
        """One step's offer of chunks `[next_stored, num_chunks)`: store what `prepare_store`
        takes (instantaneous copy: a `TierCopy` per block from the request's GPU `blocks`);
        returns how many host chunks it evicted."""
        keys = req.keys[req.next_stored : num_chunks]
        stored = self._prepare_store(keys, req)
        if stored is None:
            self.counters["failed_stores"] += 1
            return 0  # not advanced: offered again at the next commit or at release
        to_store, evicted = stored
        bpc, tpc, get = self.spec.blocks_per_chunk, self.spec.chunk_tokens, self.policy.get
        for key in to_store:
            first = (req.positions[key] // tpc - 1) * bpc  # the chunk's first block in the table
            slot = get(key).chunk_id
            self.moves.append(
                TierCopy(True, tuple(blocks[first : first + bpc]), tuple(range(slot * bpc, slot * bpc + bpc)))
            )
        self._complete_store(to_store)
        req.next_stored = max(req.next_stored, num_chunks)
        return evicted

    def _prepare_store(self, keys: list[bytes], req: _Request) -> tuple[list[bytes], int] | None:
        policy = self.policy
        to_store, ready = [], []
        for key in keys:
            chunk = policy.get(key)
            if chunk is None:
                to_store.append(key)
            elif chunk.is_ready:
                ready.append(key)
        misses = [k for k in to_store if k not in req.store_miss]
        if misses:  # ARC learns from its ghosts before the insert removes them
            policy.on_store_miss(misses, req)
            req.store_miss.update(misses)
        recorded = set(to_store)
        recorded.update(ready)
        self._record_access([k for k in keys if k in recorded], req, reused=ready)
        self.counters["reused_chunks"] += len(ready)
        if not to_store:
            return [], 0
        shortfall = len(to_store) - self.num_free()
        evicted = 0
        if shortfall > 0:
            if shortfall > self._num_evictable:
                return None
            victims = policy.evict(shortfall, set(keys))
            if victims is None:
                return None
            self._num_evictable -= len(victims)
            for _, chunk in victims:
                self._free.append(chunk.chunk_id)
            if self.emit is not None:  # `prepare_store`'s OffloadingEvent(removed=True)
                self.emit(PagesRemoved([key for key, _ in victims], VLLM_CPU_MEDIUM))
            evicted = len(victims)
            self.counters["evicted_chunks"] += evicted
        for key in to_store:
            if self._num_allocated < self.num_chunks:
                chunk = _Chunk(self._num_allocated)
                self._num_allocated += 1
            else:
                chunk = _Chunk(self._free.pop())
            policy.insert(key, chunk, req)
        self._num_pending += len(to_store)
        req.inserted.update(to_store)
        return to_store, evicted

    def _complete_store(self, keys: list[bytes]) -> None:
        policy = self.policy
        emit = self.emit
        for key in keys:
            chunk = policy.get(key)
            if chunk is not None and not chunk.is_ready:
                chunk.ref_cnt = 0
                self._num_pending -= 1
                self._num_evictable += 1
                policy.mark_evictable(key)
                if emit is not None:  # `complete_store`'s OffloadingEvent, one BlockStored per key
                    emit(PagesStored([key], None, VLLM_CPU_MEDIUM))
        self.counters["stored_chunks"] += len(keys)

    # -- R7, R8, R10: the request finishes ------------------------------------------------

    def finish(self, req: _Request, hashes: list[bytes], num_chunks: int, prompt_chunks: int, blocks: list[int]) -> int:
        """The final offer, then `on_request_finished`; returns host chunks evicted."""
        evicted = self.offer(req, hashes, num_chunks, prompt_chunks, blocks) if num_chunks > req.next_stored else 0
        ordered = sorted(req.seen_order, key=req.positions.__getitem__)
        self.policy.on_request_finished(ordered, req.inserted - req.reused, req.reused)
        return evicted

    # -- observation ---------------------------------------------------------------------

    def take_moves(self) -> list[TierCopy]:
        """The moves decided since the last call, in order (handed out with the next admit,
        grow or fork, before that call's own)."""
        moves, self.moves = self.moves, []
        return moves

    def num_free(self) -> int:
        return len(self._free) + self.num_chunks - self._num_allocated

    def num_cached(self) -> int:
        return self._num_allocated - len(self._free)

    def capacity_tokens(self) -> int:
        """Tokens the host holds at most: whole host blocks of the tier's capacity."""
        return self.spec.num_chunks * self.spec.chunk_tokens

    def traffic(self) -> dict[str, int]:
        """What moved and what the host holds (tokens; bytes from the tier's bytes per
        token), in the names radix-hicache's `tier_traffic` uses where they mean the same."""
        spec, c = self.spec, self.counters
        tpc, tier = spec.chunk_tokens, spec.tier
        backed_up = c["stored_chunks"] * tpc
        return {
            "backed_up": backed_up,  # GPU -> host, tokens
            "loaded": c["loaded_tokens"],  # host -> GPU, tokens (a last token recomputed included)
            "host_evicted": c["evicted_chunks"] * tpc,
            "gpu_to_host_bytes": tier.bytes_of(backed_up),
            "host_to_gpu_bytes": tier.bytes_of(c["loaded_tokens"]),
            "host_tokens": self.num_cached() * tpc,
            "host_capacity_tokens": self.capacity_tokens(),
            **{k: v for k, v in c.items() if k != "loaded_tokens"},
        }

    def eviction_order(self) -> list[bytes]:
        """Keys of the evictable host chunks in the policy's order (tests, inspection)."""
        return self.policy.order()

    def cached_keys(self) -> set[bytes]:
        return set(self.policy.chunks)

    def check(self) -> None:
        """The tier's invariants: never above capacity, index and pool consistent, nothing
        pinned or in flight between calls, policy structures consistent."""

        def fail(msg: str) -> None:
            raise InvariantViolation(f"apc host tier: {msg}")

        chunks = self.policy.chunks
        if len(chunks) > self.num_chunks:
            fail(f"{len(chunks)} chunks cached above capacity {self.num_chunks}")
        if self.num_cached() != len(chunks):
            fail(f"pool says {self.num_cached()} chunks used, index holds {len(chunks)}")
        ids = [c.chunk_id for c in chunks.values()]
        if len(set(ids)) != len(ids) or set(ids) & set(self._free):
            fail("a chunk slot is used twice, or both used and free")
        if any(not 0 <= i < self._num_allocated for i in ids + self._free):
            fail("a chunk slot outside the slots handed out")
        if len(set(self._free)) != len(self._free):
            fail("a free slot is listed twice")
        pinned = [k for k, c in chunks.items() if c.ref_cnt != 0]
        if pinned or self._num_pending:
            fail(f"{len(pinned)} chunks loading or storing between calls (transfers are instantaneous)")
        if self._num_evictable != sum(1 for c in chunks.values() if c.ref_cnt == 0):
            fail(f"evictable count {self._num_evictable} is not the ready, unpinned chunks")
        self.policy.check(fail)
