"""The replay protocol (DESIGN §6): sequential, exact, used to check fidelity.

Requests are taken in trace order with at most `concurrency` in flight, the oldest finishing
first. Per request: match -> admit the prompt (the cache evicts as its design does) ->
commit the prompt -> decode `output_len` tokens -> at finish, commit and release. Generated
tokens get ids `GENERATED_TOKEN_BASE + a global counter`, so no prompt ever matches them,
and the last generated token gets no KV (it is never fed back, as in vLLM). If admission
fails, the oldest in-flight request finishes and admission is retried; with nothing in
flight the request is unschedulable. A request's plan (`RequestSpec.sample_lens`,
`beam_parents`, `forced_output`) says what it forks and generates.

Only time spent inside cache calls is counted in `cache_seconds` (hashing is inside them).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from cachelib.interface import PrefixCache
from cachelib.types import Sequence
from experiments.engine.cache_client import CacheClient
from experiments.engine.executors import FreshTokens
from experiments.workloads.spec import RequestSpec


def replay(
    cache: PrefixCache | CacheClient,
    requests: Seq[RequestSpec],
    *,
    concurrency: int = 1,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the replay protocol of `requests` on `cache`; returns the result as a JSON-able dict.

    `per_request_hits[i]` is the hit of request i (-1 when it was unschedulable). A request
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
    """One replay: the in-flight groups (oldest first), the counters, the token counter."""

    def __init__(self, client: CacheClient, concurrency: int = 1) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.client = client
        self.concurrency = concurrency
        self.inflight: deque[list[Sequence]] = deque()
        self.tokens = FreshTokens()
        self.hits: list[int] = []
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
        while self.inflight:
            self.finish_oldest()
        if bar is not None:
            bar.close()
        return self.result(len(requests))

    def add(self, spec: RequestSpec) -> None:
        """One request: admit its prompt, then decode its plan; it joins the in-flight queue."""
        while len(self.inflight) >= self.concurrency:
            self.finish_oldest()
        seq = Sequence(spec.request_id, spec.prompt, spec.extra, prefix_id=spec.prefix_id)
        hit = self.admit(seq)
        if hit is None:
            self.unschedulable += 1
            self.hits.append(-1)
            return
        self.hits.append(hit)
        self.prompt_tokens += len(seq)
        self.hit_tokens += hit
        self.client.commit(seq, len(seq))
        if spec.beam_width > 1:
            beams = self.beam(seq, spec.beam_parents)
            if beams is None:
                self.truncated += 1  # ran out of room even alone: the request stops early
            else:
                self.inflight.append(beams)
            return
        self.inflight.append(self.sample(seq, spec))

    def admit(self, seq: Sequence) -> int | None:
        """Match and admit the prompt, finishing the oldest for room; the hit, or None."""
        while True:
            m = self.client.match(seq)
            ops = self.client.admit(seq, m, len(seq))
            if ops is not None:
                return m.num_tokens
            if not self.inflight:
                return None
            self.finish_oldest()

    def sample(self, seq: Sequence, spec: RequestSpec) -> list[Sequence]:
        """Fork the `n - 1` samples, decode each, then the request itself; the group."""
        group = [seq]
        lens = spec.output_lens
        for j in range(1, spec.n):
            child = seq.fork(f"{spec.request_id}/{j}")
            if not self.fork(seq, child):
                self.truncated += 1  # no room even for this sample: it is dropped
                continue
            group.append(child)
            # Even alone a sample that cannot hold its output stops early.
            self.truncated += not self.decode(child, lens[j])
        self.truncated += not self.decode(seq, lens[0], spec.forced_output)
        return group

    def decode(self, seq: Sequence, output_len: int, forced: np.ndarray | None = None) -> bool:
        """Append `output_len` tokens (`forced` ones first, then fresh ids) and give all but
        the last KV; False if no room."""
        start = len(seq)
        if output_len > 0:
            given = np.asarray(forced[:output_len] if forced is not None else (), dtype=np.int32)
            seq.append(np.concatenate([given, self.tokens.take_array(output_len - len(given))]))
        target = start + max(output_len - 1, 0)
        if target <= seq.num_computed:
            return True
        return self.write(seq, target)

    def write(self, seq: Sequence, target: int) -> bool:
        """Grow and commit `seq` to `target` tokens, finishing the oldest for room."""
        while True:
            if self.client.grow_commit(seq, target) is not None:
                return True
            if not self.inflight:
                return False
            self.finish_oldest()

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Fork `child` from `parent`, finishing the oldest for room; False if no room."""
        while True:
            if self.client.fork(parent, child) is not None:
                return True
            if not self.inflight:
                return False
            self.finish_oldest()

    def beam(self, root: Sequence, parents_by_step: np.ndarray) -> list[Sequence] | None:
        """Follow a beam schedule from the computed prompt; the live beams at the end, or None
        (all released) when even alone there is no room."""
        beams, forks = [root], 0
        for t, parents in enumerate(parents_by_step):
            counts = np.bincount(np.asarray(parents, dtype=np.int64), minlength=len(beams)).tolist()
            self.release([b for b, k in zip(beams, counts, strict=True) if k == 0])  # pruned first
            kept: list[Sequence] = []
            for i, (b, k) in enumerate(zip(beams, counts, strict=True)):
                if k:
                    kept.append(b)
                for _ in range(k - 1):
                    forks += 1
                    child = b.fork(f"{root.request_id}/b{forks}")
                    if not self.fork(b, child):
                        self.release(kept + [x for x, c in zip(beams[i + 1 :], counts[i + 1 :], strict=True) if c])
                        return None
                    kept.append(child)
            beams = kept
            if t + 1 < len(parents_by_step) and not self.extend_beams(beams):  # last step: never fed back
                return None
        return beams

    def extend_beams(self, beams: list[Sequence]) -> bool:
        """One fresh token on every beam, with KV; False (all released) when there is no room."""
        for b in beams:
            b.append_token(self.tokens.take_one())
            if not self.write(b, len(b)):
                self.release(beams)
                return False
        return True

    def finish_oldest(self) -> None:
        self.release(self.inflight.popleft())

    def release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.client.release(seq)

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
        }


def _progress_bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, mininterval=0.5)
