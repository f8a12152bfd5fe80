"""Memory tiers below a backend's GPU pages (docs/design.md §7): what each tier holds and how fast
it moves KV.

L1 is the backend's own GPU pages (`num_pages` x `page_size`, unchanged). Below it:

- L2, host memory (`HostTier`): a capacity in tokens and a read / write bandwidth. Built:
  the `radix-hicache` backend (`backends/radix_hicache.py`, SGLang 0.5.23 HiCache) keeps
  host copies in it.
- L3, storage (`StorageTier`): SGLang 0.5.23's HiCache storage layer below the host tier,
  a store of pages keyed by their chained page hash. `file` is `--hicache-storage-backend
  file` (local disk, one file per page, `mem_cache/hicache_storage.py` `HiCacheFile` with
  its `storage/file/lru_file_evictor.py` `LRUFileEvictor`); `shared` is one pool every
  replica of a cluster reads and writes (Mooncake Store semantics: a put of a key already
  stored is skipped). Built under `radix-hicache`. `apc-lmcache` keeps its own local disk
  below its host store (`cachelib/storage_tier.py` `DiskTier`, LMCache's rules); the other
  backends report 0 there.

A tier never knows about tensors: it is capacities, bandwidths and the bytes one token of
KV takes (to turn a capacity in GB into tokens and tokens moved into bytes).

Bandwidth defaults for an H200 host (`H200_HOST_READ_GBPS`, `H200_HOST_WRITE_GBPS`): the
H200 SXM's host link is PCIe Gen5 x16, which NVIDIA's H200 datasheet gives as 128 GB/s
bidirectional (nvidia.com, "NVIDIA H200 Tensor Core GPU" datasheet, interconnect row:
"PCIe Gen5: 128GB/s"), i.e. 64 GB/s each way; that ceiling is the default in both
directions (what a copy engine reaches in practice is lower: pass a measured figure). Under
the replay protocol transfers are instantaneous (the GPU-optimistic timing) and the
bandwidths are not read. On the serving clock they cost time: a tiered cache reports each
transfer (`TierTransfer`) and the engine prices it at these bandwidths
(experiments/engine/transfers.py), overlapping a load with the forward as its reference
does (`LOAD_TIMINGS`, `pipelined_step_seconds`).

Storage defaults (`StorageTier`). Capacity: unbounded, as SGLang's file backend is unless
`max_size` (`--hicache-storage-backend-extra-config '{"max_size": ...}'` or
`SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE`) is set; `storage_capacity_tokens` /
`storage_capacity_gb` model that cap. Bandwidth: `file` is one local NVMe drive, the DGX
H200's internal storage (NVIDIA DGX H200 datasheet: "8x 3.84 TB NVMe U.2"), PCIe Gen4 x4
drives of the class of Samsung's PM1733 (datasheet: 7,000 MB/s sequential read, 3,800 MB/s
sequential write at 3.84 TB): `FILE_READ_GBPS` 7.0, `FILE_WRITE_GBPS` 3.8 (SGLang writes
one file per page through the page cache, so one drive is the honest ceiling). `shared`
is Mooncake's transfer engine over RDMA, one ConnectX-7 NIC of the H200 host (400 Gb/s =
50 GB/s each way, DGX H200 datasheet): `SHARED_READ_GBPS` = `SHARED_WRITE_GBPS` = 50.
Measured figures should replace them (`storage_read_gbps`, `storage_write_gbps`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from cachelib.errors import InvalidRequestError
from cachelib.hashing import BlockHash

#: the tiers metrics report, in order (`per_request_hits_by_tier` columns)
TIER_NAMES = ("gpu", "host", "storage")

#: GB/s host -> GPU and GPU -> host: PCIe Gen5 x16, 128 GB/s bidirectional (H200 datasheet)
H200_HOST_READ_GBPS = 64.0
H200_HOST_WRITE_GBPS = 64.0

#: host size when none is given: SGLang's default `--hicache-ratio` (host = 2 x device;
#: `srt/arg_groups/hicache_hook.py` `handle_hicache_ratio_default`)
DEFAULT_HOST_RATIO = 2

#: bytes of KV per token of Llama-3-8B (the project's default model, experiments/runs/defaults.py)
#: in bf16: 2 (K and V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes; used only to
#: turn a capacity in GB into tokens and tokens moved into bytes
LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def check_kv_bytes_per_token(value: object) -> int:
    """`kv_bytes_per_token` checked: a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidRequestError(f"kv_bytes_per_token must be a positive int, got {value!r}")
    return value


