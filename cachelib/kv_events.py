"""KV events: what a cache tells an observer about the pages it publishes, as it happens.

The shape is vLLM's (`vllm/distributed/kv_events.py`, vLLM 0.33): a `BlockStored` when full
blocks are hashed into the prefix cache (`BlockPool.cache_full_blocks`), a `BlockRemoved`
when a cached block is evicted (`BlockPool._maybe_evict_cached_block`). SGLang 0.5.23
publishes the same two events from its radix tree (`mem_cache/events.py`,
`KVCacheEventRecorder.record_store` for a new node, `record_remove` for an evicted one), one
key per page, chained over the prefix. KV-aware routers (llm-d's kv-cache indexer, Dynamo's
`KvIndexer`) rebuild each replica's cache from these events alone.

Here an event names pages by their *page keys*: bytes that identify a full page together
with the whole prefix before it (the token ids and the extra keys that change the KV), so
equal keys mean equal KV. Each emitting backend says how it computes them (`PageKeys`),
and a router computes a request's keys the same way to ask "which of these pages does
replica i hold?".

Events are per page, not per key: apc may hold two blocks with one hash (a block
recomputed while an equal one is cached: vLLM keeps both, and emits a `BlockStored` for
each and a `BlockRemoved` for each). A listener that wants the set of keys a cache holds
counts them (a multiset); one that keeps a plain set, as llm-d's index does, loses a key
while its duplicate is still cached.

Each event names its *medium*, the tier the pages are stored on or removed from (vLLM
0.33's `BlockStored.medium` / `BlockRemoved.medium`, `MEDIUM_GPU` = "GPU", `MEDIUM_CPU` =
"CPU"; SGLang 0.5.23's `StorageMedium`, `GPU` = "GPU", `CPU` = "CPU_PINNED"). A GPU-only
cache publishes "GPU" events alone. A tiered one publishes its host tier too, as its
reference does: radix-hicache as SGLang's HiCache (`unified_tree_core.py`: "CPU_PINNED"
stores at a backup's ack and a storage prefetch's `insert_host`, removals at host
eviction and duplicate reclaim; "GPU" stores at creation, re-insertion and load-back,
removals at device eviction), apc with a host tier as vLLM's offloading connector
(`kv_offload/cpu/manager.py`: "CPU" stores at `complete_store`, removals at
`prepare_store`'s eviction). Neither reference publishes its storage tier (L3) writes.
A page on two tiers is two entries: a listener that wants one tier's content keeps the
events of that medium (`KvIndex` keeps the device's, `DEVICE_MEDIUM`: the routers here
score what a request would find on the GPU; llm-d's indexer also records the tier of each
entry, whose use in scoring is not modelled).

Not modelled: vLLM's `AllBlocksCleared` (the contract has no reset), token ids, LoRA
names and the other metadata of vLLM's events (the keys already fold in what changes the
KV), and the batching of events per engine step (a listener hears each event at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cachelib.hashing import BlockHash, BlockHasher, HashFn
from cachelib.types import ExtraKeys

#: the device tier's medium (vLLM's `MEDIUM_GPU`, SGLang's `StorageMedium.GPU`)
DEVICE_MEDIUM = "GPU"
#: vLLM 0.33's host medium (`MEDIUM_CPU`)
VLLM_CPU_MEDIUM = "CPU"
#: SGLang 0.5.23's host medium (`StorageMedium.CPU`, L2 pinned host memory)
SGLANG_CPU_MEDIUM = "CPU_PINNED"


@dataclass(frozen=True, slots=True)
class PagesStored:
    """vLLM's `BlockStored`: full pages published, in prefix order. `keys[i]` is the key of
    one page; `parent` the key of the page just before the first (None: the first page of
    its prefix), as vLLM's `parent_block_hash`; `medium` the tier they are stored on."""

    keys: list[BlockHash]
    parent: BlockHash | None
    medium: str = DEVICE_MEDIUM


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """vLLM's `BlockRemoved`: published pages evicted (one key per page) from `medium`."""

    keys: list[BlockHash]
    medium: str = DEVICE_MEDIUM


KvEvent = PagesStored | PagesRemoved


class KvEventListener(Protocol):
    """What `PrefixCache.subscribe` takes: called synchronously, inside the cache call
    that published or evicted the pages."""

    def on_kv_event(self, event: KvEvent) -> None: ...


class KvEventFanout:
    """Several listeners behind one (the cache keeps a single slot, so its hot path tests
    one attribute against None whatever the number of listeners)."""

    __slots__ = ("listeners",)

    def __init__(self, *listeners: KvEventListener) -> None:
        self.listeners = listeners

    def on_kv_event(self, event: KvEvent) -> None:
        for listener in self.listeners:
            listener.on_kv_event(event)


@dataclass(frozen=True)
class PageKeys:
    """How a backend names its pages in events: chained hashes of full pages,
    `H_i = hash(H_{i-1} || tokens of page i || extra keys)` (cachelib/hashing.py), so a key
    identifies the page and the whole prefix before it.

    `algorithm` and `hash_fn` are the backend's (as `BlockHasher` takes them); `namespace_only` folds in
    only the extra keys that the backend keeps requests apart by (radix: `cache_salt` and
    `lora_id`, its tree namespace; multimodal spans are not part of radix's key), where apc
    folds in all of them as vLLM does. Two caches whose `PageKeys` compare equal name the
    same page with the same key, so a router computes a request's keys once for both.
    """

    page_size: int
    algorithm: str = "xxh3_128"
    hash_fn: HashFn | None = None
    namespace_only: bool = False

    def hasher(self) -> BlockHasher:
        return BlockHasher(self.page_size, self.algorithm, self.hash_fn)

    def extra(self, extra: ExtraKeys) -> ExtraKeys:
        """The extra keys that enter the key."""
        if self.namespace_only and extra.mm:
            return ExtraKeys(extra.cache_salt, extra.lora_id)
        return extra

    def keys(self, tokens: np.ndarray, extra: ExtraKeys, num_pages: int | None = None) -> list[BlockHash]:
        """The keys of the first `num_pages` full pages of `tokens` (default: every full
        page) under `extra`: what the backend's events name those pages."""
        n = len(tokens) // self.page_size if num_pages is None else num_pages
        if n <= 0:
            return []
        return _hasher(self).hash_blocks(tokens, self.extra(extra), 0, n, None)


_HASHERS: dict[PageKeys, BlockHasher] = {}


def _hasher(keys: PageKeys) -> BlockHasher:
    """One `BlockHasher` per scheme (a router asks for keys on every decision)."""
    hasher = _HASHERS.get(keys)
    if hasher is None:
        hasher = _HASHERS[keys] = keys.hasher()
    return hasher
