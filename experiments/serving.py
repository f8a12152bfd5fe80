"""The serving protocol (DESIGN §6): continuous batching on a virtual clock.

Each step: requests that have arrived join the waiting queue; running requests get their
next token (decode) or next prefill chunk first, in admission order; then waiting requests
are admitted, in FCFS order or longest-cached-prefix first, while the step's token budget
and the running limit allow. When a running request's pages cannot grow, the most recently
admitted request is preempted by recompute (vLLM V1's policy): its pages are released (a
caching backend keeps what it published, so re-admission may hit its own prefix), and it
goes back to the front of the waiting queue with the tokens it had, to be prefilled again.
The executor prices the step (cost model) or runs it (model); the clock advances by it.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachelib.interface import PrefixCache
from cachelib.types import Sequence
from experiments.decode_windows import decode_window, run_decode_window
from experiments.workloads.spec import RequestSpec

ORDERINGS = ("fcfs", "lpf")


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """Scheduler knobs. `token_budget`: tokens computed per step (decodes + prefill chunks);
    `max_running`: requests in the batch at most; `ordering`: fcfs | lpf (longest prefix first)."""

    token_budget: int = 8192
    max_running: int = 256
    ordering: str = "fcfs"

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_running < 1:
            raise ValueError("token_budget and max_running must be positive")
        if self.ordering not in ORDERINGS:
            raise ValueError(f"unknown ordering {self.ordering!r}; choose one of {', '.join(ORDERINGS)}")


@dataclass(slots=True, eq=False)  # identity: `in running` must not compare fields
class _Request:
    spec: RequestSpec
    seq: Sequence
    generated: int = 0
    first_admit_hit: int | None = None
    hit_tokens: int = 0  # over every admission, re-admissions after preemption included
    computed_tokens: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    preempted: int = 0
    output: list[int] = field(default_factory=list)
    arrival: float = 0.0  # when it joined the queue (after its predecessor, for a dependent turn)
    target: int = 0  # tokens to generate (0: the spec's output_len)
    lag: int = 0  # decode tokens computed but not yet committed (see `decode_steps_are_noops`)
    sample_of: str | None = None  # parallel sampling: the request this sample was forked from

    def __post_init__(self) -> None:
        if not self.target:
            self.target = max(self.spec.output_len, 1)


@dataclass
class ServingResult:
    """Per-request outcomes and the run's timeline."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, pages pinned)
    steps: int = 0
    preemptions: int = 0
    aborted: int = 0
    cache_seconds: float = 0.0
    makespan: float = 0.0
    peak_pages: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)  # with keep_outputs=True


