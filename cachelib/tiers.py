"""Memory tiers below a backend's GPU pages (docs/design.md §7): what each tier holds and how fast
it moves KV.

L1 is the backend's own GPU pages (`num_pages` x `page_size`, unchanged). Below it:

- L2, host memory (`HostTier`): a capacity in tokens and a read / write bandwidth. Built:
  the `radix-hicache` backend (`backends/radix_hicache.py`, SGLang 0.5.23 HiCache) keeps
  host copies in it.
- L3, storage (local disk, or a pool shared by a cluster's replicas): declared here as a
  name in `TIER_NAMES` so metrics carry its column from the start, *not built yet*: no
  backend accepts one, and every storage figure reads 0.

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
"""

from __future__ import annotations

from dataclasses import dataclass

from cachelib.errors import InvalidRequestError

#: the tiers metrics report, in order (`per_request_hits_by_tier` columns)
TIER_NAMES = ("gpu", "host", "storage")

#: GB/s host -> GPU and GPU -> host: PCIe Gen5 x16, 128 GB/s bidirectional (H200 datasheet)
H200_HOST_READ_GBPS = 64.0
H200_HOST_WRITE_GBPS = 64.0

#: host size when none is given: SGLang's default `--hicache-ratio` (host = 2 x device;
#: `srt/arg_groups/hicache_hook.py` `handle_hicache_ratio_default`)
DEFAULT_HOST_RATIO = 2

#: bytes of KV per token of Llama-3-8B (the project's default model, experiments/defaults.py)
#: in bf16: 2 (K and V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes; used only to
#: turn a capacity in GB into tokens and tokens moved into bytes
LLAMA3_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2


@dataclass(frozen=True)
class HostTier:
    """L2: host memory below the GPU pages.

    `capacity_tokens` (a whole number of pages), `read_gbps` (host -> GPU, a load-back),
    `write_gbps` (GPU -> host, a backup), `kv_bytes_per_token` (for bytes moved)."""

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
        if isinstance(kv_bytes_per_token, bool) or not isinstance(kv_bytes_per_token, int) or kv_bytes_per_token <= 0:
            raise InvalidRequestError(f"kv_bytes_per_token must be a positive int, got {kv_bytes_per_token!r}")
        for name, value in (("host_read_gbps", read_gbps), ("host_write_gbps", write_gbps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidRequestError(f"{name} must be a positive bandwidth in GB/s, got {value!r}")
        tokens_given = not (
            isinstance(capacity_tokens, int) and not isinstance(capacity_tokens, bool) and capacity_tokens == 0
        )
        gb_given = capacity_gb != 0
        if tokens_given and gb_given:
            raise InvalidRequestError(
                "give a host tier's size once: host_capacity_tokens or host_capacity_gb "
                f"(got {capacity_tokens!r} tokens and {capacity_gb!r} GB)"
            )
        if not tokens_given and not gb_given:
            capacity_tokens = DEFAULT_HOST_RATIO * gpu_tokens
            what = f"{DEFAULT_HOST_RATIO} x the GPU's {gpu_tokens} tokens"
        elif gb_given:
            if isinstance(capacity_gb, bool) or not isinstance(capacity_gb, (int, float)) or not capacity_gb > 0:
                raise InvalidRequestError(f"host_capacity_gb must be a positive number, got {capacity_gb!r}")
            capacity_tokens = int(capacity_gb * 1e9) // kv_bytes_per_token // page_size * page_size
            what = f"host_capacity_gb={capacity_gb} ({capacity_tokens} tokens of {kv_bytes_per_token} bytes)"
        else:
            if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens < 0:
                raise InvalidRequestError(f"host_capacity_tokens must be a positive int, got {capacity_tokens!r}")
            if 0 < capacity_tokens < page_size:
                raise InvalidRequestError(
                    f"a host tier smaller than one page: host_capacity_tokens={capacity_tokens} < page_size {page_size}"
                )
            if capacity_tokens % page_size:
                raise InvalidRequestError(
                    f"host_capacity_tokens={capacity_tokens} is not a whole number of {page_size}-token pages"
                )
            what = f"host_capacity_tokens={capacity_tokens}"
        if capacity_tokens < page_size:
            raise InvalidRequestError(f"a host tier smaller than one page of {page_size} tokens: {what}")
        return cls(int(capacity_tokens), float(read_gbps), float(write_gbps), kv_bytes_per_token)

    def bytes_of(self, tokens: int) -> int:
        """Bytes of KV in `tokens` tokens."""
        return tokens * self.kv_bytes_per_token

    def transfer_seconds(self, tokens: int, *, to_host: bool) -> float:
        """Seconds to move `tokens` tokens of KV one way at this tier's bandwidth (what a
        serving clock will charge; the replay protocol charges nothing)."""
        gbps = self.write_gbps if to_host else self.read_gbps
        return self.bytes_of(tokens) / (gbps * 1e9)


#: the way a tier's loads meet the forward pass (a backend's `PrefixCache.load_timing`):
#: `layerwise` -- SGLang 0.5.23 HiCache: the step's load-backs are copied layer by layer on
#: their own stream while the prefill runs, each layer's attention waiting for its layer
#: (`pipelined_step_seconds`); `async` -- vLLM 0.33's offloading connector: a request whose
#: hit needs a load waits (WAITING_FOR_REMOTE_KVS) until the load completes, then is scheduled
LOAD_TIMINGS = ("layerwise", "async")


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
