"""The engine's replay protocol (DESIGN §6): sequential, exact, used to check fidelity.

Requests are taken in trace order with at most `concurrency` in flight, the oldest finishing
first. Per request: match -> admit the prompt (the cache evicts as its design does) ->
commit the prompt -> decode `output_len` tokens -> at finish, commit and release. Generated
tokens get ids `2_000_000_000 + a global counter`, so no prompt ever matches them, and the
last generated token gets no KV (it is never fed back, as in vLLM). If admission fails, the
oldest in-flight request finishes and admission is retried; with nothing in flight the
request is unschedulable.

Only time spent inside cache calls is counted in `cache_seconds` (hashing is inside them).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq
from typing import Any

import numpy as np

from cachelib.interface import PrefixCache
from cachelib.types import Sequence
from experiments.workloads.spec import RequestSpec

GENERATED_TOKEN_BASE = 2_000_000_000


class _Clock:
    """Accumulates the wall time spent inside cache calls."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=False, mininterval=0.5)


def replay(
    cache: PrefixCache,
    requests: Seq[RequestSpec],
    *,
    concurrency: int = 1,
    progress: bool = False,
    sample_lens: dict[str, tuple[int, ...]] | None = None,
    beam_parents: dict[str, np.ndarray] | None = None,
    outputs: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Run the replay protocol of `requests` on `cache`; returns the result as a JSON-able dict.

    `per_request_hits[i]` is the hit of request i (-1 when it was unschedulable). A request
    with `n > 1` forks `n - 1` samples after its prompt (sample j decodes `sample_lens[id][j]`
    tokens, default `output_len`); one with `beam_width > 1` follows its beam schedule
    (`beam_parents[id][t]`: the parent of each surviving beam at step t; a beam nobody picks
    is released, one picked k times forks k - 1 children). Either way the group is in flight,
    and finishes, as one. `outputs[id]`, when given, are the token ids a request generates
    (a multi-turn conversation re-sends them in its next prompt, so their KV can be reused);
    otherwise generated ids are fresh and no prompt ever matches them.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    sample_lens = sample_lens or {}
    beam_parents = beam_parents or {}
    outputs = outputs or {}
    missing = [s.request_id for s in requests if s.beam_width > 1 and s.request_id not in beam_parents]
    if missing:
        raise ValueError(f"beam search request {missing[0]!r} has no beam schedule (beam_parents)")
    clock = _Clock()
    pc = time.perf_counter
    inflight: deque[list[Sequence]] = deque()
    hits: list[int] = []
    next_token = GENERATED_TOKEN_BASE
    prompt_tokens = hit_tokens = unschedulable = truncated = 0
    bar = _progress(len(requests), progress, f"replay {cache.name}")

    def finish_oldest() -> None:
        release_all(inflight.popleft())

    def decode(seq: Sequence, output_len: int, forced: np.ndarray | None = None) -> bool:
        """Append `output_len` tokens (`forced` ones first, then fresh ids) and give all but
        the last KV; False if no room."""
        nonlocal next_token
        start = len(seq)
        if output_len > 0:
            given = np.asarray(forced[:output_len] if forced is not None else (), dtype=np.int32)
            fresh = output_len - len(given)
            seq.append(np.concatenate([given, np.arange(next_token, next_token + fresh, dtype=np.int32)]))
            next_token += fresh
        target = start + max(output_len - 1, 0)
        if target <= seq.num_computed:
            return True
        while True:
            t0 = pc()
            ops = cache.grow(seq, target)
            if ops is not None:
                cache.commit(seq, target)
            clock.seconds += pc() - t0
            if ops is not None or not inflight:
                return ops is not None
            finish_oldest()

    def fork(parent: Sequence, child: Sequence) -> bool:
        while True:
            t0 = pc()
            ops = cache.fork(parent, child)
            clock.seconds += pc() - t0
            if ops is not None or not inflight:
                return ops is not None
            finish_oldest()

    def beam(root: Sequence, parents_by_step: np.ndarray) -> list[Sequence] | None:
        """Follow a beam schedule from the computed prompt; the live beams at the end, or None
        (all released) when even alone there is no room."""
        nonlocal next_token
        beams, forks = [root], 0
        for t, parents in enumerate(parents_by_step):
            counts = np.bincount(np.asarray(parents, dtype=np.int64), minlength=len(beams)).tolist()
            for b, k in zip(beams, counts, strict=True):
                if k == 0:  # pruned: its pages go back before anyone forks
                    release_all([b])
            kept: list[Sequence] = []
            for i, (b, k) in enumerate(zip(beams, counts, strict=True)):
                if k:
                    kept.append(b)
                for _ in range(k - 1):
                    forks += 1
                    child = b.fork(f"{root.request_id}/b{forks}")
                    if not fork(b, child):
                        release_all(kept + [x for x, c in zip(beams[i + 1 :], counts[i + 1 :], strict=True) if c])
                        return None
                    kept.append(child)
            beams = kept
            if t + 1 < len(parents_by_step):  # the last step's tokens are never fed back
                for b in beams:
                    b.append_token(next_token)
                    next_token += 1
                    if not write_last(b):
                        release_all(beams)
                        return None
        return beams

    def write_last(seq: Sequence) -> bool:
        """Give the token just appended its KV (grow + commit), finishing others for room."""
        while True:
            t0 = pc()
            ops = cache.grow(seq, len(seq))
            if ops is not None:
                cache.commit(seq, len(seq))
            clock.seconds += pc() - t0
            if ops is not None or not inflight:
                return ops is not None
            finish_oldest()

    def release_all(seqs: list[Sequence]) -> None:
        t0 = pc()
        for seq in seqs:
            cache.release(seq)
        clock.seconds += pc() - t0

    for spec in requests:
        while len(inflight) >= concurrency:
            finish_oldest()
        seq = Sequence(spec.request_id, spec.prompt, spec.extra, prefix_id=spec.prefix_id)
        prompt_len = len(seq)
        while True:
            t0 = pc()
            m = cache.match(seq)
            ops = cache.admit(seq, m, prompt_len)
            clock.seconds += pc() - t0
            if ops is not None or not inflight:
                break
            finish_oldest()
        if bar is not None:
            bar.update(1)
        if ops is None:
            unschedulable += 1
            hits.append(-1)
            continue
        hits.append(m.num_tokens)
        prompt_tokens += prompt_len
        hit_tokens += m.num_tokens
        t0 = pc()
        cache.commit(seq, prompt_len)
        clock.seconds += pc() - t0
        if spec.beam_width > 1:
            beams = beam(seq, beam_parents[spec.request_id])
            if beams is None:
                truncated += 1  # ran out of room even alone: the request stops early
            else:
                inflight.append(beams)
            continue
        group = [seq]
        lens = sample_lens.get(spec.request_id) or (spec.output_len,) * spec.n
        for j in range(1, spec.n):
            child = seq.fork(f"{spec.request_id}/{j}")
            if not fork(seq, child):
                truncated += 1  # no room even for this sample: it is dropped
                continue
            group.append(child)
            # Even alone a sample that cannot hold its output stops early.
            truncated += not decode(child, lens[j])
        truncated += not decode(seq, lens[0], outputs.get(spec.request_id))
        inflight.append(group)
    while inflight:
        finish_oldest()
    if bar is not None:
        bar.close()
    stats = cache.stats()
    scheduled = len(requests) - unschedulable
    return {
        "backend": cache.name,
        "page_size": cache.page_size,
        "num_pages": cache.num_pages,
        "capacity_tokens": cache.num_pages * cache.page_size,
        "concurrency": concurrency,
        "requests": len(requests),
        "scheduled": scheduled,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "computed_prompt_tokens": prompt_tokens - hit_tokens,
        "hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "evicted_pages": stats.evicted_pages,
        "unschedulable": unschedulable,
        "truncated": truncated,
        "cache_seconds": clock.seconds,
        "us_per_request": clock.seconds / len(requests) * 1e6 if requests else 0.0,
        "metadata_bytes_end": stats.metadata_bytes,
        "per_request_hits": hits,
    }


def unlimited_pages(requests: Seq[RequestSpec], page_size: int) -> int:
    """Enough pages that the replay never evicts: every request's pages, summed."""
    total = 0
    for spec in requests:
        n = len(spec.prompt_source) if hasattr(spec.prompt_source, "__len__") else len(spec.prompt)
        total += -(-(n + spec.output_len) // page_size)
    return max(total, 1)
