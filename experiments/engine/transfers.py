"""`TransferClock`: what moving KV between memory tiers costs on the serving clock.

The cache contract knows nothing of time: a tiered cache asked to `time_transfers` reports
each transfer it decides (`cachelib.tiers.TierTransfer`: from which tier to which, how many
tokens, for which request, and a ticket when it holds something until the copy is done),
and this object prices them with the cache's tier bandwidths (`tier_link_seconds`) on one
copy stream per direction (a PCIe link is full duplex: a load and a backup run at once;
two loads queue), and tells the cache which tickets completed (`finish_transfers`) at the
scheduler's polls, as SGLang's `check_hicache_events` and vLLM's connector output do.

How a load meets the forward pass is the reference's (`PrefixCache.load_timing`):

- `layerwise` (SGLang 0.5.23 HiCache): the loads admitted into a step are merged and copied
  layer by layer from the step's start, the forward waiting per layer: the step takes
  `cachelib.tiers.pipelined_step_seconds(C, T, L)` for compute C, load T, L layers; what it
  takes beyond C is *stall*, charged to each request that loaded in it (`load_stall_s`).
  Write-through backups run on the device-to-host stream from when they are issued, their
  node locked until the first poll after they complete. A write_back backup of an evicted
  node is waited for before the step starts (`writing_check(write_back=True)` blocks).
- `async` (vLLM 0.33 offloading connector): a request whose hit needs a load waits
  (WAITING_FOR_REMOTE_KVS) from the step it was admitted in until the load completes,
  then is scheduled (`VllmScheduler`); what it waited is its `load_wait_s`. A finished
  request whose stores are still in flight keeps its blocks until they complete (vLLM's
  `request_finished` -> `delay_free_blocks`).
- `blocking` (LMCache 0.3.x's vLLM v1 connector, `use_layerwise` off): `start_load_kv`
  retrieves every load of the step before the forward (a chunk found on disk is read disk ->
  host, then host -> GPU), and `wait_for_save` stores the step's chunks GPU -> host after it;
  the step is loads + compute + stores (`connector_step_seconds`). What the loads add is the
  step's `load_stall_s` (charged to each request that loaded in it), what the stores add its
  store stall (`store_stall_s`, the run's total). The host -> disk writes of a store run on the
  disk's stream from the store's end and hold nothing up (LocalDiskBackend's put tasks).
  The same cache with `lmcache_use_layerwise` is `layerwise` and priced by the same method:
  disk reads before the forward, then load, compute and store layer by layer
  (`cachelib.tiers.pipelined_store_step_seconds`).

Storage (L3, `radix-hicache` with a storage tier): a request's prefetch is read on the
storage -> host stream from its arrival and the scheduler applies SGLang's prefetch
policy before it schedules the request (`VllmScheduler.storage_prefetch_ready`:
`best_effort` takes the whole pages arrived, `wait_complete` waits for all, `timeout` up
to its deadline); a storage write starts at its backup's acknowledgement on the
host -> storage stream, its host copy locked until its ticket completes.

Under the replay protocol none of this runs: transfers complete at once.
"""

from __future__ import annotations

import heapq
from typing import Any

from cachelib.interface import PrefixCache
from cachelib.tiers import LOAD_TIMINGS, TierTransfer