def check_bandwidth(name: str, value: object) -> float:
    """A bandwidth option checked: a positive, finite number of GB/s (an infinite one would
    make transfers free without saying so; the replay protocol is the way to model that)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise InvalidRequestError(f"{name} must be a positive bandwidth in GB/s, got {value!r}")
    return float(value)


def tier_capacity_tokens(
    tier: str,
    page_size: int,
    capacity_tokens: object,
    capacity_gb: object,
    kv_bytes_per_token: int,
    *,
    absent: int | None,
) -> int:
    """A tier's capacity in tokens from its options `{tier}_capacity_tokens` and
    `{tier}_capacity_gb` (0: not given), checked by name before any work: at most one is
    given; a capacity in GB (10**9 bytes) becomes whole pages of `kv_bytes_per_token`-byte
    tokens; one in tokens must be whole pages; neither is `absent` (None: a size is
    required; 0: unbounded). A size given that comes to less than one page is refused."""
    if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens < 0:
        raise InvalidRequestError(f"{tier}_capacity_tokens must be a non-negative int, got {capacity_tokens!r}")
    if (
        isinstance(capacity_gb, bool)
        or not isinstance(capacity_gb, (int, float))
        or not 0 <= capacity_gb < float("inf")
    ):
        raise InvalidRequestError(f"{tier}_capacity_gb must be a non-negative finite number, got {capacity_gb!r}")
    if capacity_tokens and capacity_gb:
        raise InvalidRequestError(
            f"give a {tier} tier's size once: {tier}_capacity_tokens or {tier}_capacity_gb "
            f"(got {capacity_tokens!r} tokens and {capacity_gb!r} GB)"
        )
    if capacity_gb:
        tokens = int(capacity_gb * 1e9) // kv_bytes_per_token // page_size * page_size
        what = f"{tier}_capacity_gb={capacity_gb} ({tokens} tokens of {kv_bytes_per_token} bytes)"
    elif capacity_tokens:
        tokens, what = capacity_tokens, f"{tier}_capacity_tokens={capacity_tokens}"
    elif absent is None:
        raise InvalidRequestError(f"a {tier} tier needs {tier}_capacity_tokens or {tier}_capacity_gb")
    else:
        return absent  # the default (0: unbounded), whole pages already
    if tokens < page_size:
        raise InvalidRequestError(f"a {tier} tier smaller than one page of {page_size} tokens: {what}")
    if tokens % page_size:
        raise InvalidRequestError(f"{what} is not a whole number of {page_size}-token pages")
    return int(tokens)


@dataclass(frozen=True)
class TierFigures:
    """What a tier below the GPU is to the serving clock: `capacity_tokens` (whole pages;
    0 only for an unbounded storage tier), `read_gbps` (out of this tier, towards the GPU),
    `write_gbps` (into it), `kv_bytes_per_token` (to turn tokens moved into bytes). Host
    memory (`HostTier`), LMCache's disk (`cachelib.storage_tier.DiskTier`) and SGLang's
    storage (`StorageTier`, which holds one) share it."""

    capacity_tokens: int
    read_gbps: float
    write_gbps: float
    kv_bytes_per_token: int

    @classmethod
    def checked(
        cls,
        tier: str,
        page_size: int,
        *,
        capacity_tokens: object,
        capacity_gb: object,
        read_gbps: object,
        write_gbps: object,
        kv_bytes_per_token: object,
        absent: int | None,
    ) -> TierFigures:
        """The tier's figures from its options (`{tier}_capacity_tokens`, `{tier}_read_gbps`,
        ...), every one checked by name before any work (`tier_capacity_tokens` for the size,
        `absent` the size when none is given); what each tier's `build` shares."""
        kv_bytes = check_kv_bytes_per_token(kv_bytes_per_token)
        read = check_bandwidth(f"{tier}_read_gbps", read_gbps)
        write = check_bandwidth(f"{tier}_write_gbps", write_gbps)
        tokens = tier_capacity_tokens(tier, page_size, capacity_tokens, capacity_gb, kv_bytes, absent=absent)
        return cls(tokens, read, write, kv_bytes)

    def bytes_of(self, tokens: int) -> int:
        """Bytes of KV in `tokens` tokens."""
        return tokens * self.kv_bytes_per_token

    def transfer_seconds(self, tokens: int, *, write: bool) -> float:
        """Seconds to move `tokens` tokens of KV one way: into this tier (`write`) or out of
        it, at its bandwidth (what a serving clock charges; the replay protocol charges
        nothing). A negative count is refused: it would price as time given back."""
        if tokens < 0:
            raise InvalidRequestError(f"transfer_seconds: tokens must be non-negative, got {tokens!r}")
        gbps = self.write_gbps if write else self.read_gbps
        return self.bytes_of(tokens) / (gbps * 1e9)


