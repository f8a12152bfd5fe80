"""The replay protocol (docs/design.md §6): sequential, exact, used to check fidelity.

Requests are taken in trace order with at most `concurrency` in flight, the oldest finishing
first. Per request: match -> admit the prompt (the cache evicts as its design does) ->
commit the prompt -> decode `output_len` tokens -> at finish, commit and release. Generated
tokens get ids `GENERATED_TOKEN_BASE + a global counter`, so no prompt ever matches them,
and the last generated token gets no KV (it is never fed back, as in vLLM). If admission
fails, the oldest in-flight request finishes and admission is retried; with nothing in
flight the request is unschedulable. A request's plan (`RequestSpec.sample_lens`,
`beam_parents`, `forced_output`) says what it forks and generates.

This module is only the driver: the requests, their state and every decision (admit,
decode, fork, finish the oldest for room) are a `Scheduler`'s, the same class the serving
driver steps (see `experiments/engine/scheduler.py`, "the replay protocol").

Only time spent inside cache calls is counted in `cache_seconds` (hashing is inside them), as
the thread's CPU time unless the client was given another clock (`cache_client.CPU_CLOCK`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from cachelib.interface import PrefixCache
from cachelib.tiers import TIER_NAMES
from experiments.engine.cache_client import CacheClient
from experiments.engine.clock import VirtualClock
from experiments.engine.executors import ReplayExecutor
from experiments.engine.request import ServingConfig
from experiments.engine.scheduler import Scheduler
from experiments.workloads.spec import RequestSpec


def replay(
    cache: PrefixCache | CacheClient,
    requests: Seq[RequestSpec],
    *,
    concurrency: int = 1,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the replay protocol of `requests` on `cache`; returns the result as a JSON-able dict.

    `per_request_hits[i]` is the hit of request i (-1 when it was unschedulable): every
    prompt token not recomputed, whichever memory tier it came from; a tiered cache
    (`memory_tiers` beyond the GPU) adds `per_request_hits_by_tier` ([gpu, host, storage]
    per request, host = tokens loaded back from the host tier, storage = those loaded back
    that came up from storage first), their totals and `tier_traffic`. A request
    with `n > 1` forks `n - 1` samples after its prompt (sample j decodes `sample_lens[j]`
    tokens); one with `beam_width > 1` follows its beam schedule (`beam_parents[t]`: the
    parent of each surviving beam at step t; a beam nobody picks is released, one picked k
    times forks k - 1 children). Either way the group is in flight, and finishes, as one.
    Pass a `CacheClient` to choose its clock.
    """
    client = cache if isinstance(cache, CacheClient) else CacheClient(cache)
    return Replay(client, concurrency).run(requests, progress=progress)


def unlimited_pages(requests: Seq[RequestSpec], page_size: int) -> int:
    """Enough pages that the replay never evicts: every request's pages, summed."""
    total = sum(-(-(spec.prompt_len + spec.output_len) // page_size) for spec in requests)
    return max(total, 1)


class Replay:
    """The replay driver: feeds requests in trace order to a `Scheduler` (whose running list
    is the in-flight queue, oldest first) and keeps the replay's counters."""

    def __init__(self, client: CacheClient, concurrency: int = 1) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.client = client
        self.concurrency = concurrency
        config = ServingConfig(max_running=concurrency)
        self.scheduler = Scheduler(client, ReplayExecutor(), config, VirtualClock())
        self.hits: list[int] = []
        #: per request [gpu, host, storage] tokens reused (only for a tiered cache)
        cache = client.cache  # a PrefixCache, or a test's reference model with the same calls
        self.tiers = isinstance(cache, PrefixCache) and len(cache.memory_tiers) > 1
        self.hits_by_tier: list[list[int]] = []
        self.prompt_tokens = self.hit_tokens = self.unschedulable = self.truncated = 0

    def run(self, requests: Seq[RequestSpec], *, progress: bool = False) -> dict[str, Any]:
        """Every request in trace order, then finish what is still in flight."""
        missing = [s.request_id for s in requests if s.beam_width > 1 and s.beam_parents is None]
        if missing:
            raise ValueError(f"beam search request {missing[0]!r} has no beam schedule (beam_parents)")
        bar = _progress_bar(len(requests), f"replay {self.client.cache.name}") if progress else None
        for spec in requests:
            self.add(spec)
            if bar is not None:
                bar.update(1)
        while self.scheduler.finish_oldest():
            pass
        if bar is not None:
            bar.close()
        return self.result(len(requests))

    def add(self, spec: RequestSpec) -> None:
        """One request: room for it in flight, its prompt admitted, its plan decoded."""
        scheduler = self.scheduler
        while len(scheduler.running) >= self.concurrency:
            scheduler.finish_oldest()
        r = scheduler.request(spec)
        if not scheduler.admit_prompt(r):
            self.unschedulable += 1
            self.hits.append(-1)
            if self.tiers:
                self.hits_by_tier.append([-1, -1, -1])
            return
        hit = r.hit_tokens
        self.hits.append(hit)
        if self.tiers:
            storage = self.client.cache.storage_hit_tokens(r.seq)  # of those loaded back, from L3
            self.hits_by_tier.append([hit - r.host_hit_tokens, r.host_hit_tokens - storage, storage])
        self.prompt_tokens += len(r.seq)
        self.hit_tokens += hit
        scheduler.run_to_completion(r)
        self.truncated += r.truncated

    def result(self, num_requests: int) -> dict[str, Any]:
        """The replay's outcome as a JSON-able dict."""
        cache = self.client.cache
        stats = cache.stats()
        seconds = self.client.seconds
        return {
            "backend": cache.name,
            "page_size": cache.page_size,
            "num_pages": cache.num_pages,
            "capacity_tokens": cache.num_pages * cache.page_size,
            "concurrency": self.concurrency,
            "requests": num_requests,
            "scheduled": num_requests - self.unschedulable,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "computed_prompt_tokens": self.prompt_tokens - self.hit_tokens,
            "hit_rate": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "evicted_pages": stats.evicted_pages,
            "unschedulable": self.unschedulable,
            "truncated": self.truncated,
            "cache_seconds": seconds,
            "us_per_request": seconds / num_requests * 1e6 if num_requests else 0.0,
            "metadata_bytes_end": stats.metadata_bytes,
            "per_request_hits": self.hits,
        } | (self.tier_result(cache) if self.tiers else {})

    def tier_result(self, cache: PrefixCache) -> dict[str, Any]:
        """What a tiered cache adds: hits per tier (GPU, host, storage: what came up from
        storage and was loaded back counts as storage, not host) per request and in total,
        and what moved between the tiers."""
        totals = [sum(h[i] for h in self.hits_by_tier if h[0] >= 0) for i in range(3)]
        return {
            "memory_tiers": list(cache.memory_tiers),
            "hit_tokens_by_tier": dict(zip(TIER_NAMES, totals, strict=True)),
            "tier_traffic": cache.tier_traffic(),
            "per_request_hits_by_tier": self.hits_by_tier,
        }


def _progress_bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    # disable=None: quiet when stderr is not a terminal (a log file, CI, a pipe), as the bar
    # would write a line per refresh there
    return tqdm(total=total, desc=desc, unit="req", leave=False, mininterval=0.5, disable=None)
