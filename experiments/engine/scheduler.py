"""`Scheduler`: one replica's continuous batching (the serving protocol, docs/design.md §6).

State lives here: the waiting queue, the running list (in admission order), the run's
metrics. `step()` is one engine step on the shared `VirtualClock`:

1. `schedule_running`: running requests get their next token (decode) or next prefill
   chunk first, in admission order, within the token budget; when one cannot grow, the
   most recently admitted request is preempted by recompute (`preempt`: vLLM V1's policy).
2. `admit`: waiting requests join, FCFS or longest-cached-prefix first (`order_waiting`),
   while the budget, the running limit and memory allow; the head blocks the line.
3. The executor runs (or prices) the batch; `postprocess` commits the KV, takes each
   sampled token (or the request's forced one), forks parallel samples at the first token
   (`spawn_samples`) and `finish`es what is done.

While nothing but decoding happens, `window_size` / `run_window` simulate a stretch of
decode steps in one go (cost model only), with exactly the outcome of taking them one by
one (tests/test_serving.py checks it).

The replay protocol (docs/design.md §6, driven by `experiments/engine/replay.py`) uses the same
requests, running list and cache client, one request at a time: `admit_prompt` (match,
admit and commit the whole prompt), `run_to_completion` (its samples or its beam schedule
decoded at once, then it joins the running list). Memory pressure is answered by a named
decision per protocol: serving preempts the latest admitted (`preempt_latest`), replay
finishes the oldest running request (`finish_oldest`) and retries.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import ClassVar, NamedTuple

import numpy as np

from cachelib.interface import DECODE_NOOPS_CONDITIONS, DECODE_NOOPS_WHILE_FREE, PrefixCache
from cachelib.types import Sequence
from experiments.engine.cache_client import CacheClient
from experiments.engine.clock import VirtualClock
from experiments.engine.executors import Executor
from experiments.engine.request import Batch, Request, ServingConfig, ServingResult, request_record, tier_record
from experiments.workloads.spec import RequestSpec

#: longest decode window simulated in one go (bounds the per-step time vector)
MAX_WINDOW = 4096

#: most token slots a request's `Sequence` reserves for its output up front (`room`): a
#: trace may declare outputs of up to ~147M tokens, which a run may never generate; past
#: this the buffer doubles as tokens come, as without room
MAX_OUTPUT_ROOM = 1 << 16


def output_room(spec: RequestSpec) -> int:
    """Token slots to reserve for `spec`'s output in its `Sequence`."""
    return min(spec.output_len, MAX_OUTPUT_ROOM)


def new_sequence(spec: RequestSpec) -> Sequence:
    """The `Sequence` a request of `spec` runs as: its prompt's tokens (built now, for a
    trace's lazy prompt), with room for its output."""
    return Sequence(spec.request_id, spec.prompt, spec.extra, prefix_id=spec.prefix_id, room=output_room(spec))


class Loads(NamedTuple):
    """A replica's work in tokens and pages, summed over its waiting and running requests
    (a cluster's `ClusterView.outstanding_tokens`, `prefill_tokens`, `active_pages`)."""

    outstanding: int
    prefill: int
    pages: int