@dataclass(frozen=True)
class HostTier(TierFigures):
    """L2: host memory below the GPU pages.

    `read_gbps` is host -> GPU (a load-back), `write_gbps` GPU -> host (a backup)."""

    capacity_tokens: int
    read_gbps: float = H200_HOST_READ_GBPS
    write_gbps: float = H200_HOST_WRITE_GBPS
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN

    @classmethod
    def build(
        cls,
        page_size: int,
        gpu_tokens: int,
        *,
        capacity_tokens: int = 0,
        capacity_gb: float = 0.0,
        read_gbps: float = H200_HOST_READ_GBPS,
        write_gbps: float = H200_HOST_WRITE_GBPS,
        kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN,
    ) -> HostTier:
        """Check every figure and build the tier (`InvalidRequestError` naming the bad one,
        before any work). At most one of `capacity_tokens` and `capacity_gb` is given; a
        capacity in GB becomes whole pages of `kv_bytes_per_token`-byte tokens; neither
        (both 0) is SGLang's default `--hicache-ratio 2.0`: twice the GPU's `gpu_tokens`."""
        return cls.checked(  # type: ignore[return-value]
            "host",
            page_size,
            capacity_tokens=capacity_tokens,
            capacity_gb=capacity_gb,
            read_gbps=read_gbps,
            write_gbps=write_gbps,
            kv_bytes_per_token=kv_bytes_per_token,
            absent=DEFAULT_HOST_RATIO * gpu_tokens,
        )


#: the way a tier's loads meet the forward pass (a backend's `PrefixCache.load_timing`):
#: `layerwise` -- SGLang 0.5.23 HiCache: the step's load-backs are copied layer by layer on
#: their own stream while the prefill runs, each layer's attention waiting for its layer
#: (`pipelined_step_seconds`); `async` -- vLLM 0.33's offloading connector: a request whose
#: hit needs a load waits (WAITING_FOR_REMOTE_KVS) until the load completes, then is scheduled;
#: `blocking` -- LMCache's vLLM v1 connector without `use_layerwise`: `start_load_kv` retrieves
#: before the forward and `wait_for_save` stores after it, both synchronously, so a step takes
#: its loads + its compute + its stores (experiments/engine/transfers.py `connector_step_seconds`)
LOAD_TIMINGS = ("layerwise", "async", "blocking")