def serve(
    cache: PrefixCache,
    requests: Seq[RequestSpec],
    executor: Any,
    config: ServingConfig = ServingConfig(),
    *,
    progress: bool = False,
    keep_outputs: bool = False,
    sample_lens: dict[str, tuple[int, ...]] | None = None,
    outputs: dict[str, np.ndarray] | None = None,
) -> ServingResult:
    """Run `requests` through `cache` and `executor`; returns per-request metrics and the timeline.

    A request with `n > 1` (parallel sampling) forks `n - 1` samples from its prompt when its
    first token is sampled (`cache.fork`); sample j generates `sample_lens[id][j]` tokens
    (default: `output_len` each). A sample that cannot fork for want of pages waits to be
    admitted like a preempted request (recompute). Beam search is not run here: it lives in
    `experiments/bench/sharing_memory.py`. `outputs[id]`, when given, are the tokens a
    request generates (whatever the executor samples), so that a conversation's next turn
    can reuse their KV.
    """
    beams = [s.request_id for s in requests if s.beam_width > 1]
    if beams:
        raise ValueError(
            f"the serving engine runs parallel sampling, not beam search (request {beams[0]!r}); use experiments.bench.sharing_memory"
        )
    sample_lens = sample_lens or {}
    forced = {rid: np.asarray(toks, dtype=np.int64).tolist() for rid, toks in (outputs or {}).items()}
    pc = time.perf_counter
    res = ServingResult()
    # arrivals as a heap of (time, order, spec); a request that follows another (`after`)
    # waits in `blocked` until that one finishes, then arrives `think_time` later
    ids = {s.request_id for s in requests}
    blocked: dict[str, list[RequestSpec]] = {}
    pending: list[tuple[float, int, RequestSpec]] = []
    for i, s in enumerate(requests):
        if s.after is not None and s.after in ids:
            blocked.setdefault(s.after, []).append(s)
        else:
            pending.append((s.arrival, i, s))
    heapq.heapify(pending)
    order = len(requests)
    waiting: deque[_Request] = deque()
    running: list[_Request] = []
    now = 0.0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=f"serve {cache.name}", unit="req", leave=False, mininterval=0.5)

    def timed(fn, *args):
        t0 = pc()
        out = fn(*args)
        res.cache_seconds += pc() - t0
        return out

    # Decode steps inside a page the table already holds need no cache call on backends that
    # promise so: their commits are batched until the next grow, fork or release (cost model
    # only; the real model reads every step's pages through the table, which is unchanged).
    lazy = cache.decode_steps_are_noops and hasattr(executor, "decode_step_seconds")
    page = cache.page_size

    def flush(r: _Request) -> None:
        if r.lag:
            timed(cache.commit, r.seq, r.seq.num_computed + r.lag)
            r.lag = 0

    def finish(r: _Request, aborted: bool = False, admitted: bool = True, at: float | None = None) -> None:
        nonlocal order
        if admitted:
            flush(r)
            timed(cache.release, r.seq)
        r.finished_at = now if at is None else at
        if keep_outputs:
            res.outputs[r.spec.request_id] = r.output
        for dep in blocked.pop(r.spec.request_id, ()):
            order += 1
            heapq.heappush(pending, (r.finished_at + dep.think_time, order, dep))
        res.aborted += aborted
        res.requests.append(_record(r, aborted))
        if bar is not None:
            bar.update(1)

    def preempt(r: _Request) -> None:
        flush(r)
        timed(cache.release, r.seq)
        running.remove(r)
        # recompute: a fresh sequence holding every token so far, at the front of the queue
        old = r.seq
        r.seq = Sequence(old.request_id, old.tokens.copy(), old.extra, prefix_id=old.prefix_id)
        r.seq.cache_memo = old.cache_memo  # same tokens: the cache's per-sequence memo (block hashes) still holds
        r.preempted += 1
        res.preemptions += 1
        gone.add(id(r))
        waiting.appendleft(r)

    def spawn_samples(r: _Request, tok: int) -> None:
        """Fork samples 1..n-1 of `r` from its computed prompt; each samples its first token."""
        lens = sample_lens.get(r.spec.request_id) or (r.spec.output_len,) * r.spec.n
        r.target = max(lens[0], 1)
        flush(r)
        for j in range(1, r.spec.n):
            spec = dataclasses.replace(r.spec, request_id=f"{r.spec.request_id}/{j}", output_len=lens[j], n=1)
            first = executor.fresh_tokens(1)[0] if hasattr(executor, "fresh_tokens") else tok
            child = _Request(
                spec, r.seq.fork(spec.request_id), sample_of=r.spec.request_id, first_admit_hit=0, arrival=r.arrival
            )
            ops = timed(cache.fork, r.seq, child.seq)
            child.generated, child.first_token_at = 1, now
            child.output.append(first)
            if ops is None:  # no pages to fork into: it waits and recomputes, like a preempted request
                child.seq = Sequence(spec.request_id, np.append(r.seq.tokens, np.int32(first)), r.seq.extra)
                waiting.appendleft(child)
                continue
            executor.apply_copies(ops)
            if child.generated >= child.target:
                finish(child)
            else:
                child.seq.append_token(first)
                running.append(child)

    gone: set[int] = set()  # ids of requests preempted during the current step
    lagging: set[int] = set()  # ids of requests whose step this time needs no cache call
    while pending or waiting or running:
        while pending and pending[0][0] <= now:
            arrival, _, spec = heapq.heappop(pending)
            seq = Sequence(spec.request_id, spec.prompt, spec.extra, prefix_id=spec.prefix_id)
            waiting.append(_Request(spec, seq, arrival=arrival))
        if not waiting and not running:
            now = pending[0][0]
            continue
        budget = config.token_budget
        batch: list[tuple[_Request, int]] = []
        gone.clear()
        lagging.clear()
        for r in list(running):
            if budget == 0 or id(r) in gone:
                continue  # preempted by an earlier request of this step
            seq = r.seq
            start = seq.num_computed + r.lag
            n = min(len(seq) - start, budget)
            if lazy and n == 1 and start >= seq.prompt_len and start % page and start < len(seq.page_table) * page:
                lagging.add(id(r))  # a decode step inside a page it holds: no cache call
                batch.append((r, 1))
                budget -= 1
                continue
            flush(r)
            t0 = pc()
            ops = cache.grow(seq, start + n)
            res.cache_seconds += pc() - t0
            while ops is None:
                victim = running[-1]
                if victim is r and len(running) == 1:
                    break  # alone and still no room: it can never finish
                preempt(victim)
                if victim is r:
                    break
                ops = timed(cache.grow, r.seq, start + n)
            if ops is None:
                if id(r) not in gone:
                    running.remove(r)
                    finish(r, aborted=True)
                continue
            executor.apply_copies(ops)
            batch.append((r, n))
            budget -= n
        if gone:
            batch = [(r, n) for r, n in batch if id(r) not in gone]
        budget = config.token_budget - sum(n for _, n in batch)
        before = len(batch)
        _admit(cache, waiting, running, batch, budget, config, executor, timed, finish)
        admitted_now = len(batch) > before
        if not batch:
            if waiting and not running:
                # nothing runs and the head does not fit in an empty cache: it never will
                finish(waiting.popleft(), aborted=True, admitted=False)
                continue
            if pending:
                now = max(now, pending[0][0])
            continue
        if lazy and not admitted_now and len(batch) == len(running):
            for r, _ in batch:
                flush(r)  # a decode window starts from committed state
        k = decode_window(cache, executor, batch, running, admitted_now, pending, now)
        if k > 1:
            now = run_decode_window(cache, executor, batch, k, now, timed, finish, running, res, forced)
            continue
        seconds, tokens = executor.step([(r.seq, n, r.seq.num_computed + r.lag) for r, n in batch])
        now += seconds
        res.steps += 1
        for (r, n), tok in zip(batch, tokens, strict=True):
            if id(r) in lagging:
                r.lag += n
            else:
                t0 = pc()
                cache.commit(r.seq, r.seq.num_computed + r.lag + n)
                res.cache_seconds += pc() - t0
            r.computed_tokens += n
            if tok is None:
                continue
            given = forced.get(r.spec.request_id) if r.sample_of is None else None
            if given is not None and r.generated < len(given):
                tok = given[r.generated]
            if r.generated == 0 and r.spec.n > 1 and r.sample_of is None:
                spawn_samples(r, tok)
            r.generated += 1
            r.output.append(tok)
            if r.first_token_at is None:
                r.first_token_at = now
            if r.generated >= r.target:
                running.remove(r)
                finish(r)
            else:
                r.seq.append_token(tok)
        pinned = cache.pages_pinned()
        res.peak_pages = max(res.peak_pages, pinned)
        res.timeline.append((now, pinned))
    res.makespan = now
    if bar is not None:
        bar.close()
    return res


