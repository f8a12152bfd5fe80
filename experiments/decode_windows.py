"""Decode windows: simulating a stretch of decode-only serving steps in one go.

While nothing but decoding happens (no admission, no arrival, no finish, no preemption),
every step adds one token to every running request; the cost model prices the whole
stretch at once and the cache sees one grow and one commit per request. The outcome equals
taking the steps one by one (tests/test_serving.py checks it step for step).
"""

from __future__ import annotations

import numpy as np

#: longest decode window simulated in one go (bounds the per-step time vector)
MAX_WINDOW = 4096


def decode_window(cache, executor, batch, running, admitted_now, pending, now) -> int:
    """How many decode steps can be simulated at once, with exactly the outcome of taking
    them one by one (cost-model executor only).

    Safe while nothing but decoding happens: no admission this step (so none in the window:
    memory only shrinks while decoding, budget and batch size stay), every running request is
    decoding, no request finishes before the last step, no arrival before it, and the pages
    the window needs are free or evictable, so no preemption. Which page ids are handed out
    can differ from step-by-step order; no hit, eviction count or timing can.
    """
    if admitted_now or not hasattr(executor, "decode_step_seconds") or len(batch) != len(running):
        return 1
    if any(n != 1 or len(r.seq) - r.seq.num_computed != 1 for r, n in batch):
        return 1
    k = min(MAX_WINDOW, min(r.target - r.generated for r, _ in batch))
    if k <= 1:
        return 1
    page = cache.page_size
    computed = np.array([r.seq.num_computed for r, _ in batch], dtype=np.int64)
    pages = np.array([len(r.seq.page_table) for r, _ in batch], dtype=np.int64)
    spare = cache.pages_reclaimable()

    def need(steps: int) -> int:
        return int(np.maximum(-(-(computed + steps) // page) - pages, 0).sum())

    if need(k) > spare:
        lo, hi = 1, k  # need(lo) fits (this step's grow succeeded); find the largest that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid) <= spare else (lo, mid - 1)
        k = lo
    if pending and k > 1:
        starts = now + np.concatenate(([0.0], np.cumsum(executor.decode_step_seconds(computed, k - 1))))
        k = int(np.searchsorted(starts, pending[0][0], side="left"))  # steps starting before it
    return max(k, 1)


def run_decode_window(cache, executor, batch, k, now, timed, finish, running, res, forced) -> float:
    """Take `k` decode steps of `batch` at once; returns the new clock."""
    computed = np.array([r.seq.num_computed for r, _ in batch], dtype=np.int64)
    times = executor.decode_step_seconds(computed, k)
    end = now + float(times.sum())
    for r, _ in batch:
        tokens = executor.fresh_tokens(k)
        given = forced.get(r.spec.request_id) if r.sample_of is None else None
        if given is not None:  # the request's recorded output overrides what was sampled
            lo = r.generated
            tokens[: max(0, min(k, len(given) - lo))] = given[lo : lo + k]
        r.seq.append(np.array(tokens[:-1], dtype=np.int32))
        target = r.seq.num_computed + k
        ops = timed(cache.grow, r.seq, target)
        if ops is None:
            raise RuntimeError("decode window ran out of pages; the window check is wrong")
        executor.apply_copies(ops)
        timed(cache.commit, r.seq, target)
        r.computed_tokens += k
        r.generated += k
        r.output.extend(tokens)
    res.steps += k
    for r, _ in batch:
        if r.generated >= r.target:
            running.remove(r)
            finish(r, at=end)
        else:
            r.seq.append_token(r.output[-1])
    pinned = cache.pages_pinned()
    res.peak_pages = max(res.peak_pages, pinned)
    res.timeline.append((end, pinned))
    return end