@dataclass(frozen=True, slots=True)
class TierTransfer:
    """KV a cache moved between two tiers, as the serving engine prices it (the contract
    stays free of time: the cache says what moved, the engine charges the tier's bandwidth).

    `src` -> `dst` are names of `TIER_NAMES` (`host` -> `gpu` a load, `gpu` -> `host` a
    backup or store; a storage tier adds its own pairs). `request_id`: the request whose
    admission needed it (a load), else None. `ticket`: set when the cache holds what this
    moves (a node locked, blocks not freed) until the engine says it completed
    (`PrefixCache.finish_transfers`); None when nothing waits on it. `blocking`: the
    reference waits for it before it goes on scheduling (SGLang's write_back backup of an
    evicted node, `writing_check(write_back=True)`)."""

    src: str
    dst: str
    tokens: int
    request_id: str | None = None
    ticket: int | None = None
    blocking: bool = False

    @property
    def to_gpu(self) -> bool:
        return self.dst == "gpu"


def pipelined_step_seconds(compute: float, load: float, layers: int) -> float:
    """A step whose forward takes `compute` seconds while `load` seconds of KV are copied in
    on a stream of their own, layer by layer, each layer's attention waiting for its layer
    (SGLang 0.5.23: `HiCacheController.start_loading` submits the batch's merged load, one
    layer after another, recording `LayerDoneCounter` events; the attention of layer i calls
    `layer_transfer_counter.wait_until(i)` in `MHATokenToKVPool.get_key_buffer`).

    With c = compute / L per layer and t = load / L per layer (both spread evenly), layer i
    is loaded at (i + 1) t and its compute ends at e_i = max(e_{i-1}, (i + 1) t) + c, so
    e_{L-1} = max over k of ((k + 1) t + (L - k) c), linear in k, largest at an end:
    k = 0 (the first layer's load, then all compute) or k = L - 1 (every load, then the
    last layer's compute). Hence `max(compute + load / L, load + compute / L)`; no load is
    `compute` itself."""
    if load <= 0.0:
        return compute
    return max(compute + load / layers, load + compute / layers)


def pipelined_store_step_seconds(compute: float, load: float, store: float, layers: int) -> float:
    """`pipelined_step_seconds` with a third stage: each layer's KV is also stored once its
    compute ends, on a stream of its own (LMCache 0.3.x with `use_layerwise`: the connector's
    `save_kv_layer` steps a layerwise storer after every layer's attention, and
    `wait_for_save` waits for the last layer's store).

    Three stages (load, compute, store) of equal per-layer times t, c, s over L layers, each
    stage in layer order, form a flow shop of L identical jobs: the makespan is
    t + c + s + (L - 1) max(t, c, s) (the slowest stage runs without a gap once fed, the
    others add one layer's time each). With no store this is `pipelined_step_seconds`
    (returned as that, so the two agree to the last bit)."""
    if store <= 0.0:
        return pipelined_step_seconds(compute, load, layers)
    t, c, s = load / layers, compute / layers, store / layers
    return t + c + s + (layers - 1) * max(t, c, s)


#: GB/s of one PCIe Gen4 x4 NVMe drive (DGX H200's internal U.2 drives; PM1733 datasheet)
FILE_READ_GBPS = 7.0
FILE_WRITE_GBPS = 3.8
#: GB/s each way of one 400 Gb/s ConnectX-7 NIC (Mooncake's RDMA transfer engine)
SHARED_READ_GBPS = 50.0
SHARED_WRITE_GBPS = 50.0

#: `--hicache-storage-backend` choices modelled: local disk, a pool shared by a cluster
STORAGE_BACKENDS = ("file", "shared")

#: `--hicache-storage-prefetch-policy` (`unified_cache/storage_attachment.py`)
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")

#: a `timeout` prefetch waits at most base + per-1024-token x the tokens it asked for,
#: counted from the first admission poll it blocked (`storage_attachment.py`:
#: `prefetch_timeout_base` 1 s, `prefetch_timeout_per_ki_token` 0.25 s, their defaults in
#: `hybrid_cache_controller.py`; `_start_storage_prefetch_wait`)
PREFETCH_TIMEOUT_BASE_S = 1.0
PREFETCH_TIMEOUT_PER_KI_TOKEN_S = 0.25


