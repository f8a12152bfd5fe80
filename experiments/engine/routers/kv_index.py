"""`KvIndex`: each replica's cached pages, rebuilt from its KV events alone, and the longest
cached prefix of a request on each replica. The index behind `precise` (llm-d's kv-cache
indexer, `llm-d-kv-cache` `kvblock.Index` fed by `kvevents.Pool`) and `kv_cost` (Dynamo's
`KvIndexer`, a radix tree of blocks tagged with worker ids, fed by the workers' events).

Per replica a count per page key: a "pages stored" adds one per key, a "pages removed"
takes one off, and a key is cached while its count is positive. Counting, not a set, keeps
it exact when a cache holds two pages under one key (apc's duplicates, which vLLM stores
and removes one by one): llm-d's index keeps a set of pods per key and would drop the key at
the first removal. So the index is the replica's cache, exactly, at every event
(tests/test_kv_events.py proves the events say so). A tiered cache's host-tier events
(another `medium`) are skipped: the index is each replica's GPU.

A request's page keys are computed as the replica's backend computes them
(`PrefixCache.page_keys`, handed over when the router is subscribed): llm-d's token
processor and Dynamo's router both hash the prompt into block keys the way vLLM does, for
the same reason. Replicas whose schemes are equal share one computation per request.
"""

from __future__ import annotations

from collections import Counter
from itertools import takewhile

from cachelib.kv_events import DEVICE_MEDIUM, KvEvent, PageKeys, PagesStored
from experiments.engine.routers.base import Router
from experiments.workloads.spec import RequestSpec


class KvIndex:
    """What each of `num_replicas` caches holds, by page key (see the module docstring)."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.pages: list[Counter[bytes]] = [Counter() for _ in range(num_replicas)]
        #: pages held per replica (Dynamo's tree size, its tie-breaker)
        self.sizes = [0] * num_replicas
        self.schemes: list[PageKeys | None] = [None] * num_replicas

    def watch(self, replica: int, scheme: PageKeys) -> None:
        """`replica`'s events name pages by `scheme`."""
        self.schemes[replica] = scheme

    def apply(self, replica: int, event: KvEvent) -> None:
        """One event of `replica`'s cache. A removal of a key never stored is a broken event
        stream: it raises (KeyError) instead of being ignored. Only the device's events
        count (`DEVICE_MEDIUM`): the index is what a request would find on the GPU, and a
        tiered cache's host pages are not (cachelib/kv_events.py)."""
        if event.medium != DEVICE_MEDIUM:
            return
        pages = self.pages[replica]
        if event.__class__ is PagesStored:
            pages.update(event.keys)  # counted in one C loop
            self.sizes[replica] += len(event.keys)
            return
        pop = pages.pop  # dict.pop: a missing key raises, where Counter's [] would say 0
        for key in event.keys:
            left = pop(key) - 1
            if left:
                pages[key] = left
        self.sizes[replica] -= len(event.keys)

    def overlaps(self, request: RequestSpec) -> tuple[list[int], int]:
        """(per replica, how many of the request's full pages are cached there consecutively
        from the first; how many full pages the prompt has)."""
        if None in self.schemes:
            raise RuntimeError("KvIndex.overlaps before every replica was subscribed (watch)")
        prompt = request.prompt
        keys_of: dict[PageKeys, list[bytes]] = {}
        matched = []
        total = 0
        for replica, scheme in enumerate(self.schemes):
            keys = keys_of.get(scheme)
            if keys is None:
                keys = keys_of[scheme] = scheme.keys(prompt, request.extra)
                total = len(keys)
            matched.append(len(list(takewhile(self.pages[replica].__contains__, keys))))
        return matched, total


class EventIndexRouter(Router):
    """A router that keeps every replica's exact cache state, rebuilt from its KV events
    (`index`: a `KvIndex`); `precise` and `kv_cost` score against it."""

    subscribes_kv_events = True

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self.index = KvIndex(num_replicas)

    def on_kv_subscribed(self, replica: int, page_keys: PageKeys) -> None:
        self.index.watch(replica, page_keys)

    def on_kv_event(self, replica: int, event: KvEvent) -> None:
        self.index.apply(replica, event)
