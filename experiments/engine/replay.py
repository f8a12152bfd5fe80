"""The replay protocol (docs/design.md §6): sequential, exact, used to check fidelity.

Requests are taken in trace order with at most `concurrency` in flight, the oldest finishing
first. Per request: match -> admit the prompt (the cache evicts as its design does) ->
commit the prompt -> decode `output_len` tokens -> at finish, commit and release. Generated
tokens get ids `GENERATED_TOKEN_BASE + a global counter`, so no prompt ever matches them,
and the last generated token gets no KV (it is never fed back, as in vLLM). If admission
fails, the oldest in-flight request finishes and admission is retried; with nothing in
flight the request is unschedulable. A request's plan (`RequestSpec.sample_lens`,
`beam_parents`, `forced_output`) says what it forks and generates.

This is a driver of its own over a `CacheClient`, not a mode of a serving policy: no clock,
no token budget, no steps. Memory pressure has one answer here, `finish_oldest` (serving's
is its policy's preemption); a request that cannot fit even alone is unschedulable, a
sample that cannot fork is dropped, a decode or a beam search that cannot grow stops early
(`truncated`).

Only time spent inside cache calls is counted in `cache_seconds` (hashing is inside them), as
the thread's CPU time unless the client was given another clock (`cache_client.CPU_CLOCK`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import Any, NamedTuple

import numpy as np

from cachelib.interface import PrefixCache
from cachelib.tiers import TIER_NAMES
from cachelib.types import Sequence
from experiments.engine.cache_client import CacheClient
from experiments.engine.executors import FreshTokens
from experiments.engine.request import new_sequence
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


class PromptHit(NamedTuple):
    """What a request's prompt reused at admission: every token not recomputed, those
    loaded back from below the GPU, and of those the ones that came up from storage."""

    tokens: int
    loaded: int
    storage: int


class Replay:
    """The replay driver: requests in trace order, each run to completion at admission; the
    in-flight queue (oldest first) holds what each request releases when it finishes."""

    def __init__(self, client: CacheClient, concurrency: int = 1) -> None:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
        self.client = client
        self.concurrency = concurrency
        self.tokens = FreshTokens()
        self.in_flight: deque[list[Sequence]] = deque()
        self.hits: list[int] = []
        cache = client.cache  # a PrefixCache, or a test's reference model with the same calls
        self.tiers = isinstance(cache, PrefixCache) and len(cache.memory_tiers) > 1
        #: per request [gpu, host, storage] tokens reused (only for a tiered cache)
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
        while self.finish_oldest():
            pass
        if bar is not None:
            bar.close()
        return self.result(len(requests))

    def add(self, spec: RequestSpec) -> None:
        """One request: room for it in flight, its prompt admitted, its plan decoded."""
        while len(self.in_flight) >= self.concurrency:
            self.finish_oldest()
        seq = new_sequence(spec)
        hit = self.admit_prompt(seq)
        if hit is None:
            self.unschedulable += 1
            self.hits.append(-1)
            if self.tiers:
                self.hits_by_tier.append([-1, -1, -1])
            return
        self.hits.append(hit.tokens)
        if self.tiers:
            self.hits_by_tier.append([hit.tokens - hit.loaded, hit.loaded - hit.storage, hit.storage])
        self.prompt_tokens += len(seq)
        self.hit_tokens += hit.tokens
        group = self.run_beams(spec, seq) if spec.beam_width > 1 else self.run_samples(spec, seq)
        if group is not None:
            self.in_flight.append(group)

    # -- decisions ---------------------------------------------------------------------

    def finish_oldest(self) -> bool:
        """Replay's answer to memory pressure: the oldest request in flight finishes, its pages
        become evictable; False when nothing is in flight."""
        if not self.in_flight:
            return False
        self.release_all(self.in_flight.popleft())
        return True

    def admit_prompt(self, seq: Sequence) -> PromptHit | None:
        """Match and admit `seq`'s whole prompt and commit it (replay prefills at once),
        finishing the oldest for room; None when it does not fit even with nothing in flight."""
        client = self.client
        while True:
            # match, admit and commit (one timed region); `hit`: the match, plus what a
            # tiered cache loaded back in admit
            m, ops, hit = client.prefill(seq)
            if ops is not None:
                break
            if not self.finish_oldest():
                return None
        loaded = hit - m.num_tokens
        storage = client.cache.storage_hit_tokens(seq) if self.tiers else 0  # of those loaded back, from L3
        return PromptHit(hit, loaded, storage)

    # -- a request's plan -------------------------------------------------------------------

    def run_samples(self, spec: RequestSpec, seq: Sequence) -> list[Sequence]:
        """Fork the `n - 1` samples, decode each, then the request itself; returns the
        request and the samples that forked (what it releases when it finishes)."""
        lens = spec.output_lens
        group = [seq]
        for j in range(1, spec.n):
            child = seq.fork(f"{spec.request_id}/{j}")
            if not self.fork_for_room(seq, child):
                self.truncated += 1  # no room even for this sample: it is dropped
                continue
            group.append(child)
            # Even alone a sample that cannot hold its output stops early.
            self.truncated += not self.decode_all(child, lens[j])
        self.truncated += not self.decode_all(seq, lens[0], spec.forced_output)
        return group

    def decode_all(self, seq: Sequence, output_len: int, forced: np.ndarray | None = None) -> bool:
        """Append `output_len` tokens (`forced` ones first, then fresh ids) and give all but
        the last KV (it is never fed back, as in vLLM); False if no room."""
        start = len(seq)
        if output_len > 0 and forced is None:
            seq.extend_ids(self.tokens.take_run(output_len))  # one run, checked at its ends
        elif output_len > 0:
            given = np.asarray(forced[:output_len], dtype=np.int32)
            run = self.tokens.take_run(output_len - len(given))
            seq.append(np.concatenate([given, np.arange(run.start, run.stop, dtype=np.int32)]))
        target = start + max(output_len - 1, 0)
        if target <= seq.num_computed:
            return True
        return self.write_for_room(seq, target)

    def write_for_room(self, seq: Sequence, target: int) -> bool:
        """Grow and commit `seq` to `target` tokens, finishing the oldest for room."""
        while self.client.grow_commit(seq, target) is None:
            if not self.finish_oldest():
                return False
        return True

    def fork_for_room(self, parent: Sequence, child: Sequence) -> bool:
        """Fork `child` from `parent`, finishing the oldest for room; False if no room."""
        while self.client.fork(parent, child) is None:
            if not self.finish_oldest():
                return False
        return True

    def run_beams(self, spec: RequestSpec, seq: Sequence) -> list[Sequence] | None:
        """Follow `spec`'s beam schedule from the computed prompt `seq`: returns the live beams
        at the end, or None (all released, the request truncated) when even alone there is
        no room."""
        beams, forks = [seq], 0
        schedule = spec.beam_parents
        for t, parents in enumerate(schedule):
            counts = np.bincount(np.asarray(parents, dtype=np.int64), minlength=len(beams)).tolist()
            self.release_all([b for b, k in zip(beams, counts, strict=True) if k == 0])  # pruned first
            kept: list[Sequence] = []
            for i, (b, k) in enumerate(zip(beams, counts, strict=True)):
                if k:
                    kept.append(b)
                for _ in range(k - 1):
                    forks += 1
                    child = b.fork(f"{spec.request_id}/b{forks}")
                    if not self.fork_for_room(b, child):
                        self.release_all(kept + [x for x, c in zip(beams[i + 1 :], counts[i + 1 :], strict=True) if c])
                        self.truncated += 1
                        return None
                    kept.append(child)
            beams = kept
            if t + 1 < len(schedule) and not self.extend_beams(beams):  # last step: never fed back
                self.truncated += 1
                return None
        return beams

    def extend_beams(self, beams: list[Sequence]) -> bool:
        """One fresh token on every beam, with KV; False (all released) when there is no room."""
        for b in beams:
            b.append_token(self.tokens.take_one())
            if not self.write_for_room(b, len(b)):
                self.release_all(beams)
                return False
        return True

    def release_all(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.client.release(seq)

    # -- the result -------------------------------------------------------------------------

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
