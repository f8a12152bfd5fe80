"""Per-layer paged KV tensors in FlashInfer's NHD layout, the only place KV is stored.

Each layer owns one tensor `[num_pages, 2, page_size, num_kv_heads, head_dim]` (index 0 of
dim 1 is K, 1 is V), exactly what `BatchPrefillWithPagedKVCacheWrapper.run` and the
decode wrapper read with `kv_layout="NHD"`. The cache contract hands out page ids and
`CopyOp`s; this class moves the bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from attention.metadata import BatchMeta, PageTableError, ShapeMismatchError


class PagedKVCache:
    """KV storage for `num_layers` layers over one pool of `num_pages` pages."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ShapeMismatchError(f"{name} must be a positive int, got {value!r}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # zeros, not empty: a page read before it is written must be deterministic garbage
        self.layers: list[torch.Tensor] = [
            torch.zeros(num_pages, 2, page_size, num_kv_heads, head_dim, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]
        #: host memory of a tiered cache: host page -> that page's KV in every layer
        self.host: dict[int, list[torch.Tensor]] = {}
        #: storage pages by page key (`StorageCopy`), created when first written
        self.storage: dict[bytes, list[torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        """Scatter new K/V `[total_q, num_kv_heads, head_dim]` into `meta`'s (page, slot)s."""
        want = (meta.num_q_tokens, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want:
                raise ShapeMismatchError(f"{name} has shape {tuple(t.shape)}, the KV cache expects {want}")
        if meta.page_size != self.page_size:
            raise ShapeMismatchError(f"batch uses page size {meta.page_size}, the KV cache has {self.page_size}")
        kv = self.layers[layer]
        kv[meta.write_pages, 0, meta.write_slots] = k.to(self.dtype)
        kv[meta.write_pages, 1, meta.write_slots] = v.to(self.dtype)

    def apply(self, copy_ops: Iterable[tuple] | None) -> int:
        """Do the cache's copy-on-write requests (`CopyOp(src_page, dst_page)`) in every
        layer, and a tiered cache's moves to and from host memory (`TierCopy`), in order.

        Consecutive copies read every source before writing any destination, so they are
        independent of their order among themselves; a `TierCopy` is done where it stands
        (a page backed up may be reloaded with other KV later in the list). The host pages
        are kept here, created when first written. Returns the number of pages copied.
        """
        ops = list(copy_ops or ())
        if not ops:
            return 0
        # TierCopy(to_host, device_pages, host_pages), StorageCopy(to_storage, host_pages, keys, tokens)
        if any(len(op) > 2 for op in ops):
            done, run = 0, []
            for op in [*ops, None]:
                if op is not None and len(op) == 2:
                    run.append(op)
                    continue
                done += self._copy(run)
                run = []
                if op is not None and len(op) == 4:
                    self._storage_move(*op)
                elif op is not None:
                    self._move(*op)
            return done
        return self._copy(ops)

    def _storage_move(
        self, to_storage: bool, host_pages: tuple[int, ...], keys: tuple[bytes, ...], tokens: int
    ) -> None:
        """Host pages to and from a storage tier, by page key (`StorageCopy`). The store is
        kept here, every page ever written: equal keys name equal KV, so what a cache's
        storage evicted is simply never read again. A pool shared by a cluster's replicas
        is one store per executor here: a page another replica wrote is refused loudly."""
        if len(host_pages) != len(keys):
            raise PageTableError(f"a storage move pairs {len(host_pages)} host pages with {len(keys)} keys")
        for host_page, key in zip(host_pages, keys, strict=True):
            if to_storage:
                saved = self.host.get(int(host_page))
                if saved is None:
                    raise PageTableError(f"a storage write reads host page {host_page}, which was never written")
                self.storage[key] = saved
            else:
                saved = self.storage.get(key)
                if saved is None:
                    raise PageTableError(f"a prefetch reads storage page {key.hex()}, which was never written")
                self.host[int(host_page)] = saved

    def _move(self, to_host: bool, device_pages: tuple[int, ...], host_pages: tuple[int, ...]) -> None:
        """Pages between the GPU pool and host memory (`device_pages[i]` <-> `host_pages[i]`),
        every layer."""
        if len(device_pages) != len(host_pages):
            raise PageTableError(f"a tier move pairs {len(device_pages)} GPU pages with {len(host_pages)} host pages")
        for device_page, host_page in zip(device_pages, host_pages, strict=True):
            if not 0 <= int(device_page) < self.num_pages:
                raise PageTableError(f"a tier move names page {device_page} outside the pool [0, {self.num_pages})")
            if to_host:
                self.host[int(host_page)] = [kv[int(device_page)].clone() for kv in self.layers]
            else:
                saved = self.host.get(int(host_page))
                if saved is None:
                    raise PageTableError(f"a load-back reads host page {host_page}, which was never written")
                for kv, page in zip(self.layers, saved, strict=True):
                    kv[int(device_page)] = page

    def _copy(self, ops: list) -> int:
        if not ops:
            return 0
        src = [int(op[0]) for op in ops]
        dst = [int(op[1]) for op in ops]
        for p in src + dst:
            if not 0 <= p < self.num_pages:
                raise PageTableError(f"copy names page {p} outside the pool [0, {self.num_pages})")
        if len(set(dst)) != len(dst):
            raise PageTableError(f"copies write the same destination page twice: {dst}")
        src_t = torch.tensor(src, dtype=torch.int64, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=self.device)
        for kv in self.layers:
            kv[dst_t] = kv[src_t]  # advanced indexing gathers a copy first
        return len(ops)

    def gather(self, layer: int, pages: Iterable[int], kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V `[kv_len, num_kv_heads, head_dim]` of one sequence (tests, debugging)."""
        idx = torch.tensor(list(pages), dtype=torch.int64, device=self.device)
        block = self.layers[layer][idx]  # (n_pages, 2, S, H, D)
        k = block[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len]
        v = block[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:kv_len]
        return k, v
