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

from cachelib.tiers import FILE_READ_GBPS, FILE_WRITE_GBPS, LLAMA3_8B_KV_BYTES_PER_TOKEN, TierFigures

#: GB/s disk -> host (a read) and host -> disk (a write): Samsung PM1733's datasheet sequential
#: figures, the same drive radix-hicache's `file` storage defaults to (one source of the figures)
NVME_READ_GBPS = FILE_READ_GBPS
NVME_WRITE_GBPS = FILE_WRITE_GBPS


@dataclass(frozen=True)
class DiskTier(TierFigures):
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
        return cls.checked(  # type: ignore[return-value]
            "disk",
            page_size,
            capacity_tokens=capacity_tokens,
            capacity_gb=capacity_gb,
            read_gbps=read_gbps,
            write_gbps=write_gbps,
            kv_bytes_per_token=kv_bytes_per_token,
            absent=None,  # a disk has no default size
        )