class StoragePrefetch(NamedTuple):
    """A storage prefetch a cache would issue for a request now (`PrefixCache.
    storage_prefetch`): `asked`, the tokens past its match it asks storage for (what
    SGLang's `timeout` budget counts); `tokens`, those storage holds from the first page,
    what is read. (0, 0): none would be issued."""

    asked: int
    tokens: int


NO_PREFETCH = StoragePrefetch(0, 0)


#: the file backend's eviction target: after an over-cap write it evicts least recently
#: used pages until `used + new <= cap x ratio` (`LRUFileEvictor._evict_locked`; default
#: `SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO` = 0.9)
FILE_EVICTION_RATIO = 0.9
#: the shared pool's: Mooncake's master evicts `eviction_ratio` (default 0.05) of the pool
#: when it runs full, so a put that does not fit evicts down to 95% (see `StorageTier`)
SHARED_EVICTION_RATIO = 0.95

#: SGLang's `prefetch_threshold` default (`parse_storage_backend_extra_config`): a storage
#: prefetch shorter than this is not issued, a hit shorter than this not fetched
DEFAULT_PREFETCH_THRESHOLD = 256


class StorageTier:
    """L3: pages keyed by their chained page key, with a capacity and a bandwidth each way.

    The store itself, not only its figures: one object is what replicas share when the
    backend is `shared` (`experiments/engine/cluster.py` `share_storage`). What SGLang
    0.5.23's backends do, per call (`mem_cache/hicache_storage.py`):

    - `hit_pages(keys)`: `batch_exists`, the longest run of `keys` present from the first;
      reads no recency (`HiCacheFile.exists` does not touch its LRU).
    - `read(keys)`: `batch_get`; the file backend refreshes each page's recency
      (`LRUFileEvictor.touch`), the shared pool too (a Mooncake get renews the object's
      lease).
    - `write(keys)`: `batch_set` page by page. A page already stored is skipped; the file
      backend refreshes its recency (`HiCacheFile.set` fast path), the shared pool does not
      (`MooncakeStore.batch_set_v1` filters existing keys before the put). A new page that
      does not fit evicts least recently used pages down to `eviction_ratio` of the
      capacity minus the page (`LRUFileEvictor.reserve` -> `_evict_locked`).

    Capacity 0 is unbounded (SGLang's file backend without `max_size`). The shared pool's
    eviction is an approximation: Mooncake's master (not part of SGLang's source) evicts
    objects by lease in batches of `eviction_ratio` when the pool is above a watermark;
    here it evicts by recency down to 95% when a put does not fit.
    """

    __slots__ = (
        "backend",
        "page_size",
        "figures",
        "eviction_ratio",
        "_pages",
        "written_pages",
        "read_pages",
        "evicted_pages",
        "skipped_pages",
    )

    def __init__(self, backend: str, page_size: int, figures: TierFigures, eviction_ratio: float) -> None:
        self.backend = backend
        self.page_size = page_size
        self.figures = figures  # capacity 0: unbounded
        self.eviction_ratio = eviction_ratio
        #: page key -> None, least recently used first
        self._pages: OrderedDict[BlockHash, None] = OrderedDict()
        self.written_pages = 0  # pages newly written
        self.read_pages = 0  # pages read back (prefetched into a host tier)
        self.evicted_pages = 0  # pages the capacity pushed out
        self.skipped_pages = 0  # writes of pages already stored

    @classmethod
    def build(
        cls,
        page_size: int,
        *,
        backend: str = "file",
        capacity_tokens: int = 0,
        capacity_gb: float = 0.0,
        read_gbps: float | None = None,
        write_gbps: float | None = None,
        kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN,
    ) -> StorageTier:
        """Check every figure and build the tier (`InvalidRequestError` naming the bad one,
        before any work). `backend`: `file` or `shared`. At most one of `capacity_tokens`
        and `capacity_gb`; neither (both 0) is unbounded; a capacity in GB becomes whole
        pages. A bandwidth of None is the backend's default (module docstring); zero, a
        negative or an infinite one is refused by name."""
        if backend not in STORAGE_BACKENDS:
            raise InvalidRequestError(
                f"unknown storage_backend {backend!r}; choose one of {', '.join(STORAGE_BACKENDS)}"
            )
        defaults = {"file": (FILE_READ_GBPS, FILE_WRITE_GBPS), "shared": (SHARED_READ_GBPS, SHARED_WRITE_GBPS)}[backend]
        figures = TierFigures.checked(
            "storage",
            page_size,
            capacity_tokens=capacity_tokens,
            capacity_gb=capacity_gb,
            read_gbps=defaults[0] if read_gbps is None else read_gbps,
            write_gbps=defaults[1] if write_gbps is None else write_gbps,
            kv_bytes_per_token=kv_bytes_per_token,
            absent=0,  # unbounded
        )
        ratio = FILE_EVICTION_RATIO if backend == "file" else SHARED_EVICTION_RATIO
        return cls(backend, page_size, figures, ratio)

    # -- figures ---------------------------------------------------------------------

    @property
    def shared(self) -> bool:
        """Whether every replica of a cluster uses this one pool."""
        return self.backend == "shared"

    @property
    def used_tokens(self) -> int:
        return len(self._pages) * self.page_size

    @property
    def capacity_tokens(self) -> int:
        return self.figures.capacity_tokens

    def bytes_of(self, tokens: int) -> int:
        """Bytes of KV in `tokens` tokens."""
        return self.figures.bytes_of(tokens)

    def transfer_seconds(self, tokens: int, *, write: bool) -> float:
        """Seconds to move `tokens` tokens of KV into storage (`write`) or out of it."""
        return self.figures.transfer_seconds(tokens, write=write)

    def same_figures(self, other: StorageTier) -> bool:
        """Whether `other` describes the same pool (what replicas sharing one must agree on)."""
        return (self.backend, self.page_size, self.figures) == (other.backend, other.page_size, other.figures)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._pages

    def keys(self) -> list[BlockHash]:
        """Every stored page's key, least recently used first (tests, invariants)."""
        return list(self._pages)

    # -- the backend's calls -----------------------------------------------------------

    def hit_pages(self, keys: list[BlockHash]) -> int:
        """`batch_exists`: how many of `keys`, from the first, are stored."""
        pages = self._pages
        for i, key in enumerate(keys):
            if key not in pages:
                return i
        return len(keys)

    def read(self, keys: list[BlockHash]) -> None:
        """`batch_get` of stored pages: each becomes the most recently used."""
        pages = self._pages
        for key in keys:
            pages.move_to_end(key)
        self.read_pages += len(keys)

    def write(self, keys: list[BlockHash]) -> int:
        """`batch_set` page by page; returns the pages newly written."""
        pages = self._pages
        refresh = self.backend == "file"
        new = 0
        for key in keys:
            if key in pages:
                self.skipped_pages += 1
                if refresh:
                    pages.move_to_end(key)
                continue
            self._make_room()
            pages[key] = None
            new += 1
        self.written_pages += new
        return new

    def _make_room(self) -> None:
        """Room for one more page: over the cap, evict least recently used pages until
        `used + page <= cap x ratio` (`LRUFileEvictor._evict_locked`, in bytes as there)."""
        cap = self.capacity_tokens
        if not cap:
            return
        per_token = self.figures.kv_bytes_per_token
        page = self.page_size * per_token
        pages = self._pages
        if (len(pages) + 1) * page <= cap * per_token:
            return
        target = max(0, int(cap * per_token * self.eviction_ratio) - page)
        while pages and len(pages) * page > target:
            pages.popitem(last=False)
            self.evicted_pages += 1

    def stats(self) -> dict[str, int]:
        """What the store did so far and holds now, in tokens and bytes."""
        ps = self.page_size
        return {
            "storage_written_tokens": self.written_pages * ps,
            "storage_read_tokens": self.read_pages * ps,
            "storage_evicted_tokens": self.evicted_pages * ps,
            "storage_skipped_tokens": self.skipped_pages * ps,
            "storage_tokens": self.used_tokens,
            "storage_capacity_tokens": self.capacity_tokens,
        }