def _admit(cache, waiting, running, batch, budget, config, executor, timed, finish) -> None:
    """Admit waiting requests into the step while budget, batch size and memory allow."""
    if config.ordering == "lpf" and len(waiting) > 1:
        # SGLang's longest-prefix-first: the longest cached prefix goes first (ties: arrival)
        ordered = sorted(waiting, key=lambda r: -timed(cache.match, r.seq).num_tokens)
        waiting.clear()
        waiting.extend(ordered)
    # FCFS: the head blocks the line, so only the head is ever tried (O(1) per step)
    while waiting and budget > 0 and len(running) < config.max_running:
        r = waiting[0]
        m = timed(cache.match, r.seq)
        n = min(len(r.seq) - m.num_tokens, budget)
        ops = timed(cache.admit, r.seq, m, m.num_tokens + n)
        if ops is None:
            break  # head of line blocks: later requests wait too (FCFS fairness)
        executor.apply_copies(ops)
        waiting.popleft()
        running.append(r)
        if r.first_admit_hit is None:
            r.first_admit_hit = m.num_tokens
        r.hit_tokens += m.num_tokens
        batch.append((r, n))
        budget -= n


def _record(r: _Request, aborted: bool) -> dict[str, Any]:
    spec = r.spec
    ttft = None if r.first_token_at is None else r.first_token_at - r.arrival
    tpot = None
    if r.first_token_at is not None and r.finished_at is not None and r.generated > 1:
        tpot = (r.finished_at - r.first_token_at) / (r.generated - 1)
    return {
        "request_id": spec.request_id,
        "arrival": r.arrival,
        "prompt_tokens": int(len(spec.prompt_source) if hasattr(spec.prompt_source, "__len__") else len(spec.prompt)),
        "hit_tokens": r.first_admit_hit or 0,
        "hit_tokens_all_admissions": r.hit_tokens,
        "computed_tokens": r.computed_tokens,
        "generated": r.generated,
        "ttft": ttft,
        "tpot": tpot,
        "finished_at": r.finished_at,
        "preempted": r.preempted,
        "aborted": aborted,
        "sample_of": r.sample_of,
    }
