"""radix-hicache: SGLang RadixAttention with a host tier (reference: SGLang 0.5.23
HiCache, `--enable-hierarchical-cache`, which builds `UnifiedRadixCache.init_hicache()`:
`mem_cache/unified_radix_cache.py`, `unified_cache/unified_tree_core.py`, the FULL
component `unified_cache/components/full.py`, the host pool `pool_host/` and
`hybrid_cache/hybrid_cache_controller.py`; the scheduler's `PrefillAdder.add_one_req`).

Everything of the `radix` backend (`backends/radix.py`: match limit, admission and decode
eviction, checkpoint inserts, release) holds; below the GPU pages sits a host tier of
`host_capacity_tokens` (or `host_capacity_gb`) that keeps copies of tree nodes, with
SGLang's rules (the tree: `backends/radix_hicache_tree.py`, which lists them with their
sources). Per request, under the replay protocol:

- `match` walks the tree across both tiers (the device prefix is the hit it names; the
  host-only nodes after it are the host hit), splitting and stamping as SGLang does.
- `admit` fits the prompt as `radix` does (every token past the device prefix needs a
  page), then loads the host hit back (`init_load_back` -> `load_back`): fewer than 10
  host tokens are recomputed; otherwise the device evicts for the shortfall with the
  path locked, and if it is still short the request recomputes and the host copies stay;
  else device pages are allocated and the host copies are copied in and kept. The
  sequence's `num_computed` after `admit` is the device hit plus what was loaded: every
  token not recomputed, whichever tier it came from (engines read it, not the match).
- A host hit the request recomputed goes back on the device at its insert with the
  request's own pages.

Under the replay protocol transfers complete at once (the GPU-optimistic timing): backups
inside the call that issues them, load-backs at the next `commit` or `release` (where
SGLang's scheduler would poll them). Under serving (`time_transfers`, called by the `vllm`
scheduler) each backup and load-back is a `TierTransfer` the engine prices
(experiments/engine/transfers.py): a write-through backup keeps its node locked
(`ongoing_write_through` + `inc_lock_ref`) and a load-back stays unacknowledged
(`ongoing_load_back`; under write_back not yet a reclaimable duplicate) until the engine's
poll after the copy completes names its ticket (`finish_transfers`); a write_back backup at
eviction is waited for (`writing_check(write_back=True)`), and the step's load-backs
overlap its forward layer by layer. The bytes move in the executor: each node demoted
(its host copy written when its GPU pages are freed) or loaded is a `TierCopy` handed out,
in decision order, with the next `admit`, `grow` or `fork`'s copies
(attention/kv_cache.py keeps the host pages). KV events: both tiers, as SGLang publishes
them (`HiCacheEvents`: medium "GPU" and "CPU_PINNED"). Storage transfers are timed too (see
Storage below). What is not built: SGLang's Rust TreeCore (this follows the Python
TreeCore, which the goldens run). Golden runs of the real code:
`tests/test_radix_hicache_sglang.py` (host tier) and `tests/test_radix_hicache_storage_sglang.py`
(with storage).

Storage (L3, `storage_backend=file|shared`; SGLang 0.5.23 `--hicache-storage-backend`,
`mem_cache/hicache_storage.py`, `UnifiedRadixCache.prefetch_from_storage` /
`write_backup_storage`, the controller's storage threads, the scheduler's
`_prefetch_kvcache` and `check_prefetch_progress`): a `cachelib.tiers.StorageTier` under
the host. Every host backup is written on to it at its acknowledgement
(`_finish_write_through_ack` -> `write_backup_storage`, every write policy). At a
request's arrival, done here at the start of `admit`, the pages past its device + host
match (up to `len - 1`, whole pages) are prefetched when the match ends at the root or at
a node with a host copy (under `write_back` a device node has none, so storage is rarely
asked: reproduced), the span and the hit each reach `prefetch_threshold` (SGLang's 256),
and the host has room for at least the threshold after evicting host copies for the whole
hit (`allocate_storage_hit`); the fetched pages become a host-only node below the match
(`insert_host`), which the load-back then brings to the device. `storage_hit_tokens(seq)`
is SGLang's `cached_tokens_storage`: those tokens once loaded back (a prefetch under the
10-token rule, or one the device could not take, stays on the host and counts nowhere).
Under the replay protocol transfers complete before the request is admitted, so the
prefetch policies (`best_effort`: take what has arrived when the request is scheduled;
`wait_complete`; `timeout`) all see the whole prefetch; they differ only once transfers
take time. Under serving (`time_transfers`) the engine times the read: it asks
`storage_prefetch` (what storage would give, changing nothing) when it first
considers the request, queues that read on the storage -> host stream from the request's
arrival, applies the policy (experiments/engine/vllm_scheduler.py
`storage_prefetch_ready`) and tells `limit_prefetch` how many tokens arrived; `admit`
then keeps those whole pages of the prefetch (SGLang's `terminate_prefetch` keeps the
completed pages and frees the rest of the host pages it allocated). A storage write is
reported (`TierTransfer` host -> storage) when its backup is acknowledged, and its node's
host copy stays locked (`ongoing_backup` holds `inc_host_lock_ref`) until its ticket
completes; the store's contents change at once. Deviations there: the prefetch is
decided when the request is first considered, not at its arrival (its size is what
storage and the tree give then; the read is still placed from the arrival on the FIFO
stream); its size is the storage hit, not what the host has room for. Under replay,
SGLang's rate limit (no new prefetch while prefetches in flight hold half the
host) never binds here for the same reason, nor do its prefetch retries. The executor
gets `StorageCopy` ops: a prefetch's read when it is decided, and a node's storage write
when it is demoted (the host copy reaches the executor then, see `demoted`); equal keys
name equal KV, so the executor's store is keyed by page key. Golden runs of the real
code with the file backend: `tests/test_radix_hicache_storage_sglang.py` (a real
`HiCacheFile` and `LRUFileEvictor`, every write policy). The `shared` pool has none:
Mooncake's master, which decides its eviction, is not part of SGLang (see
`cachelib.tiers.StorageTier`).

Where it differs from SGLang 0.5.23, on purpose: whether a prompt fits is the engine's
protocol (every page past the GPU prefix, in free + evictable pages), not `PrefillAdder`'s
budget; a serving chunk that ends inside the host hit recomputes it (a load covers whole
nodes and `admit` must not pass the chunk); under replay a node is never in flight
(transfers are instantaneous); any eviction makes older matches stale (a demoted node stays in the
tree, so a match is not proven by its nodes alone); the executor copies a node's KV to the
host when it is demoted rather than when it is backed up (only then can its GPU pages be
reused), while `tier_traffic` counts bytes when SGLang moves them. Under serving, a
load-back's ticket holds a lock on the loaded path until it completes (SGLang relies on
the request's own lock, which its scheduler never drops before the copy is acknowledged; a
caller here may release first, and a node with a load in flight must not be evicted); and
where a write_back eviction runs out of leaves because drops were declined under host
copies that storage writes still read, SGLang 0.5.23 stops ("Prefill out of memory"),
while this model waits for those writes and evicts the passed-by leaves
(`HiCacheTree.evict`).

Options: `write_policy` (`write_through`: back up a node at its first hit;
`write_through_selective`: at its second; `write_back`: only when the device evicts it),
`host_capacity_tokens` or `host_capacity_gb` (with `kv_bytes_per_token`; neither: twice the
GPU pool, SGLang's default `--hicache-ratio 2`), `host_read_gbps`
/ `host_write_gbps` (default: the H200's PCIe Gen5 x16, `cachelib/tiers.py`),
`eviction_policy` (one order for both tiers, as SGLang's); storage: `storage_backend`
(`none`, `file`, `shared`), `storage_capacity_tokens` or `storage_capacity_gb` (neither:
unbounded), `storage_read_gbps` / `storage_write_gbps` (default: the backend's, see
`cachelib/tiers.py`), `prefetch_threshold`, `prefetch_policy`. Deviation from `radix` that
follows the unified tree: a split's upper part keeps the lower part's creation time
(only FIFO/FILO read it).
"""