class Scheduler:
    """One replica: waiting and running queues over one cache (through `client`) and one
    executor. As a serving policy this is `legacy`: the project's scheduler before the
    `vllm` policy (`vllm_scheduler.VllmScheduler`), kept so older reports can be reproduced
    and for SGLang-style longest-prefix-first ordering. It differs from vLLM's rules: it
    admits in a step that preempted, allocates only the first chunk without a whole-prompt
    fit test, publishes pages after the step, and aborts a request that cannot grow alone."""

    policy: ClassVar[str] = "legacy"
    #: tier transfers on the serving clock (`VllmScheduler` sets one); the legacy policy
    #: leaves a tiered cache's transfers instant
    transfers = None

    def __init__(
        self,
        client: CacheClient,
        executor: Executor,
        config: ServingConfig,
        clock: VirtualClock,
        *,
        keep_outputs: bool = False,
    ) -> None:
        self.client = client
        self.cache = client.cache
        self.executor = executor
        self.config = config
        self.clock = clock
        self.keep_outputs = keep_outputs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.result = ServingResult()
        # Decode steps inside a page the table already holds need no cache call on backends
        # that promise so: their commits are batched until the next grow, fork or release
        # (cost model only; the real model reads every step's pages through the table).
        # `lazy_when`: None when the promise is unconditional, else its condition
        # (`PrefixCache.decode_noops_when`), checked for each step it would excuse.
        self.lazy_when = None if self.cache.decode_steps_are_noops else self.cache.decode_noops_when
        if self.lazy_when is not None and self.lazy_when not in DECODE_NOOPS_CONDITIONS:
            raise ValueError(
                f"{self.cache.name}: unknown decode_noops_when {self.lazy_when!r}; "
                f"one of {', '.join(DECODE_NOOPS_CONDITIONS)}, or None"
            )
        self.lazy = (
            self.cache.decode_steps_are_noops or self.lazy_when is not None
        ) and executor.supports_decode_windows
        self._gone: set[int] = set()  # ids of requests preempted during the current step
        self._lagging: set[int] = set()  # ids of requests whose step this time needs no cache call
        # records carry reuse by tier (a reference model duck-typing the contract has none)
        self.tiered = isinstance(self.cache, PrefixCache) and len(self.cache.memory_tiers) > 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, spec: RequestSpec, arrival: float, index: int = -1) -> None:
        """A request arrives: it joins the back of the waiting queue (`index`: its trace
        line), without its sequence (`sequence`)."""
        self.waiting.append(Request(spec, None, arrival=arrival, index=index))

    def sequence(self, r: Request) -> Sequence:
        """`r`'s sequence, built the first time the scheduler needs it (to match or admit
        `r`): a request waits without one. Built at arrival instead, the sequences of a
        long queue held every waiting prompt's tokens and output room: on the Mooncake
        conversation trace up to 5-8k waiting requests, 250-350 MB, most of a serving
        run's memory and its page faults. Nothing reads a waiting request's tokens
        before it is considered."""
        seq = r.seq
        if seq is None:
            seq = r.seq = new_sequence(r.spec)
        return seq

    def loads(self, page_size: int) -> Loads:
        """Over the waiting and running requests: prompt tokens whose KV is not computed (a
        preempted request's prompt counts again) plus output tokens not generated; the prompt
        tokens alone; the full pages of their prompts."""
        outstanding = prefill = pages = 0
        for queue in (self.waiting, self.running):
            for r in queue:
                left = r.prefill_left()
                prefill += left
                outstanding += left + r.target - r.generated
                pages += r.spec.prompt_len // page_size
        return Loads(outstanding, prefill, pages)

    # -- one step -------------------------------------------------------------------

    def step(self) -> float | None:
        """One engine step from `clock.now`; returns when it ends (`now` itself when it only
        gave up on a request), or None when nothing could run (wait for an arrival)."""
        batch = self.schedule_running()
        budget = self.config.token_budget - sum(n for _, n in batch)
        before = len(batch)
        self.admit(batch, budget)
        admitted_now = len(batch) > before
        if not batch:
            if self.waiting and not self.running:
                # nothing runs and the head does not fit in an empty cache: it never will
                self.finish(self.waiting.popleft(), self.clock.now, aborted=True, admitted=False)
                return self.clock.now
            return None
        if self.lazy and not admitted_now and len(batch) == len(self.running):
            for r, _ in batch:
                self.flush(r)  # a decode window starts from committed state
        k = self.window_size(batch, admitted_now)
        if k > 1:
            return self.run_window(batch, k)
        return self.run_batch(batch)

    def schedule_running(self) -> Batch:
        """Give every running request its next chunk or decode token, within the budget,
        preempting the latest admitted when a grow does not fit."""
        budget = self.config.token_budget
        batch: Batch = []
        gone, page = self._gone, self.cache.page_size
        gone.clear()
        self._lagging.clear()
        for r in list(self.running):
            if budget == 0 or id(r) in gone:
                continue  # preempted by an earlier request of this step
            seq = r.seq
            start = seq.num_computed + r.lag
            n = min(len(seq) - start, budget)
            if (
                self.lazy
                and n == 1
                and start >= seq.prompt_len
                and start % page
                and start < len(seq.page_table) * page
                and (self.lazy_when is None or self.decode_step_excused(seq))
            ):
                self._lagging.add(id(r))  # a decode step inside a page it holds: no cache call
                batch.append((r, 1))
                budget -= 1
                continue
            if self.grow(r, start + n):
                batch.append((r, n))
                budget -= n
        if gone:
            batch = [(r, n) for r, n in batch if id(r) not in gone]
        return batch

    def grow(self, r: Request, num_tokens: int) -> bool:
        """Grow `r` to `num_tokens`, preempting the latest admitted until it fits; False when
        `r` itself was preempted or, alone and still without room, aborted."""
        self.flush(r)
        ops = self.client.grow(r.seq, num_tokens)
        while ops is None and self.preempt_latest(r):
            ops = self.client.grow(r.seq, num_tokens)
        if ops is None:
            if id(r) not in self._gone:
                self.running.remove(r)
                self.finish(r, self.clock.now, aborted=True)
            return False
        self.executor.apply_copies(ops)
        return True

    def admit(self, batch: Batch, budget: int) -> None:
        """Admit waiting requests into the step while budget, batch size and memory allow."""
        self.order_waiting()
        waiting, running, client = self.waiting, self.running, self.client
        # FCFS: the head blocks the line, so only the head is ever tried (O(1) per step)
        while waiting and budget > 0 and len(running) < self.config.max_running:
            r = waiting[0]
            seq = self.sequence(r)
            m = client.match(seq)
            n = min(len(seq) - m.num_tokens, budget)
            ops = client.admit(seq, m, m.num_tokens + n)
            if ops is None:
                break  # head of line blocks: later requests wait too (FCFS fairness)
            self.executor.apply_copies(ops)
            waiting.popleft()
            running.append(r)
            # a tiered cache may have loaded part of the hit back inside admit
            hit = r.seq.num_computed
            n -= hit - m.num_tokens
            if r.first_admit_hit is None:
                r.first_admit_hit = hit
            r.hit_tokens += hit
            r.host_hit_tokens += hit - m.num_tokens
            if hit > m.num_tokens:  # of those loaded back, from storage (L3)
                r.storage_hit_tokens += self.cache.storage_hit_tokens(r.seq)
            batch.append((r, n))
            budget -= n

    def order_waiting(self) -> None:
        """lpf: SGLang's longest-prefix-first, the longest cached prefix first (ties: arrival)."""
        if self.config.ordering != "lpf" or len(self.waiting) <= 1:
            return
        longest_first = [-self.client.match(self.sequence(r)).num_tokens for r in self.waiting]
        order = sorted(range(len(longest_first)), key=longest_first.__getitem__)  # stable: ties keep arrival order
        ordered = [self.waiting[i] for i in order]
        self.waiting.clear()
        self.waiting.extend(ordered)

    def run_batch(self, batch: Batch) -> float:
        """Run one step of `batch` on the executor; returns when it ends."""
        items = [(r.seq, n, r.seq.num_computed + r.lag) for r, n in batch]
        seconds, tokens = self.executor.step(items)
        end = self.clock.now + seconds
        self.result.steps += 1
        got = (r for (r, _), tok in zip(batch, tokens, strict=True) if tok is not None and r.sample_of is None)
        self.result.itl.step(got, end)
        for (r, n), tok in zip(batch, tokens, strict=True):
            self.postprocess(r, n, tok, end)
        self.record_pages(end)
        return end

    def postprocess(self, r: Request, n: int, tok: int | None, end: float) -> None:
        """Commit `r`'s computed tokens and take its sampled token (or its forced one)."""
        if id(r) in self._lagging:
            r.lag += n
        else:
            self.client.commit(r.seq, r.seq.num_computed + r.lag + n)
        r.computed_tokens += n
        if tok is None:
            return
        if r.forced is not None and r.generated < len(r.forced):
            tok = r.forced[r.generated]
        if r.generated == 0 and r.spec.n > 1 and r.sample_of is None:
            self.spawn_samples(r, tok, end)
        r.generated += 1
        r.output.append(tok)
        if r.first_token_at is None:
            r.first_token_at, r.first_token_step = end, self.result.steps - 1
        if r.generated >= r.target:
            r.finish_step = self.result.steps - 1
            self.running.remove(r)
            self.finish(r, end)
        else:
            r.seq.append_token(tok)

    # -- decisions ------------------------------------------------------------------

    def preempt_latest(self, r: Request) -> bool:
        """Serving's answer to memory pressure (vLLM V1): preempt the most recently admitted
        request; False (no retry) when that was `r` itself, or `r` is alone."""
        victim = self.running[-1]
        if victim is r and len(self.running) == 1:
            return False  # alone and still no room: it can never finish
        self.preempt(victim)
        return victim is not r

    def finish_oldest(self) -> bool:
        """Replay's answer to memory pressure: the oldest running request finishes, its pages
        become evictable; False when nothing is running."""
        if not self.running:
            return False
        self.finish(self.running.pop(0), self.clock.now)
        return True

    def preempt(self, r: Request) -> None:
        """Preempt `r` by recompute: release its pages; a fresh sequence holding every token
        so far waits at the front of the queue."""
        self.flush(r)
        self.client.release(r.seq)
        self.running.remove(r)
        old = r.seq
        r.seq = Sequence(old.request_id, old.tokens.copy(), old.extra, prefix_id=old.prefix_id)
        r.seq.cache_memo = old.cache_memo  # same tokens: the cache's per-sequence memo still holds
        r.preempted += 1
        self.result.preemptions += 1
        self._gone.add(id(r))
        self.waiting.appendleft(r)

    def finish(self, r: Request, at: float, *, aborted: bool = False, admitted: bool = True) -> None:
        """`r` is done (or given up on) at `at`: release it, record it, let its followers arrive."""
        if admitted:
            self.flush(r)
            for seq in (r.seq,) if r.group is None else r.group:
                self.client.release(seq)
        r.finished_at = at
        if self.keep_outputs:
            self.result.outputs[r.spec.request_id] = r.output
        self.clock.finished(r.spec.request_id, at)
        self.result.aborted += aborted
        rec = request_record(r, aborted)
        if self.tiered:
            rec.update(tier_record(r))
        self.result.requests.append(rec)

    def spawn_samples(self, r: Request, tok: int, now: float) -> None:
        """Fork samples 1..n-1 of `r` from its computed prompt; each samples its first token.
        A sample that cannot fork for want of pages waits and recomputes, like a preempted one."""
        lens = r.spec.output_lens
        r.target = max(lens[0], 1)
        self.flush(r)
        for j in range(1, r.spec.n):
            spec = dataclasses.replace(
                r.spec,
                request_id=f"{r.spec.request_id}/{j}",
                output_len=lens[j],
                n=1,
                sample_lens=None,
                forced_output=None,
            )
            first = self.executor.fresh_tokens(1)[0] if self.executor.samples_fresh_tokens else tok
            child = Request(
                spec,
                r.seq.fork(spec.request_id),
                sample_of=r.spec.request_id,
                first_admit_hit=0,
                arrival=r.arrival,
                index=r.index,
            )
            ops = self.client.fork(r.seq, child.seq)
            child.generated, child.first_token_at, child.first_token_step = 1, now, self.result.steps - 1
            child.output.append(first)
            if ops is None:
                child.seq = Sequence(spec.request_id, np.append(r.seq.tokens, np.int32(first)), r.seq.extra)
                self.waiting.appendleft(child)
                continue
            self.executor.apply_copies(ops)
            if child.generated >= child.target:
                self.finish(child, now)
            else:
                child.seq.append_token(first)
                self.running.append(child)

    def decode_step_excused(self, seq: Sequence) -> bool:
        """Under a conditional lazy promise (`lazy_when`), whether the cache calls of a decode
        step of `seq` inside a page it holds may be skipped now, at the moment they would
        come: a page is free (`DECODE_NOOPS_WHILE_FREE`), or the cache says `seq` writes
        no shared block (`DECODE_NOOPS_IF_PRIVATE`)."""
        if self.lazy_when == DECODE_NOOPS_WHILE_FREE:
            return self.cache.pages_free() > 0
        return self.cache.decode_steps_private(seq)  # DECODE_NOOPS_IF_PRIVATE (checked in __init__)

    def flush(self, r: Request) -> None:
        """Commit `r`'s batched decode tokens (before any grow, fork or release)."""
        if r.lag:
            self.client.commit(r.seq, r.seq.num_computed + r.lag)
            r.lag = 0

    def release_held(self) -> None:
        """The run is over: release what finished requests still hold (none here)."""

    def record_pages(self, at: float) -> None:
        pinned = self.cache.pages_pinned()
        res = self.result
        res.peak_pages = max(res.peak_pages, pinned)
        res.timeline.append((at, pinned))

    # -- decode windows -------------------------------------------------------------

    def window_size(self, batch: Batch, admitted_now: bool) -> int:
        """How many decode steps can be simulated at once, with exactly the outcome of taking
        them one by one (executors that `supports_decode_windows` only).

        Safe while nothing but decoding happens: no admission this step (so none in the
        window: memory only shrinks while decoding, budget and batch size stay), every
        running request is decoding, no request finishes before the last step, no arrival
        before it, and the pages the window needs are free or evictable, so no preemption.
        Which page ids are handed out can differ from step-by-step order; no hit, eviction
        count or timing can.
        """
        if admitted_now or not self.executor.supports_decode_windows or len(batch) != len(self.running):
            return 1
        if any(n != 1 or len(r.seq) - r.seq.num_computed != 1 for r, n in batch):
            return 1
        k = min(MAX_WINDOW, min(r.target - r.generated for r, _ in batch))
        if k <= 1:
            return 1
        computed = np.array([r.seq.num_computed for r, _ in batch], dtype=np.int64)
        pages = np.array([len(r.seq.page_table) for r, _ in batch], dtype=np.int64)
        k = _pages_limit(computed, pages, self.cache.page_size, self.cache.pages_reclaimable(), k)
        arrival = self.clock.next_arrival()
        if arrival is not None and k > 1:
            steps = self.executor.decode_step_seconds(computed, k - 1)
            starts = self.clock.now + np.concatenate(([0.0], np.cumsum(steps)))
            k = int(np.searchsorted(starts, arrival, side="left"))  # steps starting before it
        return max(k, 1)

    def run_window(self, batch: Batch, k: int) -> float:
        """Take `k` decode steps of `batch` at once; returns when the last ends."""
        computed = np.array([r.seq.num_computed for r, _ in batch], dtype=np.int64)
        steps = self.executor.decode_step_seconds(computed, k)
        end = self.clock.now + float(steps.sum())
        ends = (self.clock.now + np.cumsum(steps)).tolist()
        ends[-1] = end  # the window's end as summed above (cumulated, its last bits may differ)
        self.result.itl.window([r for r, _ in batch if r.sample_of is None], ends)
        for r, _ in batch:
            tokens = self.executor.fresh_tokens(k)
            if r.forced is not None:  # the request's recorded output overrides what was sampled
                lo = r.generated
                tokens[: max(0, min(k, len(r.forced) - lo))] = r.forced[lo : lo + k]
            r.seq.append(np.array(tokens[:-1], dtype=np.int32))
            target = r.seq.num_computed + k
            ops = self.client.grow(r.seq, target)
            if ops is None:
                raise RuntimeError("decode window ran out of pages; the window check is wrong")
            self.executor.apply_copies(ops)
            self.client.commit(r.seq, target)
            r.computed_tokens += k
            r.generated += k
            r.output.extend(tokens)
        self.result.steps += k
        for r, _ in batch:
            if r.generated >= r.target:
                r.finish_step = self.result.steps - 1
                self.running.remove(r)
                self.finish(r, end)
            else:
                r.seq.append_token(r.output[-1])
        self.record_pages(end)
        return end

    # -- the replay protocol (docs/design.md §6): one request at a time, run to completion ----

    def request(self, spec: RequestSpec) -> Request:
        """`spec` as a request of this scheduler, not queued (the replay driver admits it)."""
        return Request(spec, new_sequence(spec), arrival=self.clock.now)

    def admit_prompt(self, r: Request) -> bool:
        """Match and admit `r`'s whole prompt and commit it (replay prefills at once),
        finishing the oldest for room; False when it does not fit even with nothing running."""
        client, seq = self.client, r.seq
        while True:
            # match, admit and commit (one timed region); `hit`: the match, plus what a
            # tiered cache loaded back in admit
            m, ops, hit = client.prefill(seq)
            if ops is not None:
                break
            if not self.finish_oldest():
                return False
        self.executor.apply_copies(ops)  # (a copy goes before the next KV write: none here)
        r.first_admit_hit = hit
        r.hit_tokens += hit
        r.host_hit_tokens += hit - m.num_tokens
        if hit > m.num_tokens:  # of those loaded back, from storage (L3)
            r.storage_hit_tokens += self.cache.storage_hit_tokens(seq)
        r.computed_tokens += len(seq) - hit
        return True

    def run_to_completion(self, r: Request) -> None:
        """Decode `r`'s whole plan (its samples, or its beam schedule) at once; it then joins
        the running list, unless even alone there was no room for its beams."""
        if r.spec.beam_width > 1:
            if not self.run_beams(r):
                r.truncated += 1  # ran out of room even alone: the request stops early
                return
        else:
            self.run_samples(r)
        self.running.append(r)

    def run_samples(self, r: Request) -> None:
        """Fork the `n - 1` samples, decode each, then the request itself; `r.group` is the
        request and the samples that forked."""
        spec, seq = r.spec, r.seq
        lens = spec.output_lens
        group = r.group = [seq]
        for j in range(1, spec.n):
            child = seq.fork(f"{spec.request_id}/{j}")
            if not self.fork_for_room(seq, child):
                r.truncated += 1  # no room even for this sample: it is dropped
                continue
            group.append(child)
            # Even alone a sample that cannot hold its output stops early.
            r.truncated += not self.decode_all(child, lens[j])
        r.truncated += not self.decode_all(seq, lens[0], spec.forced_output)
        r.generated = lens[0]

    def decode_all(self, seq: Sequence, output_len: int, forced: np.ndarray | None = None) -> bool:
        """Append `output_len` tokens (`forced` ones first, then fresh ids) and give all but
        the last KV (it is never fed back, as in vLLM); False if no room."""
        start = len(seq)
        if output_len > 0 and forced is None:
            seq.extend_ids(self.executor.fresh_token_run(output_len))  # one run, checked at its ends
        elif output_len > 0:
            given = np.asarray(forced[:output_len], dtype=np.int32)
            run = self.executor.fresh_token_run(output_len - len(given))
            seq.append(np.concatenate([given, np.arange(run.start, run.stop, dtype=np.int32)]))
        target = start + max(output_len - 1, 0)
        if target <= seq.num_computed:
            return True
        return self.write_for_room(seq, target)

    def write_for_room(self, seq: Sequence, target: int) -> bool:
        """Grow and commit `seq` to `target` tokens, finishing the oldest for room."""
        while True:
            ops = self.client.grow_commit(seq, target)
            if ops is not None:
                self.executor.apply_copies(ops)
                return True
            if not self.finish_oldest():
                return False

    def fork_for_room(self, parent: Sequence, child: Sequence) -> bool:
        """Fork `child` from `parent`, finishing the oldest for room; False if no room."""
        while True:
            ops = self.client.fork(parent, child)
            if ops is not None:
                self.executor.apply_copies(ops)
                return True
            if not self.finish_oldest():
                return False

    def run_beams(self, r: Request) -> bool:
        """Follow `r`'s beam schedule from its computed prompt: `r.group` is the live beams at
        the end; False (all released) when even alone there is no room."""
        beams, forks = [r.seq], 0
        schedule = r.spec.beam_parents
        for t, parents in enumerate(schedule):
            counts = np.bincount(np.asarray(parents, dtype=np.int64), minlength=len(beams)).tolist()
            self.release_all([b for b, k in zip(beams, counts, strict=True) if k == 0])  # pruned first
            kept: list[Sequence] = []
            for i, (b, k) in enumerate(zip(beams, counts, strict=True)):
                if k:
                    kept.append(b)
                for _ in range(k - 1):
                    forks += 1
                    child = b.fork(f"{r.spec.request_id}/b{forks}")
                    if not self.fork_for_room(b, child):
                        self.release_all(kept + [x for x, c in zip(beams[i + 1 :], counts[i + 1 :], strict=True) if c])
                        return False
                    kept.append(child)
            beams = kept
            if t + 1 < len(schedule) and not self.extend_beams(beams):  # last step: never fed back
                return False
        r.group = beams
        return True

    def extend_beams(self, beams: list[Sequence]) -> bool:
        """One fresh token on every beam, with KV; False (all released) when there is no room."""
        for b in beams:
            b.append_token(self.executor.fresh_tokens(1)[0])
            if not self.write_for_room(b, len(b)):
                self.release_all(beams)
                return False
        return True

    def release_all(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.client.release(seq)


def _pages_limit(computed: np.ndarray, pages: np.ndarray, page_size: int, spare: int, k: int) -> int:
    """The most decode steps (at most `k`) whose new pages fit in `spare` (one always does:
    this step's grow succeeded)."""
    if _new_pages(computed, pages, page_size, k) <= spare:
        return k
    lo, hi = 1, k
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _new_pages(computed, pages, page_size, mid) <= spare else (lo, mid - 1)
    return lo


def _new_pages(computed: np.ndarray, pages: np.ndarray, page_size: int, steps: int) -> int:
    """Pages a batch needs beyond the ones it holds to decode `steps` more tokens each."""
    return int(np.maximum(-(-(computed + steps) // page_size) - pages, 0).sum())
