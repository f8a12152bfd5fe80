"""apc-lmcache: vLLM's APC on the GPU with LMCache's connector below it (host memory, then disk).

`--backend apc-lmcache [--backend-opt host_capacity_tokens=N] [--backend-opt disk_capacity_tokens=M]`
is `apc` (backends/apc.py, vLLM 0.33's prefix cache, unchanged) with LMCache below the GPU
blocks: KV stored in chunks of `lmcache_chunk_size` tokens (LMCache's `chunk_size`, 256) into
a host-memory LRU store (`LocalCPUBackend`) and, with a disk, a local-disk LRU store
(`LocalDiskBackend`), and loaded back when a new request's prompt starts with stored chunks.

Reference: LMCache v1 of the 0.3.x line (`lmcache/v1/`: `cache_engine.py`, `token_database.py`
`ChunkedTokenDatabase`, `storage_backend/storage_manager.py`, `local_cpu_backend.py`,
`local_disk_backend.py`, `cache_policy/lru.py`) with its vLLM v1 adapter
(`vllm_v1_adapter.py`, as vendored in vLLM's `kv_connector/v1/lmcache_integration/`). LMCache
is not installed here: the rules below were read from public copies of those files: the
cache engine as of 0.3.11, the adapter as vendored in vLLM, and the storage manager and the
host and disk backends from later snapshots of LMCache's main (no 0.3.x copy of them was at
hand; their rules used here are the ones the 0.3.x engine's calls rely on, but a detail may
differ in a given 0.3.x release). Where a copy could not settle a point the choice is said.
Each rule names its source.

L1  Chunks and keys (`ChunkedTokenDatabase.process_tokens`, `_chunk_tokens`): a prefix is cut
    into chunks of `chunk_size` tokens, each keyed by the chained hash of every token up to
    its end. The last, shorter chunk is kept only with `save_unfull_chunk` (LMCache's config;
    default False in current LMCache, True in early 0.3.x: a named option here, default
    False). Keys here are apc's block hashes (a full chunk = the hash of its last block: the
    same prefix, the same key) and, for a short chunk, a hash of its parent key and tokens.
L2  Lookup (`LMCacheEngine.lookup` -> `StorageManager.batched_contains`): over the prompt's
    chunks from the first, the host store counts its run of consecutive hits; the disk then
    counts its run from where the host's stopped (a host with no hit leaves the disk to count
    from chunk 0). The hit is the end of the last chunk hit: chunk-aligned, or the prompt's
    end when a short last chunk hits. The GPU hit is not passed in: chunks the GPU also
    holds are looked up (and touched, L3) too.
L3  Recency at lookup (`contains(pin=True)` + `touch_cache`): every chunk hit is pinned
    until the step's end (`lookup_unpin` in `wait_for_save`), and the keys hit on each
    store are moved to its MRU end in reverse order, so a request's first chunk ends up the
    most recent and its deepest goes first. A store puts a new key at the MRU end; the host
    store's `get` does not touch; the disk's `get_blocking` does (L5).
L4  What is loaded (`get_num_new_matched_tokens`, `start_load_kv`): `need = hit - gpu_hit`,
    less 1 when the hit is the whole prompt (its last token is recomputed); nothing when
    `need <= 0`. The load retrieves every hit chunk from the one holding token
    `gpu_hit // chunk * chunk` on (whole chunks: the part the GPU already holds is written
    again, counted in `retrieved_tokens`), into the request's new blocks; the tokens not
    recomputed are `gpu_hit + need` (vLLM counts the loaded last token as recomputed).
L5  A chunk read from disk (`StorageManager.batched_get` for `LocalDiskBackend`) is read into
    a host buffer (`local_cpu_backend.allocate`, evicting host LRU chunks that are neither
    pinned nor in use) and then written back to the host store (`batched_submit_put_task`,
    MRU end) if every one of the batch could be read: a promotion. The disk keeps its copy.
    A buffer that cannot be had (the host full of this request's pinned chunks) ends the
    load there and nothing is promoted (a choice: the reference's read then waits for room
    or fails, by version; after a failed load vLLM recomputes the blocks not loaded).
L6  Store (`from_request_tracker`, `wait_for_save`): after each step, with `num_saved`
    starting at the lookup's hit (even when nothing was loaded) and `tokens` the computed
    tokens: no store if `num_saved > 0` and `tokens < cdiv(num_saved + 1, chunk) * chunk`,
    nor in the decode phase unless `save_decode_cache` (default False); otherwise the
    tokens to save are `tokens` on the prompt's last prefill step with `save_unfull_chunk`,
    else `tokens // chunk * chunk`, and the chunks from `num_saved // chunk` up to them are
    stored. A step that computes one token after the first marks the decode phase
    (`RequestTracker.update`), as does computing past the prompt.
L7  Store into the tiers (`LMCacheEngine.store`, `StorageManager.batched_put`): a host buffer
    is allocated for every chunk stored, one after another, each evicting host LRU chunks
    (one at a time, from the LRU end, skipping pinned ones) until it fits; the first that
    cannot be had ends the store (the chunks before it are stored). The host store then
    takes each key it does not hold (a key it holds is skipped, its recency unchanged, the
    buffer freed: the buffer's allocation may still have evicted another chunk); the disk
    takes each key, evicting its LRU chunks for room (`LocalDiskBackend.submit_put_task`).
    So the tiers are write-through: a chunk goes to host and disk at once, and an eviction
    from one never writes to the other.
L8  Capacities (`max_local_cpu_size`, `max_local_disk_size`): in bytes in LMCache, in tokens
    here (a chunk takes its tokens; the allocator's fragmentation is not modelled). The
    host's default is LMCache's `max_local_cpu_size` of 5.0 GiB; a disk has no default.

Where the decisions sit in the contract: `match` is the GPU's alone; `admit` allocates the GPU
blocks (apc), then looks LMCache up, touches, loads and promotes (L2-L5) and sets
`seq.num_computed` to every token not recomputed (a first chunk in serving that ends inside
the load recomputes instead, as `apc`'s host tier does: a table never passes what admit was
asked for); `commit` stores (L6, L7). `per_request_hits_by_tier` counts, per request, the GPU
hit, the tokens loaded from chunks found on the host, and those from chunks found on disk
(`storage_hit_tokens`).

The executor sees each copy as a `TierCopy` (cachelib/types.py): one per chunk stored (its
GPU blocks -> its host pages) and one per load (host pages -> the request's new blocks),
handed out in decision order with the next `admit`, `grow` or `fork`, before that call's own.
A chunk's host pages are `object id x pages per chunk + page in the chunk`, an id it keeps
while host or disk holds it: the executor's host memory stands for both, so a disk write, a
promotion or an eviction moves nothing there (its bytes are in `tier_traffic`).

Under the replay protocol transfers are instantaneous (the optimistic timing): pins live
only inside `admit`. Under serving (`time_transfers`, called by the `vllm` scheduler) each
admission's load and each step's store is reported as `TierTransfer`s the engine prices
(experiments/engine/transfers.py `connector_step_seconds`), as LMCache's vLLM v1 connector
runs them (vllm_v1_adapter.py as vendored in vLLM 0.33, read for this):
T1  `start_load_kv` without `use_layerwise` calls `LMCacheEngine.retrieve` for each request
    of the step before the forward, synchronously; `wait_for_save` calls `store` after it,
    synchronously (the step ends when the store has copied its chunks to host memory):
    `load_timing = "blocking"`, step = loads + compute + stores.
T2  With `lmcache_use_layerwise=True` (LMCache's `use_layerwise`, default False) the load is
    `retrieve_layer` (two layers before the forward, then one per layer in
    `wait_for_layer_load`) and the store `store_layer` (one layer per `save_kv_layer`):
    `load_timing = "layerwise"`, loads, compute and stores pipelined layer by layer
    (`cachelib.tiers.pipelined_store_step_seconds`; no store: `pipelined_step_seconds`).
T3  A load reports the chunks read from disk (`storage` -> `host`, every chunk read, at the
    disk's read bandwidth) and the chunks retrieved (`host` -> `gpu`, L4's whole chunks, at
    the host's read bandwidth): a disk hit pays its disk read, then its host-to-GPU copy.
    Taken from memory of LMCache 0.3.x's storage manager (not installed here): the disk
    read is blocking (`get_blocking`) and comes before the first layer in layerwise mode.
T4  A store reports `gpu` -> `host` for the chunks given host buffers (L7) and `host` ->
    `storage` for the chunks the disk takes, the latter from the store's end on the disk's
    own stream, waited for by nothing (LMCache's `LocalDiskBackend.submit_put_task` hands
    the write to a worker thread: from memory of 0.3.x, not re-read). Not modelled: a chunk
    whose disk write is in flight is visible to lookups at once (in LMCache it is found
    only once written), and a disk's reads and writes do not share its bandwidth.
Not modelled: async saving and async loading (`enable_async_loading`), `min_retrieve_tokens`, priorities,
`skip_last_n_tokens`, the allocator's fragmentation, blending, remote / P2P / GDS backends,
KV events of the LMCache tiers (apc's GPU events are emitted as apc emits them), and
preemption (a released request is finished; a re-admitted one is new, its lookup over its
prompt). Deviation, on purpose: a disk put of a key the disk holds refreshes its recency
(`insert_key`'s `update_on_hit`) without reserving room again; the reference's
`submit_put_task` first evicts for and adds the chunk's size once more, a size count that
then never comes back. A forked child (parallel sampling) shares its parent's blocks and
stores nothing itself.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.apc import APCCache
from cachelib.errors import InvalidRequestError
from cachelib.interface import Occupancy
from cachelib.registry import register_backend
from cachelib.storage_tier import NVME_READ_GBPS, NVME_WRITE_GBPS, DiskTier
from cachelib.tiers import (
    H200_HOST_READ_GBPS,
    H200_HOST_WRITE_GBPS,
    LLAMA3_8B_KV_BYTES_PER_TOKEN,
    HostTier,
    TierTransfer,
)
from cachelib.types import CopyOp, Match, Sequence, TierCopy

#: LMCache's `chunk_size` default (lmcache/v1/config.py)
LMCACHE_CHUNK_SIZE = 256
#: LMCache's `max_local_cpu_size` default, GiB (lmcache/v1/config.py)
LMCACHE_DEFAULT_CPU_GIB = 5.0


@dataclass(frozen=True)
class LMCacheSpec:
    """LMCache as configured: the chunk, the host store (a `HostTier`), the disk store (a
    `DiskTier`, or None), and the two save switches (L1, L6)."""

    chunk_tokens: int
    page_size: int
    host: HostTier
    disk: DiskTier | None
    save_unfull_chunk: bool = False
    save_decode_cache: bool = False

    @property
    def pages_per_chunk(self) -> int:
        return self.chunk_tokens // self.page_size

    @classmethod
    def from_options(cls, page_size: int, gpu_tokens: int, opts: dict[str, Any]) -> LMCacheSpec:
        """Check every option (an `InvalidRequestError` naming it, before any work) and
        build the spec."""
        chunk = opts["lmcache_chunk_size"]
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise InvalidRequestError(f"lmcache_chunk_size must be a positive int, got {chunk!r}")
        if chunk % page_size:
            # LMCache moves token slots; this model moves whole GPU pages (TierCopy), so a
            # chunk must start on a page
            raise InvalidRequestError(
                f"lmcache_chunk_size {chunk} must be a multiple of the GPU page size {page_size} "
                "(chunks are moved as whole pages here)"
            )
        for name in ("save_unfull_chunk", "save_decode_cache"):
            if not isinstance(opts[name], bool):
                raise InvalidRequestError(f"{name} must be a bool, got {opts[name]!r}")
        kvb = opts["kv_bytes_per_token"]
        host_tokens, host_gb = opts["host_capacity_tokens"], opts["host_capacity_gb"]
        if type(host_tokens) is int and host_tokens == 0 and not host_gb:
            if isinstance(kvb, bool) or not isinstance(kvb, int) or kvb <= 0:
                raise InvalidRequestError(f"kv_bytes_per_token must be a positive int, got {kvb!r}")
            # L8: LMCache's default host size, whole pages
            host_tokens = int(LMCACHE_DEFAULT_CPU_GIB * 1024**3) // kvb // page_size * page_size
        host = HostTier.build(
            page_size,
            gpu_tokens,
            capacity_tokens=host_tokens,
            capacity_gb=host_gb,
            read_gbps=opts["host_read_gbps"],
            write_gbps=opts["host_write_gbps"],
            kv_bytes_per_token=kvb,
        )
        if host.capacity_tokens < chunk:
            raise InvalidRequestError(
                f"a host tier of {host.capacity_tokens} tokens is smaller than one LMCache chunk of {chunk} tokens"
            )
        disk_opts = ("disk_capacity_tokens", "disk_capacity_gb", "disk_read_gbps", "disk_write_gbps")
        if opts["disk_capacity_tokens"] == 0 and opts["disk_capacity_gb"] == 0:
            defaults = (0, 0.0, NVME_READ_GBPS, NVME_WRITE_GBPS)
            stray = [k for k, d in zip(disk_opts, defaults, strict=True) if opts[k] != d or isinstance(opts[k], bool)]
            if stray or type(opts["disk_capacity_tokens"]) is not int:
                raise InvalidRequestError(
                    f"{', '.join(stray) or 'disk_capacity_tokens'} given without disk_capacity_tokens or "
                    "disk_capacity_gb (no disk tier)"
                )
            disk = None
        else:
            disk = DiskTier.build(
                page_size,
                capacity_tokens=opts["disk_capacity_tokens"],
                capacity_gb=opts["disk_capacity_gb"],
                read_gbps=opts["disk_read_gbps"],
                write_gbps=opts["disk_write_gbps"],
                kv_bytes_per_token=kvb,
            )
            if disk.capacity_tokens < chunk:
                raise InvalidRequestError(
                    f"a disk tier of {disk.capacity_tokens} tokens is smaller than one LMCache chunk of {chunk} tokens"
                )
        return cls(chunk, page_size, host, disk, opts["save_unfull_chunk"], opts["save_decode_cache"])


class LruStore:
    """One LMCache storage backend's index: keys in LRU order (an `OrderedDict`, LRU first, as
    `LRUCachePolicy.init_mutable_mapping`), each with its chunk's tokens, and the tokens used."""

    __slots__ = ("name", "capacity", "entries", "used")

    def __init__(self, name: str, capacity: int) -> None:
        self.name = name
        self.capacity = capacity
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self.used = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def run(self, keys: list[bytes], start: int) -> int:
        """How many of `keys[start:]` it holds, consecutively from the first (`batched_contains`)."""
        n = 0
        entries = self.entries
        for key in keys[start:]:
            if key not in entries:
                break
            n += 1
        return n

    def touch(self, key: bytes) -> None:
        """`update_on_hit`: to the MRU end."""
        self.entries.move_to_end(key)

    def insert(self, key: bytes, tokens: int) -> None:
        self.entries[key] = tokens
        self.used += tokens

    def remove(self, key: bytes) -> int:
        tokens = self.entries.pop(key)
        self.used -= tokens
        return tokens

    def victim(self, pinned: set[bytes]) -> bytes | None:
        """`get_evict_candidates(num_candidates=1)`: the first key from the LRU end that may go."""
        for key in self.entries:
            if key not in pinned:
                return key
        return None