from __future__ import annotations

from itertools import chain
from typing import ClassVar

import numpy as np

from backends.radix import RadixCache, _Held
from backends.radix_hicache_tree import LOAD_BACK_THRESHOLD, WRITE_POLICIES, HiCacheEvents, HiCacheTree, TieredNode
from backends.radix_policy import make_policy
from cachelib.errors import InvalidRequestError
from cachelib.interface import Occupancy, PagePartition
from cachelib.registry import register_backend
from cachelib.tiers import (
    DEFAULT_PREFETCH_THRESHOLD,
    H200_HOST_READ_GBPS,
    H200_HOST_WRITE_GBPS,
    LLAMA3_8B_KV_BYTES_PER_TOKEN,
    NO_PREFETCH,
    PREFETCH_POLICIES,
    STORAGE_BACKENDS,
    HostTier,
    StoragePrefetch,
    StorageTier,
    TierTransfer,
)
from cachelib.types import CopyOp, Match, Sequence, StorageCopy, TierCopy

#: what a transfer ticket holds until it completes: a load-back's anchor, a backup's locked
#: node, a storage write's host-locked node
_LOAD, _BACKUP, _STORE = 0, 1, 2


@register_backend("radix-hicache")
class HiRadixCache(RadixCache):
    """SGLang 0.5.23 HiCache over `num_pages` GPU pages and a host tier (module docstring)."""

    memory_tiers: ClassVar[tuple[str, ...]] = ("gpu", "host")
    compared_by_default = False  # it holds KV beyond the GPU capacity the others get: name it
    load_timing = "layerwise"  # load-backs overlap the prefill layer by layer (cachelib/tiers.py)
    emits_kv_events = True  # HiCacheEvents: GPU and host (CPU_PINNED) stores and removals, as SGLang

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        host_capacity_tokens: int = 0,
        host_capacity_gb: float = 0.0,
        write_policy: str = "write_through",
        host_read_gbps: float = H200_HOST_READ_GBPS,
        host_write_gbps: float = H200_HOST_WRITE_GBPS,
        kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN,
        eviction_policy: str = "lru",
        storage_backend: str = "none",
        storage_capacity_tokens: int = 0,
        storage_capacity_gb: float = 0.0,
        storage_read_gbps: float | None = None,
        storage_write_gbps: float | None = None,
        prefetch_policy: str = "best_effort",
        prefetch_threshold: int = DEFAULT_PREFETCH_THRESHOLD,
        track_contents: bool = False,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise InvalidRequestError(
                f"unknown write_policy {write_policy!r}; choose one of {', '.join(WRITE_POLICIES)}"
            )
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise InvalidRequestError(f"page_size must be a positive int, got {page_size!r}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise InvalidRequestError(f"num_pages must be a positive int, got {num_pages!r}")
        self.host_tier = HostTier.build(
            page_size,
            num_pages * page_size,
            capacity_tokens=host_capacity_tokens,
            capacity_gb=host_capacity_gb,
            read_gbps=host_read_gbps,
            write_gbps=host_write_gbps,
            kv_bytes_per_token=kv_bytes_per_token,
        )
        self.storage_tier = self._build_storage(
            page_size,
            storage_backend,
            storage_capacity_tokens,
            storage_capacity_gb,
            storage_read_gbps,
            storage_write_gbps,
            prefetch_policy,
            prefetch_threshold,
            kv_bytes_per_token,
        )
        policy = make_policy(eviction_policy)
        super().__init__(num_pages, page_size, eviction_policy=policy, track_contents=track_contents)
        # radix's conditional lazy promise is not extended here: a grow also hands over the
        # tier moves decided since the last call, and a commit acknowledges load-backs
        self.decode_noops_when = None
        self.commit_publishes_decode = True  # its commits acknowledge load-backs: every fill calls
        self.write_policy = write_policy
        self.prefetch_policy = prefetch_policy
        if self.storage_tier is not None:
            self.memory_tiers = ("gpu", "host", "storage")
        self.tree = HiCacheTree(
            page_size,
            policy,
            write_policy,
            self.host_tier.capacity_tokens // page_size,
            self.storage_tier,
            prefetch_threshold,
        )
        #: request id -> tokens of its last admission that came up from storage
        self._storage_hits: dict[str, int] = {}
        self.storage_hit_tokens_total = 0
        self.tree.mover = self
        self._host_contents = np.full(self.host_tier.capacity_tokens, -1, dtype=np.int64) if track_contents else None
        self.host_hit_tokens = 0  # loaded back at admission, over every admission
        #: `TierCopy`s decided but not handed out yet (they go with the next admit, grow, fork)
        self._moves: list[TierCopy] = []
        #: serving's transfer clock (`time_transfers`): transfers not yet taken, and what each
        #: ticket holds until `finish_transfers` (a backup's locked node, a load's anchor)
        self._timed = False
        self._transfers: list[TierTransfer] = []
        self._tickets: dict[int, tuple[int, TieredNode]] = {}  # ticket -> (_LOAD/_BACKUP/_STORE, node)
        self._done_early: set[int] = set()  # storage writes waited for before the engine said so
        self._next_ticket = 0
        #: timed storage writes decided, waiting for their node's backup to be acknowledged
        self._store_after: dict[TieredNode, int] = {}
        #: request id -> the tokens of its storage prefetch that arrived before the engine
        #: scheduled it (`limit_prefetch`; serving only: under replay it all arrives)
        self._prefetch_budget: dict[str, int] = {}

    @staticmethod
    def _build_storage(
        page_size: int,
        backend: str,
        capacity_tokens: int,
        capacity_gb: float,
        read_gbps: float | None,
        write_gbps: float | None,
        prefetch_policy: str,
        prefetch_threshold: int,
        kv_bytes_per_token: int,
    ) -> StorageTier | None:
        """The L3 tier the options describe, or None (`storage_backend="none"`); every
        storage option is checked here, before any work, and one given without a storage
        backend is refused rather than ignored."""
        if prefetch_policy not in PREFETCH_POLICIES:
            raise InvalidRequestError(
                f"unknown prefetch_policy {prefetch_policy!r}; choose one of {', '.join(PREFETCH_POLICIES)}"
            )
        if isinstance(prefetch_threshold, bool) or not isinstance(prefetch_threshold, int) or prefetch_threshold < 0:
            raise InvalidRequestError(f"prefetch_threshold must be a non-negative int, got {prefetch_threshold!r}")
        if backend == "none":
            stray = [
                name
                for name, value, default in (
                    ("storage_capacity_tokens", capacity_tokens, 0),
                    ("storage_capacity_gb", capacity_gb, 0.0),
                    ("storage_read_gbps", read_gbps, None),
                    ("storage_write_gbps", write_gbps, None),
                    ("prefetch_policy", prefetch_policy, "best_effort"),
                    ("prefetch_threshold", prefetch_threshold, DEFAULT_PREFETCH_THRESHOLD),
                )
                if value != default
            ]
            if stray:
                raise InvalidRequestError(
                    f"{', '.join(stray)} given without a storage tier: add storage_backend="
                    f"{' or '.join(STORAGE_BACKENDS)}"
                )
            return None
        return StorageTier.build(
            page_size,
            backend=backend,
            capacity_tokens=capacity_tokens,
            capacity_gb=capacity_gb,
            read_gbps=read_gbps,
            write_gbps=write_gbps,
            kv_bytes_per_token=kv_bytes_per_token,
        )

    def use_storage_pool(self, pool: StorageTier) -> None:
        """Share `pool` (another replica's `shared` storage tier) from now on: a Mooncake
        Store every replica of a cluster reads and writes. Refused unless this cache has a
        `shared` tier with the same figures and nothing was stored in it yet."""
        own = self.storage_tier
        if own is None or not own.shared:
            raise InvalidRequestError("only a radix-hicache cache with storage_backend=shared joins a shared pool")
        if own is pool:
            return
        if not own.same_figures(pool):
            raise InvalidRequestError("replicas sharing a storage pool must give it the same size and bandwidths")
        if own.used_tokens or own.written_pages:
            raise InvalidRequestError("join a shared storage pool before the cache stores anything")
        self.storage_tier = pool
        self.tree.storage = pool

    # -- the mover the tree calls (transfers complete at once) ------------------------

    def give(self, pages: list[int]) -> None:
        """An evicted device copy's pages. A demoted node stays in the tree (and may come
        back on other pages), so proving a match by its nodes no longer suffices: every
        eviction makes older matches stale."""
        self._epoch += 1
        self._give(pages)

    def copied_to_host(self, device_pages: list[int], host_pages: list[int]) -> None:
        # the executor's copy waits for `demoted` (see there); the record of contents does not
        if self._contents is not None:
            self._host_contents[self._slots(host_pages)] = self._contents[self._slots(device_pages)]

    def copied_to_device(self, host_pages: list[int], device_pages: list[int]) -> None:
        self._moves.append(TierCopy(False, tuple(device_pages), tuple(host_pages)))
        if self._contents is not None:
            self._contents[self._slots(device_pages)] = self._host_contents[self._slots(host_pages)]

    def demoted(self, device_pages: list[int], host_pages: list[int]) -> None:
        """A node's GPU copy is freed and its host copy is all that is left: the executor
        copies the bytes now. SGLang copies at backup time; for the executor the copy is
        only needed once the GPU pages can be reused, and deferring it to here is what
        makes it safe when a scheduler publishes pages before it computes them (vLLM's
        `cache_blocks` at scheduling): a node is demoted only once unlocked, i.e. after its
        KV was written."""
        self._moves.append(TierCopy(True, tuple(device_pages), tuple(host_pages)))

    def backup_issued(self, node: TieredNode, tokens: int, *, blocking: bool) -> None:
        ticket = None
        if not blocking:
            ticket = self._ticket(_BACKUP, node)
        self._transfers.append(TierTransfer("gpu", "host", tokens, None, ticket, blocking))
        if blocking and node in self._store_after:
            self._issue_store(node)  # waited for at once: its storage write starts now

    def storage_write_issued(self, node: TieredNode, tokens: int) -> None:
        """A timed storage write of `node`'s host copy: SGLang starts it at the backup's
        acknowledgement (`_finish_write_through_ack` -> `write_backup_storage`), so it is
        reported once the backup's ticket completes (a blocking backup's: at once), and the
        host copy stays locked until its own ticket completes (`ongoing_backup` holds
        `inc_host_lock_ref`). The store's contents changed at once (`StorageTier.write`):
        a lookup while the write is in flight already sees it."""
        self._store_after[node] = tokens
        node.host_lock += 1
        self.tree._refresh(node)

    def await_storage_writes(self, nodes: list[TieredNode]) -> None:
        """The storage writes in flight from `nodes`' host copies are waited for: each one's
        host lock goes now, and its ticket (handed to the engine already) is remembered as
        done, so the engine's later `finish_transfers` of it changes nothing."""
        wanted = set(nodes)
        for ticket, (kind, node) in list(self._tickets.items()):
            if kind == _STORE and node in wanted:
                del self._tickets[ticket]
                self._done_early.add(ticket)
                node.host_lock -= 1
                self.tree._refresh(node)

    def _issue_store(self, node: TieredNode) -> None:
        tokens = self._store_after.pop(node)
        self._transfers.append(TierTransfer("host", "storage", tokens, None, self._ticket(_STORE, node)))

    def _ticket(self, kind: int, node: TieredNode) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        self._tickets[ticket] = (kind, node)
        return ticket

    # -- transfer timing (serving) ------------------------------------------------------

    def time_transfers(self) -> None:
        """Record transfers for the serving clock; a write-through backup keeps its node
        locked and a load-back stays unacknowledged (write_back: not yet a reclaimable
        duplicate) until `finish_transfers` names its ticket, as SGLang's
        `ongoing_write_through` / `ongoing_load_back` until `writing_check` /
        `loading_check` see the copy done. Call it before the first request."""
        if self._live or self.tree.evictable_tokens or self.tree.protected_tokens or self.tree.host_used_tokens:
            raise InvalidRequestError("time_transfers: call it on an empty cache, before the first request")
        self._timed = True
        self.tree.hold_backups = True

    def take_transfers(self) -> list[TierTransfer]:
        out, self._transfers = self._transfers, []
        return out

    def _finish_transfers(self, tickets: list[int]) -> None:
        early = self._done_early
        unknown = [t for t in tickets if t not in self._tickets and t not in early]
        if unknown:
            raise InvalidRequestError(f"finish_transfers: no transfer in flight has ticket(s) {unknown[:8]}")
        if len(set(tickets)) != len(tickets):
            raise InvalidRequestError(f"finish_transfers: a ticket named twice in {sorted(tickets)[:8]}")
        tree = self.tree
        for t in tickets:
            if t in early:  # waited for already (`await_storage_writes`)
                early.discard(t)
                continue
            kind, node = self._tickets.pop(t)
            if kind == _LOAD:
                tree.finish_load(node)
                tree.unlock(node)
            elif kind == _BACKUP:
                tree.unlock(node)  # `_finish_write_through_ack` -> `dec_lock_ref`
                if node in self._store_after:
                    self._issue_store(node)  # ... -> `write_backup_storage`
            else:
                node.host_lock -= 1  # the storage write's ack: `dec_host_lock_ref`
                tree._refresh(node)

    def _tier_link_seconds(self, src: str, dst: str, tokens: int) -> float:
        if (src, dst) == ("host", "gpu"):
            return self.host_tier.transfer_seconds(tokens, write=False)
        if (src, dst) == ("gpu", "host"):
            return self.host_tier.transfer_seconds(tokens, write=True)
        storage = self.storage_tier
        if storage is not None and (src, dst) in (("storage", "host"), ("host", "storage")):
            return storage.transfer_seconds(tokens, write=dst == "storage")
        return super()._tier_link_seconds(src, dst, tokens)

    def tier_bytes(self, tokens: int) -> int:
        return self.host_tier.bytes_of(tokens)

    def _registered_pages(self) -> list[int]:
        """Device pages a backup or load-back in flight holds (its node's locked path)."""
        tree = self.tree
        pages: set[int] = set()
        for node in self.ticket_locked_nodes():
            for x in tree.path(node):
                pages.update(tree.pages_of(x))
        return sorted(pages)

    def ticket_locked_nodes(self) -> list[TieredNode]:
        """The nodes a transfer in flight holds a lock on the path of: a backup's node, a
        load-back's anchor (storage writes hold a host lock, not a path lock)."""
        return [node for kind, node in self._tickets.values() if kind != _STORE]

    def stored_from_host(self, host_pages: list[int], keys: list) -> None:
        self._moves.append(StorageCopy(True, tuple(host_pages), tuple(keys), len(keys) * self.page_size))

    def prefetched(self, keys: list, host_pages: list[int], tokens: np.ndarray) -> None:
        self._moves.append(StorageCopy(False, tuple(host_pages), tuple(keys), len(tokens)))
        if self._contents is not None:
            self._host_contents[self._slots(host_pages)] = tokens

    def _take_moves(self, ops: list[CopyOp] | None) -> list | None:
        """The tier moves decided since the last hand-out, then `ops` (None stays None:
        a call that did not fit decided nothing)."""
        if ops is None or not self._moves:
            return ops
        moves, self._moves = self._moves, []
        return moves + ops

    def _slots(self, pages: list[int]) -> np.ndarray:
        ps = self.page_size
        return (np.asarray(pages, dtype=np.int64)[:, None] * ps + np.arange(ps)).reshape(-1)

    # -- the contract -------------------------------------------------------------------

    def _match(self, seq: Sequence) -> tuple[int, tuple[int, ...], TieredNode | None]:
        ps = self.page_size
        limit = (len(seq) - 1) // ps * ps
        if limit <= 0:
            return 0, (), None
        node, hit, runs = self.tree.match_tiers(self._namespace(seq), seq.tokens, limit)
        pages = tuple(runs[0]) if len(runs) == 1 else tuple(chain.from_iterable(runs))
        return hit, pages, node

    def _admit(self, seq: Sequence, match: Match, num_tokens: int) -> tuple[_Held, list[CopyOp]] | None:
        if not self._can_admit(seq, match, num_tokens):
            return None
        tree = self.tree
        ps = self.page_size
        node = match.handle
        if node is None:
            node = tree.root(self._namespace(seq), create=True)
        tree.lock(node)
        table = list(match.pages)
        hit = match.num_tokens
        limit = (len(seq) - 1) // ps * ps
        host = tree.host_continuation(node, seq.tokens, limit) if hit < limit else []
        host_len = sum(len(x.key) for x in host)
        stored = 0
        if tree.storage is not None and hit + host_len < limit:
            # the request's arrival in SGLang (`_prefetch_kvcache`), done here: the pages
            # after the device + host match come up from storage as a host-only node
            budget = self._prefetch_budget.pop(seq.request_id, None)
            fetched = tree.prefetch(host[-1] if host else node, seq.tokens, hit + host_len, limit, budget)
            if fetched is not None:
                host.append(fetched)
                stored = len(fetched.key)
                host_len += stored
        # A chunk that ends inside the host hit (serving) recomputes it instead: the load
        # covers whole nodes, and the table must not pass what admit was asked for.
        loaded_from_storage = 0
        if host and hit + host_len < num_tokens:
            loaded = self._load_back(host, host_len)
            if loaded is not None:
                table += loaded
                hit += host_len
                node = host[-1]
                self.host_hit_tokens += host_len
                if self._timed:
                    # the copy's own lock on the loaded path until its ticket completes: SGLang
                    # never evicts a node with a load in flight (`_is_host_leaf`: "marked nodes
                    # are never evicted"), which there the request's lock guarantees; here a
                    # caller may release the request first
                    tree.lock(node)
                    ticket = self._ticket(_LOAD, node)
                    self._transfers.append(TierTransfer("host", "gpu", host_len, seq.request_id, ticket))
                loaded_from_storage = stored
        if tree.storage is not None:
            # `split_cached_prefix_by_tier`: the storage span counts once it reached the
            # device; a declined load-back leaves it in the host tier, counted nowhere
            self._storage_hits[seq.request_id] = loaded_from_storage
            self.storage_hit_tokens_total += loaded_from_storage
        need = self.pages_for(num_tokens) - hit // ps
        self._evict_for_extend(num_tokens - hit, need)
        table += self._take(need)
        seq.page_table = table
        seq.num_computed = hit
        return _Held(seq, node, hit, 0, num_tokens), self._take_moves([])

    def _grow(self, seq: Sequence, held: _Held, num_tokens: int) -> list[CopyOp] | None:
        return self._take_moves(super()._grow(seq, held, num_tokens))

    def _fork(self, parent: Sequence, held: _Held, child: Sequence) -> tuple[_Held, list[CopyOp]] | None:
        forked = super()._fork(parent, held, child)
        if forked is None:
            return None
        return forked[0], self._take_moves(forked[1])

    def _load_back(self, host: list[TieredNode], host_len: int) -> list[int] | None:
        """`load_back`: the device pages the host nodes were loaded into, or None (the
        request recomputes them; nothing changed but what the eviction freed)."""
        tree = self.tree
        ps = self.page_size
        tree.lock_host_segment(host)
        pages = None
        if host_len >= LOAD_BACK_THRESHOLD:
            free = self._num_free * ps
            if free < host_len:
                self._evict_tokens(host_len - free)
            if self._num_free * ps >= host_len:
                pages = self._take(host_len // ps)
                tree.load(host, pages)
        tree.release_host_segment(host, pages is not None)
        return pages

    def _insert(self, held: _Held, end: int, lend: bool) -> list[int]:
        """`RadixCache._insert` with adopted runs: a host-only node the insert put back on
        the device holds the request's own pages (no duplicate to free)."""
        seq = held.seq
        ps = self.page_size
        table = seq.page_table
        start = held.protected
        new, _matched, runs = self.tree.insert(held.node, start, seq.tokens, end, table, held.inserted, lend)
        held.inserted = max(held.inserted, end)
        lo = start // ps
        for pages, adopted in runs:
            k = len(pages)
            if not adopted:
                dups = table[lo : lo + k]
                table[lo : lo + k] = pages
                self._give(dups)
            lo += k
        held.node = new
        held.protected = end
        return table

    def _commit(self, seq: Sequence, held: _Held, num_computed: int) -> None:
        super()._commit(seq, held, num_computed)
        if not self._timed:
            self.tree.finish_loads()  # the scheduler's next poll: the load-backs completed

    def _release(self, seq: Sequence, held: _Held) -> None:
        super()._release(seq, held)
        if not self._timed:
            self.tree.finish_loads()
        self._storage_hits.pop(seq.request_id, None)
        self._prefetch_budget.pop(seq.request_id, None)

    # -- storage prefetch on the serving clock ----------------------------------------

    def storage_prefetch(self, seq: Sequence, match: Match) -> StoragePrefetch:
        """The storage prefetch `seq` would issue now: the span past its device + host
        match up to `len - 1` (whole pages) and what storage holds of it from the first
        page (`NO_PREFETCH` when SGLang issues none), changing nothing: what a serving
        engine times from the request's arrival. The host room the prefetch will find at
        admission is not looked at (the read is the hit's size)."""
        if self.storage_tier is None:
            return NO_PREFETCH
        ps = self.page_size
        limit = (len(seq) - 1) // ps * ps
        hit = match.num_tokens
        if hit >= limit:
            return NO_PREFETCH
        tree = self.tree
        namespace = self._namespace(seq)
        node = match.handle if match.handle is not None else tree.root(namespace, create=False)
        host = tree.host_continuation(node, seq.tokens, limit) if node is not None else []
        start = hit + sum(len(x.key) for x in host)
        if start >= limit:
            return NO_PREFETCH
        tokens = tree.prefetch_hit(host[-1] if host else node, namespace, seq.tokens, start, limit)[1]
        return StoragePrefetch(limit - start, tokens) if tokens else NO_PREFETCH

    def limit_prefetch(self, seq: Sequence, tokens: int) -> None:
        """The next `admit` of `seq` keeps at most the whole pages of `tokens` tokens of its
        storage prefetch: what arrived before the engine scheduled it (SGLang's
        `terminate_prefetch` under `best_effort` / `timeout`)."""
        if self.storage_tier is None:
            raise InvalidRequestError(f"limit_prefetch: a {self.name} cache without a storage tier prefetches nothing")
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
            raise InvalidRequestError(f"limit_prefetch: tokens must be a non-negative int, got {tokens!r}")
        self._prefetch_budget[seq.request_id] = int(tokens)

    def _storage_hit_tokens(self, seq: Sequence) -> int:
        """Of the tokens the last `admit` of `seq` loaded back, those that came up from
        storage (SGLang's `cached_tokens_storage`); 0 without a storage tier."""
        return self._storage_hits.get(seq.request_id, 0)

    def _evict_tokens(self, num_tokens: int) -> int:
        freed = self.tree.evict(num_tokens, self.give) // self.page_size
        self._counters["evicted_pages"] += freed
        return freed

    def _evict(self, num_pages: int) -> int:
        return self._evict_tokens(num_pages * self.page_size)

    # -- KV events: both tiers, as SGLang's HiCache publishes them ------------------------

    def _kv_subscribed(self) -> None:
        if self.tree.num_nodes:
            raise InvalidRequestError(
                "subscribe to a radix-hicache cache's KV events before it holds a page "
                f"(it holds {self.tree.num_nodes} nodes)"
            )
        if self.tree.hi_events is None:
            self.tree.hi_events = HiCacheEvents(self.tree, self._emit_kv_event)

    # -- observation ------------------------------------------------------------------

    def tier_traffic(self) -> dict[str, int]:
        """Tokens and bytes moved between the tiers so far (`TierTraffic`), and what the
        host holds."""
        t = self.tree.traffic
        tier = self.host_tier
        out = t.as_dict()
        out["gpu_to_host_bytes"] = tier.bytes_of(t.backed_up)
        out["host_to_gpu_bytes"] = tier.bytes_of(t.loaded)
        out["host_tokens"] = self.tree.host_used_tokens
        out["host_capacity_tokens"] = tier.capacity_tokens
        storage = self.storage_tier
        if storage is not None:
            out["host_to_storage_bytes"] = storage.bytes_of(t.stored)
            out["storage_to_host_bytes"] = storage.bytes_of(t.prefetched)
            # the pool's own figures: shared by every replica of a cluster when `shared`
            out.update(storage.stats())
        return out

    def tier_capacities(self) -> dict[str, int]:
        caps = {"gpu": self.num_pages * self.page_size, "host": self.host_tier.capacity_tokens}
        storage = self.storage_tier
        # an uncapped file backend (SGLang's default) holds everything: 0 says unbounded
        return caps if storage is None else caps | {"storage": storage.capacity_tokens}

    def _occupancy(self) -> Occupancy:
        occ = super()._occupancy()
        tree = self.tree
        extra = dict(occ.extra)
        extra.update(
            write_policy=self.write_policy,
            host_capacity_tokens=self.host_tier.capacity_tokens,
            host_tokens=tree.host_used_tokens,
            host_leaves=len(tree.host_leaves),
            host_hit_tokens=self.host_hit_tokens,
        )
        if self.storage_tier is not None:
            extra.update(
                storage_backend=self.storage_tier.backend,
                storage_tokens=self.storage_tier.used_tokens,
                storage_hit_tokens=self.storage_hit_tokens_total,
            )
        return occ._replace(extra=extra)

    def _page_partition(self) -> PagePartition:
        cached: list[int] = []
        pinned: list[int] = []
        for node in self.tree.nodes():
            if node.pages is None and node.lender is None:
                continue  # host-only: no device page
            (pinned if node.lock_ref else cached).extend(self.tree.pages_of(node))
        for held in self._live.values():
            pinned += held.seq.page_table[held.protected // self.page_size :]
        return PagePartition(free=self._free_pages(), cached=cached, pinned=pinned)

    def _check_invariants(self) -> None:
        from backends.radix_hicache_invariants import check_hicache

        check_hicache(self)