class TransferClock:
    """One replica's copy streams between memory tiers (module docstring)."""

    def __init__(self, cache: PrefixCache, layers: int) -> None:
        if cache.load_timing not in LOAD_TIMINGS:
            raise ValueError(f"{cache.name}: load_timing {cache.load_timing!r} is none of {', '.join(LOAD_TIMINGS)}")
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be a positive int, got {layers!r}")
        self.cache = cache
        self.layers = layers
        self.layerwise = cache.load_timing == "layerwise"
        self.link_free: dict[tuple[str, str], float] = {}  # when each direction's stream is idle
        self._in_flight: list[tuple[float, int, int]] = []  # (completion, issue order, ticket)
        self._order = 0
        self.blocked_until = 0.0  # blocking transfers (write_back's backups at eviction) end
        #: per request: when its async load completes; when its stores complete
        self.load_ready: dict[str, float] = {}
        self.store_done: dict[str, float] = {}
        self.tokens_moved: dict[str, int] = {}  # "src_to_dst" -> tokens
        self.bytes_moved: dict[str, int] = {}
        self.stall_seconds = 0.0  # steps' time beyond their compute, waiting on loads
        self.blocked_seconds = 0.0  # scheduling held up by blocking backups
        #: LMCache's connector (`connector_step_seconds`): steps wait for loads and stores in them
        self.connector = cache.connector_steps
        self.store_stall_seconds = 0.0  # steps' time after their compute, waiting on stores
        cache.time_transfers()

    # -- issuing and completing -------------------------------------------------------

    def issue(self, t: TierTransfer, at: float) -> float:
        """Queue `t` on its direction's stream from `at`; returns when it completes."""
        link = (t.src, t.dst)
        start = max(at, self.link_free.get(link, 0.0))
        done = start + self.cache.tier_link_seconds(t.src, t.dst, t.tokens)
        self.link_free[link] = done
        name = f"{t.src}_to_{t.dst}"
        self.tokens_moved[name] = self.tokens_moved.get(name, 0) + t.tokens
        if t.ticket is not None:
            heapq.heappush(self._in_flight, (done, self._order, t.ticket))
            self._order += 1
        if t.blocking:
            self.blocked_until = max(self.blocked_until, done)
        if t.request_id is not None:
            book = self.load_ready if t.to_gpu else self.store_done
            book[t.request_id] = max(book.get(t.request_id, 0.0), done)
        return done

    def issue_all(self, at: float) -> list[TierTransfer]:
        """Take what the cache decided since the last call and issue every transfer that is
        not a load from `at` (a backup or store: its KV is written by then); returns the
        loads, which the caller places (`layerwise`: at its step's start)."""
        loads = []
        for t in self.cache.take_transfers():
            if t.to_gpu:
                loads.append(t)
            else:
                self.issue(t, at)
        return loads

    def poll(self, now: float) -> None:
        """The scheduler's poll (SGLang's `check_hicache_events`): tell the cache which of
        its tickets completed by `now`, in completion order."""
        done = []
        flight = self._in_flight
        while flight and flight[0][0] <= now:
            done.append(heapq.heappop(flight)[2])
        if done:
            self.cache.finish_transfers(done)

    def drain(self) -> None:
        """The run is over: every transfer decided or in flight completes (what it held is
        released). A completion may start another transfer (a storage write after its
        backup's acknowledgement): drained too."""
        while True:
            self.issue_all(max([0.0, *self.link_free.values()]))
            if not self._in_flight:
                break
            tickets = [entry[2] for entry in sorted(self._in_flight)]
            self._in_flight = []
            self.cache.finish_transfers(tickets)

    def after_blocking(self, start: float) -> float:
        """When a step that would start at `start` starts: after the blocking transfers
        (write_back's backups of evicted nodes, `writing_check(write_back=True)`); the wait
        counts as blocked time."""
        if self.blocked_until > start:
            self.blocked_seconds += self.blocked_until - start
            return self.blocked_until
        return start

    def load_done_at(self, request_id: str) -> float:
        """When the async load of `request_id` completes."""
        return self.load_ready[request_id]

    def forget_load(self, request_id: str) -> None:
        """`request_id`'s load is consumed (scheduled, or done inside its step): nothing waits on it."""
        self.load_ready.pop(request_id, None)

    def stores_done_at(self, request_id: str) -> float:
        """When the stores of a finished `request_id` complete (0.0: it has none); forgotten after."""
        return self.store_done.pop(request_id, 0.0)

    def cut_short(self, t: TierTransfer, done: float, moved: int, now: float) -> None:
        """Transfer `t`, issued to complete at `done`, ended at `now` after `moved` of its
        tokens (a storage prefetch terminated early): the rest is not moved, and its stream
        is free from now if nothing queued behind it."""
        name = f"{t.src}_to_{t.dst}"
        self.tokens_moved[name] -= t.tokens - moved
        link = (t.src, t.dst)
        if self.link_free.get(link) == done:
            self.link_free[link] = now

    def next_completion(self) -> float | None:
        """When the earliest ticket in flight completes (None: nothing in flight)."""
        return self._in_flight[0][0] if self._in_flight else None

    # -- layerwise steps ----------------------------------------------------------------

    def step_seconds(self, compute: float, loads: list[TierTransfer], start: float) -> tuple[float, float]:
        """(seconds, stall) of a step of `compute` seconds starting at `start` whose
        admissions loaded `loads` (merged into one layer-by-layer copy, SGLang's
        `start_loading`)."""
        from cachelib.tiers import pipelined_step_seconds

        if not loads:
            return compute, 0.0
        if not self.layerwise:  # `async`: loads started with their step, and it waits for none
            for t in loads:
                self.issue(t, start)
            return compute, 0.0
        done = start
        for t in loads:
            done = self.issue(t, start)
        seconds = pipelined_step_seconds(compute, done - start, self.layers)
        self.stall_seconds += seconds - compute
        return seconds, seconds - compute

    # -- LMCache's connector: loads before, stores after the forward -------------------

    def connector_step_seconds(
        self, compute: float, decided: list[TierTransfer], start: float
    ) -> tuple[float, float, float]:
        """(seconds, load stall, store stall) of a step of `compute` seconds starting at
        `start` under LMCache's connector, with `decided` the transfers its scheduling
        decided (module docstring): disk reads from `start`, host -> GPU loads once they are
        read, then the forward, then GPU -> host stores (`blocking`), or the last three layer
        by layer (`layerwise`); host -> disk writes start when the stores end."""
        from cachelib.tiers import pipelined_step_seconds, pipelined_store_step_seconds

        read_done = start
        for t in decided:
            if t.src == "storage" and t.dst == "host":
                read_done = max(read_done, self.issue(t, start))
        loads = [t for t in decided if t.to_gpu]
        stores = [t for t in decided if t.src == "gpu"]
        if not self.layerwise:
            load_done = read_done
            for t in loads:
                load_done = max(load_done, self.issue(t, read_done))
            compute_end = load_done + compute
            store_done = compute_end
            for t in stores:
                store_done = max(store_done, self.issue(t, compute_end))
            load_stall, store_stall = load_done - start, store_done - compute_end
        else:
            load_s = sum(self.cache.tier_link_seconds(t.src, t.dst, t.tokens) for t in loads)
            store_s = sum(self.cache.tier_link_seconds(t.src, t.dst, t.tokens) for t in stores)
            loaded = pipelined_step_seconds(compute, load_s, self.layers)
            both = pipelined_store_step_seconds(compute, load_s, store_s, self.layers)
            for t in loads:
                self.issue(t, read_done)
            store_done = read_done + both
            for t in stores:  # booked to end with the step (their stream's last use)
                self.issue(t, store_done - store_s)
            load_stall, store_stall = read_done - start + loaded - compute, both - loaded
        for t in decided:
            if t.src == "host" and t.dst == "storage":
                self.issue(t, store_done)
        self.stall_seconds += load_stall
        self.store_stall_seconds += store_stall
        return store_done - start, load_stall, store_stall

    # -- results ------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Tokens and bytes moved per direction, stall and blocked time, what timed them."""
        out: dict[str, Any] = {"load_timing": self.cache.load_timing, "layers": self.layers}
        for name, tokens in sorted(self.tokens_moved.items()):
            out[f"{name}_tokens"] = tokens
            out[f"{name}_bytes"] = self.cache.tier_bytes(tokens)
        out["load_stall_s"] = self.stall_seconds
        out["backup_blocked_s"] = self.blocked_seconds
        if self.connector:
            out["store_stall_s"] = self.store_stall_seconds
        return out