class _Tracker:
    """Per request, what the adapter keeps (`LoadSpec`, `RequestTracker`): the lookup's hit,
    the tokens saved so far, the phase; and what its admission reused, per tier."""

    __slots__ = ("num_saved", "is_decode", "first_step", "gpu_tokens", "host_tokens", "storage_tokens", "lmc_hit")

    def __init__(self, lmc_hit: int, gpu_tokens: int) -> None:
        self.lmc_hit = lmc_hit
        self.num_saved = lmc_hit  # `from_new_request(num_saved_tokens=lmcache_cached_tokens)`
        self.is_decode = False
        self.first_step = True
        self.gpu_tokens = gpu_tokens
        self.host_tokens = 0
        self.storage_tokens = 0


class LMCacheTier:
    """LMCache below one apc cache: the chunk objects, the host store, the disk store, and the
    adapter's load and store decisions (L2-L7), with instantaneous transfers."""

    def __init__(self, spec: LMCacheSpec) -> None:
        self.spec = spec
        self.host = LruStore("host", spec.host.capacity_tokens)
        self.disk = LruStore("storage", spec.disk.capacity_tokens) if spec.disk is not None else None
        #: key -> the id of its host pages (kept while host or disk holds the key)
        self.objects: dict[bytes, int] = {}
        self._free_ids: list[int] = []
        self._next_id = 0
        #: the page moves decided and not yet handed to the executor, in decision order
        self.moves: list[TierCopy] = []
        self.counters = dict(
            lookups=0,
            load_hits=0,
            host_loaded_tokens=0,  # into new GPU blocks, from chunks found on the host
            storage_loaded_tokens=0,  # into new GPU blocks, from chunks found on disk
            retrieved_tokens=0,  # whole chunks retrieved (LMCache's count)
            host_to_gpu_tokens=0,
            storage_to_host_tokens=0,  # disk reads (each promoted when the batch could be read)
            promoted_chunks=0,
            failed_promotions=0,
            stored_chunks=0,  # chunks a store allocated a buffer for
            gpu_to_host_tokens=0,  # buffers filled from the GPU (every chunk stored)
            host_to_storage_tokens=0,  # disk writes
            host_duplicate_puts=0,
            storage_duplicate_puts=0,
            truncated_stores=0,
            failed_storage_puts=0,
            host_evicted_chunks=0,
            host_evicted_tokens=0,
            storage_evicted_chunks=0,
            storage_evicted_tokens=0,
        )

    # -- chunk objects (host pages for the executor) --------------------------------------

    def _object(self, key: bytes) -> tuple[int, bool]:
        """The key's object id, and whether it is new (its KV must be copied from the GPU)."""
        oid = self.objects.get(key)
        if oid is not None:
            return oid, False
        oid = self._free_ids.pop() if self._free_ids else self._next_id
        if oid == self._next_id:
            self._next_id += 1
        self.objects[key] = oid
        return oid, True

    def _forget_if_gone(self, key: bytes) -> None:
        if key not in self.host and (self.disk is None or key not in self.disk):
            self._free_ids.append(self.objects.pop(key))

    # -- evictions ---------------------------------------------------------------------

    def _host_room(self, tokens: int, reserved: int, pinned: set[bytes]) -> bool:
        """`LocalCPUBackend.allocate` with eviction: evict LRU host chunks, one at a time, until
        `tokens` more fit beside the `reserved` buffers; False if that cannot be done."""
        store = self.host
        while store.used + reserved + tokens > store.capacity:
            victim = store.victim(pinned)
            if victim is None:
                return False
            n = store.remove(victim)
            self.counters["host_evicted_chunks"] += 1
            self.counters["host_evicted_tokens"] += n
            self._forget_if_gone(victim)
        return True

    def _disk_room(self, tokens: int) -> bool:
        """`LocalDiskBackend.submit_put_task`'s eviction loop (nothing is pinned between calls)."""
        store = self.disk
        while store.used + tokens > store.capacity:
            victim = store.victim(set())
            if victim is None:
                return False
            n = store.remove(victim)
            self.counters["storage_evicted_chunks"] += 1
            self.counters["storage_evicted_tokens"] += n
            self._forget_if_gone(victim)
        return True

    # -- L2-L5: lookup and load at admission ---------------------------------------------

    def lookup(self, keys: list[bytes]) -> tuple[int, int]:
        """(chunks hit on the host, chunks hit on disk after them): L2. Read-only."""
        host_run = self.host.run(keys, 0)
        disk_run = self.disk.run(keys, host_run) if self.disk is not None and host_run < len(keys) else 0
        return host_run, disk_run

    def admit(
        self, chunks: list[tuple[bytes, int, int]], seq_len: int, gpu: int, num_tokens: int, table: list[int]
    ) -> _Tracker:
        """A request admitted with `gpu` tokens hit on the GPU, `chunks` its prompt's chunks
        (key, start, end): look up, touch, load into its new blocks of `table`, promote.
        Returns its tracker (what was reused from which tier, where its stores start)."""
        keys = [k for k, _, _ in chunks]
        host_run, disk_run = self.lookup(keys)
        hit_chunks = host_run + disk_run
        lmc_hit = chunks[hit_chunks - 1][2] if hit_chunks else 0
        self.counters["lookups"] += 1
        # L3: pinned until the step ends; each store's hits to its MRU end, deepest first
        for key in reversed(keys[:host_run]):
            self.host.touch(key)
        for key in reversed(keys[host_run:hit_chunks]):
            self.disk.touch(key)
        tracker = _Tracker(lmc_hit, gpu)
        need = lmc_hit - gpu - (1 if lmc_hit == seq_len else 0)  # L4
        if need <= 0 or not (gpu + need < num_tokens or num_tokens == seq_len):
            return tracker
        chunk = self.spec.chunk_tokens
        first = gpu // chunk  # the chunk holding the first token the GPU lacks
        pinned = set(keys[:hit_chunks])
        end = lmc_hit
        retrieved_host = sum(e - s for _, s, e in chunks[first:host_run])
        # L5: the disk's chunks through host buffers, then promoted if all were read
        disk_first = max(first, host_run)
        reserved, read = 0, []
        for i in range(disk_first, hit_chunks):
            key, start, stop = chunks[i]
            self.disk.touch(key)  # `get_blocking`: update_on_hit
            if not self._host_room(stop - start, reserved, pinned):
                end = start
                self.counters["failed_promotions"] += 1
                break
            reserved += stop - start
            read.append(chunks[i])
        if end == lmc_hit:
            for key, start, stop in read:
                if key not in self.host:
                    self.host.insert(key, stop - start)
                    self.counters["promoted_chunks"] += 1
        c = self.counters
        c["storage_to_host_tokens"] += reserved
        c["host_to_gpu_tokens"] += retrieved_host + reserved
        c["retrieved_tokens"] += retrieved_host + reserved
        loaded = min(need, end - gpu)
        if loaded <= 0:
            return tracker
        computed = gpu + loaded
        host_end = chunks[host_run - 1][2] if host_run else 0
        tracker.host_tokens = max(0, min(computed, host_end) - gpu)
        tracker.storage_tokens = loaded - tracker.host_tokens
        c["load_hits"] += 1
        c["host_loaded_tokens"] += tracker.host_tokens
        c["storage_loaded_tokens"] += tracker.storage_tokens
        # one move for the whole load: each new block the load reaches <- its chunk's host page
        size, ppc = self.spec.page_size, self.spec.pages_per_chunk
        pages = range(gpu // size, -(-end // size))
        self.moves.append(
            TierCopy(
                False,
                tuple(table[b] for b in pages),
                tuple(self.objects[keys[b // ppc]] * ppc + b % ppc for b in pages),
            )
        )
        return tracker

    # -- L6, L7: stores after each step --------------------------------------------------

    def to_save(self, tracker: _Tracker, prompt_len: int, before: int, computed: int) -> tuple[int, int] | None:
        """The adapter's save decision for a step that took the request from `before` to
        `computed` tokens (L6): (first token of the first chunk to store, tokens to save), or None."""
        spec = self.spec
        chunk = spec.chunk_tokens
        if (not tracker.first_step and computed - before == 1) or computed > prompt_len:
            tracker.is_decode = True  # `RequestTracker.update`: one new token
        tracker.first_step = False
        boundary = -(-(tracker.num_saved + 1) // chunk) * chunk
        if (tracker.num_saved > 0 and computed < boundary) or (tracker.is_decode and not spec.save_decode_cache):
            return None
        last_prefill = computed == prompt_len
        num_to_save = computed if last_prefill and spec.save_unfull_chunk else computed // chunk * chunk
        skip = tracker.num_saved
        tracker.num_saved = num_to_save
        if skip == num_to_save:
            return None
        return skip // chunk * chunk, num_to_save

    def store(self, chunks: list[tuple[bytes, int, int]], table: list[int]) -> None:
        """`LMCacheEngine.store` + `StorageManager.batched_put` of `chunks` (key, start, end)
        from the request's GPU pages `table` (L7)."""
        c = self.counters
        reserved, taken = 0, []
        for key, start, stop in chunks:
            if not self._host_room(stop - start, reserved, set()):
                c["truncated_stores"] += 1
                break
            reserved += stop - start
            taken.append((key, start, stop))
        c["stored_chunks"] += len(taken)
        c["gpu_to_host_tokens"] += reserved
        for key, start, stop in taken:  # LocalCPUBackend first
            if key in self.host:
                c["host_duplicate_puts"] += 1
                continue
            self.host.insert(key, stop - start)
            self._copy_out(key, start, stop, table)
        if self.disk is None:
            return
        for key, start, stop in taken:  # then LocalDiskBackend
            if key in self.disk:
                self.disk.touch(key)
                c["storage_duplicate_puts"] += 1
                continue
            if not self._disk_room(stop - start):
                c["failed_storage_puts"] += 1
                continue
            self.disk.insert(key, stop - start)
            c["host_to_storage_tokens"] += stop - start
            self._copy_out(key, start, stop, table)

    def _copy_out(self, key: bytes, start: int, stop: int, table: list[int]) -> None:
        """The chunk's KV to its host pages, once per object (host and disk share it)."""
        oid, new = self._object(key)
        if not new:
            return
        size, ppc = self.spec.page_size, self.spec.pages_per_chunk
        first = start // size
        n = -(-(stop - start) // size)
        self.moves.append(TierCopy(True, tuple(table[first : first + n]), tuple(range(oid * ppc, oid * ppc + n))))

    # -- observation ---------------------------------------------------------------------

    def take_moves(self) -> list[TierCopy]:
        moves, self.moves = self.moves, []
        return moves

    def traffic(self) -> dict[str, int]:
        """What moved and what each tier holds: tokens, and bytes from each tier's bytes per
        token; the names `apc`'s host tier uses where they mean the same."""
        c, spec = self.counters, self.spec
        host = spec.host
        loaded = c["host_loaded_tokens"] + c["storage_loaded_tokens"]
        out = {
            "backed_up": c["gpu_to_host_tokens"],  # GPU -> host, tokens
            "loaded": loaded,  # into new GPU blocks (a last prompt token then recomputed not included)
            "host_evicted": c["host_evicted_tokens"],
            "gpu_to_host_bytes": host.bytes_of(c["gpu_to_host_tokens"]),
            "host_to_gpu_bytes": host.bytes_of(c["host_to_gpu_tokens"]),
            "host_tokens": self.host.used,
            "host_capacity_tokens": self.host.capacity,
            **c,
        }
        if self.disk is not None:
            disk = spec.disk
            out |= {
                "storage_evicted": c["storage_evicted_tokens"],
                "host_to_storage_bytes": disk.bytes_of(c["host_to_storage_tokens"]),
                "storage_to_host_bytes": disk.bytes_of(c["storage_to_host_tokens"]),
                "storage_tokens": self.disk.used,
                "storage_capacity_tokens": self.disk.capacity,
            }
        return out


@register_backend("apc-lmcache")
class APCLMCacheCache(APCCache):
    """apc over `num_pages` blocks of `page_size` tokens with LMCache's host and disk stores below."""

    compared_by_default = False  # holds KV beyond the GPU capacity the others get
    load_timing = "blocking"  # LMCache's connector retrieves before, stores after the forward (T1)
    connector_steps = True  # a step waits for its loads and its stores (T1, T2)

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        hash_algorithm: str = "xxh3_128",
        lmcache_chunk_size: int = LMCACHE_CHUNK_SIZE,
        host_capacity_tokens: int = 0,
        host_capacity_gb: float = 0.0,
        disk_capacity_tokens: int = 0,
        disk_capacity_gb: float = 0.0,
        save_unfull_chunk: bool = False,
        save_decode_cache: bool = False,
        host_read_gbps: float = H200_HOST_READ_GBPS,
        host_write_gbps: float = H200_HOST_WRITE_GBPS,
        disk_read_gbps: float = NVME_READ_GBPS,
        disk_write_gbps: float = NVME_WRITE_GBPS,
        kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN,
        lmcache_use_layerwise: bool = False,
    ) -> None:
        if not isinstance(lmcache_use_layerwise, bool):
            raise InvalidRequestError(f"lmcache_use_layerwise must be a bool, got {lmcache_use_layerwise!r}")
        super().__init__(num_pages, page_size, hash_algorithm=hash_algorithm)
        if lmcache_use_layerwise:
            self.load_timing = "layerwise"  # T2
        #: serving's transfer clock (`time_transfers`): the loads and stores not yet taken
        self._lmc_transfers: list[TierTransfer] | None = None
        spec = LMCacheSpec.from_options(
            page_size,
            num_pages * page_size,
            dict(
                lmcache_chunk_size=lmcache_chunk_size,
                host_capacity_tokens=host_capacity_tokens,
                host_capacity_gb=host_capacity_gb,
                disk_capacity_tokens=disk_capacity_tokens,
                disk_capacity_gb=disk_capacity_gb,
                save_unfull_chunk=save_unfull_chunk,
                save_decode_cache=save_decode_cache,
                host_read_gbps=host_read_gbps,
                host_write_gbps=host_write_gbps,
                disk_read_gbps=disk_read_gbps,
                disk_write_gbps=disk_write_gbps,
                kv_bytes_per_token=kv_bytes_per_token,
            ),
        )
        #: LMCache below the GPU blocks
        self.lmc = LMCacheTier(spec)
        self.memory_tiers = ("gpu", "host", "storage") if spec.disk is not None else ("gpu", "host")
        #: request id -> its adapter state (live requests admitted here, not forked children)
        self._trackers: dict[str, _Tracker] = {}

    # -- chunk keys (L1) ------------------------------------------------------------------

    def chunk_keys(self, seq: Sequence, num_tokens: int) -> list[tuple[bytes, int, int]]:
        """(key, start, end) of the chunks of `seq`'s first `num_tokens` tokens: every full
        chunk, and a shorter last one with `save_unfull_chunk`."""
        spec = self.lmc.spec
        chunk, ppc = spec.chunk_tokens, spec.pages_per_chunk
        full = num_tokens // chunk
        hashes = self._block_hashes(seq, full * ppc)
        out = [(hashes[(i + 1) * ppc - 1], i * chunk, (i + 1) * chunk) for i in range(full)]
        if spec.save_unfull_chunk and num_tokens % chunk:
            start = full * chunk
            parent = out[-1][0] if out else b""
            extra = self.hasher.extra_bytes(seq.extra, start // self.page_size)
            body = np.ascontiguousarray(seq.tokens[start:num_tokens]).tobytes()
            key = b"partial:" + hashlib.blake2b(parent + body + extra, digest_size=16).digest()
            out.append((key, start, num_tokens))
        return out

    # -- the contract's hooks ---------------------------------------------------------------

    def _admit(self, seq: Sequence, match: Match, num_tokens: int):
        admitted = super()._admit(seq, match, num_tokens)
        if admitted is None:
            return None
        held, ops = admitted
        prompt = min(seq.prompt_len, len(seq))
        c = self.lmc.counters
        read, retrieved = c["storage_to_host_tokens"], c["host_to_gpu_tokens"]
        tracker = self.lmc.admit(self.chunk_keys(seq, prompt), len(seq), match.num_tokens, num_tokens, seq.page_table)
        if self._lmc_transfers is not None:  # T3: what this admission read and retrieved
            if c["storage_to_host_tokens"] > read:
                self._lmc_transfers.append(TierTransfer("storage", "host", c["storage_to_host_tokens"] - read))
            if c["host_to_gpu_tokens"] > retrieved:
                self._lmc_transfers.append(
                    TierTransfer("host", "gpu", c["host_to_gpu_tokens"] - retrieved, seq.request_id)
                )
        seq.num_computed = match.num_tokens + tracker.host_tokens + tracker.storage_tokens
        self._trackers[seq.request_id] = tracker
        return held, [*self.lmc.take_moves(), *ops]

    def _grow(self, seq: Sequence, held, num_tokens: int) -> list[CopyOp] | None:
        ops = super()._grow(seq, held, num_tokens)
        if ops is None or not self.lmc.moves:
            return ops
        return [*self.lmc.take_moves(), *ops]

    def _commit(self, seq: Sequence, held, num_computed: int) -> None:
        before = seq.num_computed
        super()._commit(seq, held, num_computed)
        tracker = self._trackers.get(seq.request_id)
        if tracker is None or num_computed == before:
            return
        decided = self.lmc.to_save(tracker, seq.prompt_len, before, num_computed)
        if decided is None:
            return
        first, upto = decided
        chunks = [c for c in self.chunk_keys(seq, upto) if c[1] >= first]
        if not chunks:
            return
        c = self.lmc.counters
        stored, written = c["gpu_to_host_tokens"], c["host_to_storage_tokens"]
        self.lmc.store(chunks, seq.page_table)
        if self._lmc_transfers is not None:  # T4: the step's store, then the disk's writes
            if c["gpu_to_host_tokens"] > stored:
                self._lmc_transfers.append(TierTransfer("gpu", "host", c["gpu_to_host_tokens"] - stored))
            if c["host_to_storage_tokens"] > written:
                self._lmc_transfers.append(TierTransfer("host", "storage", c["host_to_storage_tokens"] - written))

    def _fork(self, parent: Sequence, held, child: Sequence):
        forked = super()._fork(parent, held, child)
        if forked is None or not self.lmc.moves:
            return forked
        state, ops = forked
        return state, [*self.lmc.take_moves(), *ops]

    def _release(self, seq: Sequence, held) -> None:
        super()._release(seq, held)
        self._trackers.pop(seq.request_id, None)

    # -- transfer timing (serving): T1-T4 ---------------------------------------------------

    def time_transfers(self) -> None:
        """Record each admission's load and each store for the serving clock (T1-T4). No
        ticket: a load is done when its step's forward starts, a store when its step ends."""
        if self._live:
            raise InvalidRequestError("time_transfers: call it before the first request")
        self._lmc_transfers = []

    def take_transfers(self) -> list[TierTransfer]:
        if not self._lmc_transfers:
            return []
        out, self._lmc_transfers = self._lmc_transfers, []
        return out

    def _tier_link_seconds(self, src: str, dst: str, tokens: int) -> float:
        spec = self.lmc.spec
        if (src, dst) in (("host", "gpu"), ("gpu", "host")):
            return spec.host.transfer_seconds(tokens, write=dst == "host")
        if spec.disk is not None and (src, dst) in (("storage", "host"), ("host", "storage")):
            return spec.disk.transfer_seconds(tokens, write=dst == "storage")
        return super()._tier_link_seconds(src, dst, tokens)

    def tier_bytes(self, tokens: int) -> int:
        return self.lmc.spec.host.bytes_of(tokens)

    # -- observation ----------------------------------------------------------------------

    def _storage_hit_tokens(self, seq: Sequence) -> int:
        """Of the tokens the live `seq`'s admission loaded back, those from chunks found on disk."""
        tracker = self._trackers.get(seq.request_id)
        return tracker.storage_tokens if tracker is not None else 0

    def tier_traffic(self) -> dict[str, int]:
        """Tokens (and bytes) moved between the GPU, the host and the disk so far, and what
        the host and the disk hold."""
        return self.lmc.traffic()

    def tier_capacities(self) -> dict[str, int]:
        lmc = self.lmc
        caps = {"gpu": self.num_pages * self.page_size, "host": lmc.host.capacity}
        return caps if lmc.disk is None else caps | {"storage": lmc.disk.capacity}

    def _occupancy(self) -> Occupancy:
        occ = super()._occupancy()
        extra = {**occ.extra, "host_cached_tokens": self.lmc.host.used}
        if self.lmc.disk is not None:
            extra["storage_cached_tokens"] = self.lmc.disk.used
        return occ._replace(extra=extra)

    def _check_invariants(self) -> None:
        super()._check_invariants()
        from backends.apc_lmcache_invariants import check_lmcache

        check_lmcache(self)
