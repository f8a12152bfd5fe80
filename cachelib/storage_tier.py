"""L3 as a local disk below a backend's host tier (docs/design.md §7): its capacity and how fast
it moves KV. Used by `apc-lmcache` (LMCache's `LocalDiskBackend`, backends/apc_lmcache.py).

A tier never knows about tensors: it is a capacity in tokens, a read / write bandwidth, and
the bytes one token of KV takes (to turn a capacity in GB into tokens and tokens moved into
bytes), as `cachelib.tiers.HostTier` is for host memory.

Bandwidth defaults (`NVME_READ_GBPS`, `NVME_WRITE_GBPS`): one enterprise PCIe Gen4 x4 NVMe SSD
of the kind DGX-class H100 / H200 systems carry as local data drives, at its datasheet
sequential figures: Samsung PM1733 (U.2), "sequential read up to 7,000 MB/s, sequential write
up to 3,800 MB/s" (Samsung PM1733 product brief). These are recalled from the datasheet and
could not be re-checked here (no network); they are the ceiling of one drive, not a RAID of
several, and what LMCache reaches through files and a thread pool is lower: pass a measured
figure (`disk_read_gbps`, `disk_write_gbps`). Under the replay protocol transfers are
instantaneous and the bandwidths are not read.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachelib.errors import InvalidRequestError
from cachelib.tiers import FILE_READ_GBPS, FILE_WRITE_GBPS, LLAMA3_8B_KV_BYTES_PER_TOKEN

#: GB/s disk -> host (a read) and host -> disk (a write): Samsung PM1733's datasheet sequential
#: figures, the same drive radix-hicache's `file` storage defaults to (one source of the figures)
NVME_READ_GBPS = FILE_READ_GBPS
NVME_WRITE_GBPS = FILE_WRITE_GBPS


def _positive_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidRequestError(f"{name} must be a positive bandwidth in GB/s, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DiskTier:
    """L3: a local disk. `capacity_tokens` (a whole number of pages), `read_gbps` (disk ->
    host, a promotion or a load), `write_gbps` (host -> disk, a store), `kv_bytes_per_token`."""

    capacity_tokens: int
    read_gbps: float = NVME_READ_GBPS
    write_gbps: float = NVME_WRITE_GBPS
    kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN

    @classmethod
    def build(
        cls,
        page_size: int,
        *,
        capacity_tokens: int = 0,
        capacity_gb: float = 0.0,
        read_gbps: float = NVME_READ_GBPS,
        write_gbps: float = NVME_WRITE_GBPS,
        kv_bytes_per_token: int = LLAMA3_8B_KV_BYTES_PER_TOKEN,
    ) -> DiskTier:
        """Check every figure and build the tier (`InvalidRequestError` naming the bad one,
        before any work). Exactly one of `disk_capacity_tokens` and `disk_capacity_gb` is
        given (a disk has no default size); a capacity in GB (10**9 bytes) becomes whole
        pages of `kv_bytes_per_token`-byte tokens."""
        if isinstance(kv_bytes_per_token, bool) or not isinstance(kv_bytes_per_token, int) or kv_bytes_per_token <= 0:
            raise InvalidRequestError(f"kv_bytes_per_token must be a positive int, got {kv_bytes_per_token!r}")
        read = _positive_number("disk_read_gbps", read_gbps)
        write = _positive_number("disk_write_gbps", write_gbps)
        if isinstance(capacity_tokens, bool) or not isinstance(capacity_tokens, int) or capacity_tokens < 0:
            raise InvalidRequestError(f"disk_capacity_tokens must be a positive int, got {capacity_tokens!r}")
        if isinstance(capacity_gb, bool) or not isinstance(capacity_gb, (int, float)) or capacity_gb < 0:
            raise InvalidRequestError(f"disk_capacity_gb must be a positive number, got {capacity_gb!r}")
        if capacity_tokens and capacity_gb:
            raise InvalidRequestError(
                "give a disk tier's size once: disk_capacity_tokens or disk_capacity_gb "
                f"(got {capacity_tokens!r} tokens and {capacity_gb!r} GB)"
            )
        if not capacity_tokens and not capacity_gb:
            raise InvalidRequestError("a disk tier needs disk_capacity_tokens or disk_capacity_gb")
        if capacity_gb:
            tokens = int(capacity_gb * 1e9) // kv_bytes_per_token // page_size * page_size
            what = f"disk_capacity_gb={capacity_gb} ({tokens} tokens of {kv_bytes_per_token} bytes)"
        else:
            if capacity_tokens % page_size:
                raise InvalidRequestError(
                    f"disk_capacity_tokens={capacity_tokens} is not a whole number of {page_size}-token pages"
                )
            tokens, what = capacity_tokens, f"disk_capacity_tokens={capacity_tokens}"
        if tokens < page_size:
            raise InvalidRequestError(f"a disk tier smaller than one page of {page_size} tokens: {what}")
        return cls(int(tokens), read, write, kv_bytes_per_token)

    def bytes_of(self, tokens: int) -> int:
        """Bytes of KV in `tokens` tokens."""
        return tokens * self.kv_bytes_per_token

    def transfer_seconds(self, tokens: int, *, to_disk: bool) -> float:
        """Seconds to move `tokens` tokens of KV one way at this tier's bandwidth (what a
        serving clock will charge; the replay protocol charges nothing)."""
        gbps = self.write_gbps if to_disk else self.read_gbps
        return self.bytes_of(tokens) / (gbps * 1e9)
