"""`VllmScheduler`: the serving scheduler that makes vLLM 0.33's V1 decisions (`--scheduler vllm`).

Follows `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`, `_update_after_schedule`,
`update_from_output`, `_preempt_request`) and `async_scheduler.py` of vLLM 0.33.0, FCFS, no
speculative decoding, no KV connector. Checked request for request against the real
scheduler (tests/fixtures/vllm_0_33/, tests/test_vllm_scheduler.py). The rules:

1. A step has a token budget. Running requests go first, in admission order (a re-admitted
   request joins at the end): each gets `min(tokens left, budget left)`, the rest of its
   prefill or one decode token.
2. When a running request's allocation fails, the *last* running request is preempted
   (its pages released, its computed count reset to 0, to the *front* of the waiting
   queue) and the allocation retried; when the victim is the request itself the running
   pass stops.
3. No admission in a step that preempted. Otherwise waiting requests in order while budget
   remains and fewer than `max_running` run: hit = the cache's match (at most length - 1),
   first chunk = `min(tokens - hit, budget left)`, and the request must fit *as a whole*
   (`scheduler_reserve_full_isl`, vLLM's default): `cache.can_admit(seq, match, len(seq))`.
   If it does not, the pass stops; no request behind it is tried.
4. Pages are published (`commit`, vLLM's `cache_blocks`) when they are allocated, so a later
   request of the same step hits them. vLLM publishes only known tokens:
   `min(computed + new, num_tokens)`.
5. A token is sampled only when a chunk reaches the end of the request's tokens (with async,
   its in-flight ones); the last sampled token never gets KV.

Async scheduling (vLLM's `AsyncScheduler`; the engine loop is `serving.drive_async`): a step
is scheduled while the previous one is still in flight. A decoding request then holds an
output *placeholder* and is scheduled again before its token is known; one whose in-flight
token will be its last is skipped; a request preempted with output in flight delivers it
later (`stale`), is not re-admitted before that, and finishes in the waiting queue if that
output was its last.

`serve` runs the synchronous loop of an executor that prices steps (cost model, fixed) on
`vllm_rows.VllmRowScheduler`: these decisions with the running batch held as numpy rows
(tests/test_vllm_rows.py checks the two loops agree on everything they report). This class
stays the reference, and runs async scheduling and the model executor.

Each `Request` carries vLLM's counters in `r.vllm` (`VllmCounters`). The tokens a request
samples are appended to its `Sequence` as soon as the executor returns them (the model
needs them in the next step), while `known` counts what vLLM has delivered: only known
tokens are published.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from cachelib.tiers import PREFETCH_TIMEOUT_BASE_S, PREFETCH_TIMEOUT_PER_KI_TOKEN_S, TierTransfer
from cachelib.types import CopyOp, Sequence
from experiments.engine.request import Request
from experiments.engine.scheduler import Scheduler, _new_pages, _pages_limit
from experiments.engine.transfers import TransferClock
from experiments.workloads.spec import RequestSpec


@dataclass(slots=True)
class VllmCounters:
    """vLLM's per-request counters (`vllm.v1.request.Request`)."""

    known: int  # num_tokens: prompt + outputs delivered
    computed: int = 0  # num_computed_tokens: scheduled so far, in-flight steps included
    placeholders: int = 0  # num_output_placeholders: sampled in flight, not delivered (async)
    in_flight: int = 0  # num_in_flight_tokens: scheduled in steps not yet processed
    stale: int = 0  # num_stale_output_tokens: in flight when preempted (async)
    prefill_chunk: bool = True  # is_prefill_chunk after its last scheduling
    running: bool = False  # status RUNNING (in the running list), else waiting or done


@dataclass(slots=True)
class StepPlan:
    """One `schedule()`: what each request computes, from which position, and whether it
    preempted; `index` is its step number once executed (None: an empty step)."""

    items: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, tokens, start)
    preempted: bool = False
    admitted: bool = False
    index: int | None = None
    end: float = 0.0
    tokens: list[int | None] = field(default_factory=list)  # per item: the token it sampled, if any

    @property
    def empty(self) -> bool:
        """Nothing scheduled: the step takes no time."""
        return not self.items


class VllmScheduler(Scheduler):
    """One replica scheduling as vLLM 0.33's V1 `Scheduler` (FCFS)."""

    policy: ClassVar[str] = "vllm"
    #: it prices a tiered cache's transfers on the serving clock (`config.time_transfers`)
    prices_transfers: ClassVar[bool] = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A decode step inside a page the table already holds publishes nothing on backends
        # that promise so: its grow and commit are skipped and the commit batched (`r.lag`)
        # until the page fills or the request is released (synchronous loop only: async
        # publishes known tokens only, which the batched count does not track). Under a
        # conditional promise (`lazy_when`, set by `Scheduler`) a step is skipped only when
        # its condition holds (`decode_step_excused`).
        self.lazy = (
            self.cache.decode_steps_are_noops or self.lazy_when is not None
        ) and not self.config.async_scheduling
        # ... and so is one whose token fills a page, past the prompt, on a backend whose
        # commits there publish nothing (`commit_publishes_decode` False: none, radix)
        self.quiet_fills = self.lazy and not self.cache.commit_publishes_decode
        self.gpu_free = 0.0  # when the last non-empty step ends
        self.finished_pending = False  # vLLM's finished_req_ids: one more schedule() after a finish
        self.async_scheduling = self.config.async_scheduling
        #: tier transfers priced on the serving clock (experiments/engine/transfers.py), or
        #: None: the cache has no tiers, or `config.time_transfers` is off (they are instant)
        self.transfers: TransferClock | None = None
        self.loading: deque[Request] = deque()  # vLLM's kv_holding_waiting: admitted, loading
        self.held: list[tuple[float, Sequence]] = []  # finished, blocks kept until stores end
        self._step_transfers: list = []  # decided while scheduling this step, not yet issued
        #: request id -> its storage prefetch in flight (`storage_prefetch_ready`); ids that
        #: prefetched once (a re-admission's prefetch starts when it is considered again)
        self._prefetches: dict[str, _Prefetch] = {}
        self._prefetched: set[str] = set()
        if self.prices_transfers and self.config.time_transfers and self.tiered and self.cache.load_timing is not None:
            self.transfers = TransferClock(self.cache, self.executor.num_layers)

    @property
    def has_requests(self) -> bool:
        """vLLM's `has_requests()`: unfinished requests, or finished ones not yet reported."""
        return bool(self.waiting or self.running or self.loading) or self.finished_pending

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def add(self, spec: RequestSpec, arrival: float, index: int = -1) -> None:
        """A request arrives at the back of the waiting queue. One with `n` parallel samples
        arrives as `n` requests, as vLLM's front end fans it out (`ParentRequest`): they
        share the prompt through the prefix cache, not by forking."""
        lens = spec.output_lens
        for j in range(spec.n):
            one = spec
            if spec.n > 1:
                rid = spec.request_id if j == 0 else f"{spec.request_id}/{j}"
                forced = spec.forced_output if j == 0 else None
                one = dataclasses.replace(
                    spec, request_id=rid, output_len=lens[j], n=1, sample_lens=None, forced_output=forced
                )
            # its sequence is built when it is first considered (`Scheduler.sequence`)
            r = Request(one, None, arrival=arrival, index=index, sample_of=spec.request_id if j else None)
            r.vllm = VllmCounters(known=one.prompt_len)
            self.waiting.append(r)

    def stuck(self, plan: StepPlan) -> bool:
        """An empty step with nothing running: only a waiting head that cannot fit even the
        empty cache leaves it so (a step that preempted the last running request admits
        nothing by rule 3; the next one takes the request back)."""
        return (
            plan.empty
            and not plan.preempted
            and not self.running
            and bool(self.waiting)
            and (self.transfers is None or self.next_transfer_event(after=self.clock.now) is None)
        )

    def give_up_on_head(self) -> None:
        """Nothing runs or is in flight and the head cannot fit even the empty cache: it
        never will. vLLM would wait forever; the head is recorded as aborted instead."""
        self.finish(self.waiting.popleft(), self.clock.now, aborted=True, admitted=False)

    # -- the synchronous loop's step ----------------------------------------------------

    def step(self) -> float | None:
        """`EngineCore.step`: schedule, execute, process; returns when the step ends (`now`
        for an empty one, after aborting a head that can never fit: `stuck`)."""
        plan = self.schedule()
        if plan.empty:
            if self.stuck(plan):
                self.give_up_on_head()
            elif self.transfers is not None:
                return self.wake_time(self.clock.now)
            return self.clock.now
        k = self.window_steps(plan)
        if k > 1:
            return self.run_decode_window(plan, k)
        self.execute(plan)
        self.process(plan)
        return plan.end

    # -- schedule() ------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """`Scheduler.schedule()`: the running pass, then (unless it preempted) admissions."""
        plan = StepPlan()
        if self.transfers is not None:
            self.poll_transfers()
        budget = self.schedule_running_pass(plan)
        if not plan.preempted:
            self.admit_waiting(plan, budget)
        self.after_schedule(plan)
        self.finished_pending = False
        return plan

    def schedule_running_pass(self, plan: StepPlan) -> int:
        """Rules 1 and 2; returns the budget left. (This loop runs for every running request
        of every step: the common case, a decode step inside a held page, stays inline.)"""
        budget = self.config.token_budget
        running, items = self.running, plan.items
        page = self.cache.page_size
        lazy, conditional, quiet_fills = self.lazy, self.lazy_when is not None, self.quiet_fills
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            v = r.vllm
            i += 1
            if v.placeholders > 0 and v.computed + 2 - v.placeholders >= r.spec.prompt_len + r.target:
                continue  # async: its in-flight token is its last; no extra step
            n = v.known + v.placeholders - v.computed
            if n > budget:
                n = budget
            elif n == 0:
                continue
            end = v.computed + n
            if (
                lazy
                and n == 1
                and end > r.seq.prompt_len  # a generated token (a one-token prefill chunk calls)
                and (end % page or quiet_fills)
                and end <= len(r.seq.page_table) * page
                and (not conditional or self.decode_step_excused(r.seq))
            ):
                r.lag = end - r.seq.num_computed  # no new page, none published: nothing to call
            elif not self.allocate(r, n, plan):
                break  # it preempted itself: the running pass stops
            items.append((r, n, v.computed))
            budget -= n
        return budget

    def allocate(self, r: Request, n: int, plan: StepPlan, *, publish: bool = True) -> bool:
        """`allocate_slots` for a running request, preempting the last running request
        until it fits; False when `r` itself was preempted. `publish=False`: the caller
        knows the commit would publish nothing (a lazy decode step into a new page)."""
        v = r.vllm
        end = v.computed + n
        published = min(end, v.known) if publish else 0
        # flush, grow and publish in one timed region (`CacheClient.advance`: the same calls)
        lag, r.lag = r.lag, 0
        ops = self.client.advance(r.seq, r.seq.num_computed + lag, end, published)
        if ops is None:
            ops = self.preempt_for(r, end, published, plan)
            if ops is None:
                return False
        self.executor.apply_copies(ops)
        return True

    def preempt_for(self, r: Request, end: int, published: int, plan: StepPlan) -> list[CopyOp] | None:
        """Rule 2 once `r`'s grow to `end` did not fit: preempt the last running request and
        retry (publishing to `published` when it fits) until it does; None when `r` itself
        was preempted."""
        while True:
            victim = self.running.pop()
            self.preempt_request(victim)
            plan.preempted = True
            if victim is r:
                return None
            ops = self.client.advance(r.seq, 0, end, published)
            if ops is not None:
                return ops

    def admit_waiting(self, plan: StepPlan, budget: int) -> None:
        """Rule 3: FCFS admissions while budget and the running limit allow; the first
        request whose whole sequence does not fit stops the pass."""
        waiting, client = self.waiting, self.client
        if self.loading:
            budget = self.admit_loaded(plan, budget)
            if budget < 0:
                return  # a loaded request did not fit: vLLM's waiting pass stops there
        skipped: list[Request] = []
        while waiting and budget > 0 and len(self.running) < self.config.max_running:
            r = waiting[0]
            if r.vllm.stale:
                skipped.append(waiting.popleft())  # output still in flight: resume later
                continue
            seq = self.sequence(r)
            m = client.match(seq)
            if self.transfers is not None and not self.storage_prefetch_ready(r, m):
                skipped.append(waiting.popleft())  # SGLang skips it this round (prefetching)
                continue
            if not client.can_admit(seq, m, len(seq)):
                break
            n = min(len(seq) - m.num_tokens, budget)
            ops = client.admit(seq, m, m.num_tokens + n)
            if ops is None:  # cannot happen after can_admit; refuse loudly rather than guess
                raise RuntimeError(f"{self.cache.name}: admit refused what can_admit accepted")
            self.executor.apply_copies(ops)
            waiting.popleft()
            if self._prefetches:
                self.prefetch_admitted(r)
            # a tiered cache may have loaded part of the hit back inside admit
            hit = seq.num_computed
            if self.transfers is not None and self.loads_async(r, hit - m.num_tokens):
                continue  # WAITING_FOR_REMOTE_KVS: scheduled once its load completes
            self.running.append(r)
            n -= hit - m.num_tokens
            r.vllm.running = True
            r.vllm.computed = hit
            self.publish(r, hit + n)
            if r.first_admit_hit is None:
                r.first_admit_hit = hit
            r.hit_tokens += hit
            r.host_hit_tokens += hit - m.num_tokens
            if hit > m.num_tokens:  # of those loaded back, from storage (L3)
                r.storage_hit_tokens += self.cache.storage_hit_tokens(seq)
            plan.items.append((r, n, hit))
            plan.admitted = True
            budget -= n
        waiting.extendleft(reversed(skipped))  # back in front, in their order

    def after_schedule(self, plan: StepPlan) -> None:
        """`_update_after_schedule` (+ the async placeholders)."""
        for r, n, _ in plan.items:
            v = r.vllm
            v.computed += n
            v.in_flight += n
            v.prefill_chunk = v.computed < v.known + v.placeholders
            if self.async_scheduling and not v.prefill_chunk:
                v.placeholders += 1

    def publish(self, r: Request, num_tokens: int) -> None:
        """`cache_blocks`: publish `r`'s pages up to `num_tokens` (never backwards)."""
        if num_tokens > r.seq.num_computed:
            self.client.commit(r.seq, num_tokens)

    def preempt_request(self, r: Request) -> None:
        """`_preempt_request`: release its pages; it waits at the front with every token
        so far, its in-flight output marked stale."""
        self.flush(r)
        self.client.release(r.seq)
        old = r.seq
        r.seq = Sequence(old.request_id, old.tokens.copy(), old.extra, prefix_id=old.prefix_id)
        r.seq.cache_memo = old.cache_memo  # same tokens: the cache's per-sequence memo still holds
        v = r.vllm
        v.running = False
        v.computed = 0
        v.stale = v.in_flight
        v.placeholders = 0
        r.preempted += 1
        self.result.preemptions += 1
        self.waiting.appendleft(r)

    # -- execute and process ------------------------------------------------------------

    def execute(self, plan: StepPlan) -> None:
        """The model runs the step from `max(now, gpu_free)`; an empty step takes no time.
        Sampled tokens join their sequences at once (the next step computes their KV)."""
        start = max(self.clock.now, self.gpu_free)
        if self.transfers is not None:
            start = self.after_blocking_transfers(start)
        if not plan.items:
            plan.end = start if self.transfers is None else self.wake_time(start)
            return
        seconds, tokens = self.executor.step([(r.seq, n, s) for r, n, s in plan.items])
        if self.transfers is not None:
            seconds = self.price_transfers(plan, start, seconds)
        plan.end = self.gpu_free = start + seconds
        plan.index = self.result.steps
        self.result.steps += 1
        for k, ((r, n, _), tok) in enumerate(zip(plan.items, tokens, strict=True)):
            r.computed_tokens += n
            if tok is not None:
                if r.forced is not None:
                    sampled = len(r.seq) - r.spec.prompt_len  # its outputs before this one
                    if sampled < len(r.forced):
                        tok = tokens[k] = r.forced[sampled]  # the recorded output overrides the sample
                r.seq.append_token(tok)
        plan.tokens = tokens
        self.record_pages(plan.end)

    def process(self, plan: StepPlan) -> None:
        """`update_from_output`: deliver each sampled token, publish, finish what stopped.
        Who got a token at the step's end goes to the replica's `TokenGaps` (ITL; parallel
        samples are left out, as TTFT and TPOT leave them out)."""
        timed: list[Request] = []
        for (r, n, _), tok in zip(plan.items, plan.tokens, strict=True):
            if r.finished_at is not None:
                continue  # finished while this step was in flight: vLLM forgot it
            v = r.vllm
            v.in_flight -= n
            stale = v.stale > 0
            if stale:
                v.stale -= n
            if tok is None:
                continue
            had_placeholders = v.placeholders > 0
            # deliver: the oldest undelivered token (steps are processed in order)
            if r.sample_of is None:
                timed.append(r)
            r.output.append(tok)
            v.known += 1
            r.generated += 1
            if r.first_token_at is None:
                r.first_token_at, r.first_token_step = plan.end, plan.index
            if had_placeholders and not stale:
                v.placeholders -= 1
                if v.running:
                    self.publish(r, min(v.computed - v.in_flight, v.known))
            if r.generated >= r.target:
                self.stop(r, plan.end, plan.index)
        self.result.itl.step(timed, plan.end)

    def stop(self, r: Request, at: float, step: int | None) -> None:
        """`r` produced its last token: out of its queue, released, recorded."""
        r.finish_step = step
        if r.vllm.running:
            r.vllm.running = False
            self.running.remove(r)
            self.finish(r, at)
        else:  # preempted with its last token in flight: it holds no pages
            self.waiting.remove(r)
            self.finish(r, at, admitted=False)
        self.finished_pending = True

    # -- decode windows (executors that price k decode steps at once) -----------------

    def window_steps(self, plan: StepPlan) -> int:
        """How many steps, this one first, can be taken at once with the outcome of taking
        them one by one (synchronous loop only; see `Scheduler.window_size`): every
        running request decodes one known token, none was admitted or preempted, none
        finishes before the last, no arrival before it, and the pages fit without
        preemption. A waiting request stays out: budget and batch size stay, and the
        pages it would need only get scarcer."""
        if self.async_scheduling or not self.executor.supports_decode_windows:
            return 1
        items = plan.items
        if plan.admitted or plan.preempted or len(items) != len(self.running) or not items:
            return 1
        for r, n, start in items:
            if n != 1 or start + 1 != r.vllm.known or r.generated == 0:
                return 1
        k = min(MAX_WINDOW, min(r.target - r.generated for r, _, _ in items))
        if k <= 1:
            return 1
        covered = np.array([s + 1 for _, _, s in items], dtype=np.int64)
        pages = np.array([len(r.seq.page_table) for r, _, _ in items], dtype=np.int64)
        spare = self.cache.pages_reclaimable()
        if _new_pages(covered, pages, self.cache.page_size, 1) > spare:
            return 1  # even the second step would preempt
        k = 1 + _pages_limit(covered, pages, self.cache.page_size, spare, k - 1)
        arrival = self.clock.next_arrival()
        if self.transfers is not None:
            arrival = self.next_transfer_event(arrival)  # a window must not pass a poll that matters
        if arrival is not None and k > 1:
            starts = self.step_starts(np.array([s for _, _, s in items], dtype=np.int64), k)
            k = int(np.searchsorted(starts, arrival, side="left"))  # steps starting before it
        return max(k, 1)

    def step_starts(self, computed: np.ndarray, k: int) -> np.ndarray:
        """When each of `k` decode steps starts, accumulated one step at a time from now
        (`np.cumsum` adds sequentially: the same floats as stepping)."""
        steps = self.executor.decode_step_seconds(computed, k)
        return np.cumsum(np.concatenate(([self.clock.now], steps[:-1])))

    def run_decode_window(self, plan: StepPlan, k: int) -> float:
        """Take `k` decode steps of every running request at once; returns when the last ends."""
        items = plan.items
        computed = np.array([s for _, _, s in items], dtype=np.int64)
        steps = self.executor.decode_step_seconds(computed, k)
        ends = np.cumsum(np.concatenate(([self.clock.now], steps)))[1:]
        first = self.result.steps
        self.result.steps += k
        end = float(ends[-1])
        self.gpu_free = end
        for r, _, start in items:
            self.flush(r)
            tokens = self.executor.fresh_tokens(k)
            if r.forced is not None:  # the request's recorded output overrides what was sampled
                lo = r.generated
                tokens[: max(0, min(k, len(r.forced) - lo))] = r.forced[lo : lo + k]
            r.seq.append(np.array(tokens, dtype=np.int32))
            ops = self.client.grow(r.seq, start + k)
            if ops is None:
                raise RuntimeError("decode window ran out of pages; the window check is wrong")
            self.executor.apply_copies(ops)
            v = r.vllm
            v.computed, v.known = start + k, v.known + k
            v.in_flight -= 1  # this step's, counted by after_schedule: all k are processed here
            self.publish(r, start + k)
            r.computed_tokens += k
            r.generated += k
            r.output.extend(tokens)
        self.result.itl.window([r for r, _, _ in items if r.sample_of is None], ends.tolist())
        for r, _, _ in items:
            if r.generated >= r.target:
                self.stop(r, end, first + k - 1)
        self.record_pages(end)
        return end

    # -- tier transfers on the serving clock (experiments/engine/transfers.py) ------------

    def poll_transfers(self) -> None:
        """The scheduler's poll before it schedules: transfers decided since the last step
        (backups of released requests) start now; completed tickets are acknowledged (a
        backed-up node unlocks); finished requests whose stores are done release their
        blocks."""
        tc, now = self.transfers, self.clock.now
        for t in self._step_transfers:  # decided in a schedule that ran no step
            tc.issue(t, now)
        self._step_transfers = []
        tc.issue_all(now)
        tc.poll(now)
        # the poll's acknowledgements may start storage writes (a backup's ack): from now
        self._step_transfers += tc.issue_all(now)
        if self.held:
            keep = []
            for done, seq in self.held:
                if done <= now:
                    self.client.release(seq)
                else:
                    keep.append((done, seq))
            self.held = keep

    def loads_async(self, r: Request, loaded: int) -> bool:
        """Right after `r`'s admission: under `async` load timing, a request whose hit needed
        a load waits for it out of the running list (True); the load starts with the step."""
        tc = self.transfers
        if not loaded or tc.layerwise or tc.connector:
            return False  # loaded inside its step (`price_transfers`)
        start = max(self.clock.now, self.gpu_free)
        for t in tc.cache.take_transfers():
            if t.to_gpu:
                tc.issue(t, start)
            else:
                self._step_transfers.append(t)
        v = r.vllm
        v.computed = r.seq.num_computed
        if r.first_admit_hit is None:
            r.first_admit_hit = v.computed
        r.hit_tokens += v.computed
        r.host_hit_tokens += loaded
        r.storage_hit_tokens += self.cache.storage_hit_tokens(r.seq)
        r.load_wait_s -= start  # + the time it is scheduled (`admit_loaded`)
        self.loading.append(r)
        return True

    def admit_loaded(self, plan: StepPlan, budget: int) -> int:
        """vLLM's pass over `kv_holding_waiting`, before the waiting queue: a request whose
        load completed by now is scheduled (its loaded blocks published, the rest of its
        prompt from its computed count); one still loading is skipped. Returns the budget
        left, or -1 when an allocation failed (the waiting pass stops)."""
        tc, now = self.transfers, self.clock.now
        kept: list[Request] = []
        out = budget
        while self.loading and out > 0 and len(self.running) < self.config.max_running:
            r = self.loading.popleft()
            if tc.load_ready[r.spec.request_id] > now:
                kept.append(r)  # still WAITING_FOR_REMOTE_KVS
                continue
            v = r.vllm
            n = min(len(r.seq) - v.computed, out)
            ops = self.client.grow(r.seq, v.computed + n)
            if ops is None:
                kept.append(r)
                out = -1
                break
            self.executor.apply_copies(ops)
            del tc.load_ready[r.spec.request_id]
            self.publish(r, v.computed + n)
            self.running.append(r)
            v.running = True
            r.load_wait_s += now
            plan.items.append((r, n, v.computed))
            plan.admitted = True
            out -= n
        self.loading.extendleft(reversed(kept))
        return out

    def after_blocking_transfers(self, start: float) -> float:
        """A step starts once the transfers the scheduler waits for are done (SGLang's
        write_back backups of evicted nodes)."""
        tc = self.transfers
        self._step_transfers.extend(tc.cache.take_transfers())
        for t in self._step_transfers:
            if t.blocking:
                tc.issue(t, self.clock.now)
        self._step_transfers = [t for t in self._step_transfers if not t.blocking]
        if tc.blocked_until > start:
            tc.blocked_seconds += tc.blocked_until - start
            start = tc.blocked_until
        return start

    def price_transfers(self, plan: StepPlan, start: float, compute: float) -> float:
        """The step's seconds with its load-backs overlapped layer by layer (`layerwise`);
        backups and stores decided in this step start when its KV is written (its end)."""
        tc = self.transfers
        if tc.connector:
            return self.price_connector_step(plan, start, compute)
        decided, self._step_transfers = self._step_transfers, []
        loads = [t for t in decided if t.to_gpu]
        seconds, stall = tc.step_seconds(compute, loads, start)
        if stall:
            loaders = {t.request_id for t in loads}
            for r, _, _ in plan.items:
                if r.spec.request_id in loaders:
                    r.load_stall_s += stall
        end = start + seconds
        for t in decided:
            if not t.to_gpu and not t.blocking:
                tc.issue(t, end)
        return seconds

    def price_connector_step(self, plan: StepPlan, start: float, compute: float) -> float:
        """The step's seconds under LMCache's connector: its loads before the forward and its
        stores after it (`TransferClock.connector_step_seconds`); the load stall is charged
        to each request that loaded in it."""
        tc = self.transfers
        decided, self._step_transfers = self._step_transfers, []
        seconds, load_stall, _ = tc.connector_step_seconds(compute, decided, start)
        loaders = {t.request_id for t in decided if t.to_gpu}
        for rid in loaders:
            tc.load_ready.pop(rid, None)  # done inside this step: nothing waits on it
        if load_stall:
            for r, _, _ in plan.items:
                if r.spec.request_id in loaders:
                    r.load_stall_s += load_stall
        return seconds

    def next_transfer_event(self, arrival: float | None = None, after: float | None = None) -> float | None:
        """The earliest of `arrival` and what a poll would act on: a load that completes, a
        ticket, a held request's stores; with `after`, only what comes later than that (a
        prefetch that completed while its request did not fit is no event to wait for)."""
        tc = self.transfers
        times = [t for t in (arrival, tc.next_completion()) if t is not None]
        times += [tc.load_ready[r.spec.request_id] for r in self.loading]
        times += [done for done, _ in self.held]
        if self._prefetches:
            times += self.prefetch_wake_times()
        if after is not None:
            times = [t for t in times if t > after]
        return min(times) if times else None

    def wake_time(self, now: float) -> float:
        """When an empty step should look again: the next transfer event or arrival after
        `now` (`now` itself when nothing is pending: the caller then sees it `stuck`)."""
        t = self.next_transfer_event(self.clock.next_arrival(), after=now)
        return now if t is None else t

    def finish(self, r: Request, at: float, *, aborted: bool = False, admitted: bool = True) -> None:
        """`Scheduler.finish`; a finished request whose stores are still in flight keeps its
        blocks until they complete (vLLM's `request_finished` -> `delay_free_blocks`)."""
        if admitted and self.transfers is not None:
            done = self.transfers.store_done.pop(r.spec.request_id, 0.0)
            if done > at and r.group is None:
                self.flush(r)
                self.held.append((done, r.seq))
                admitted = False
        super().finish(r, at, aborted=aborted, admitted=admitted)

    def release_held(self) -> None:
        """The run is over: release what finished requests still held for their stores, and
        start the transfers decided in a schedule that ran no step."""
        for _, seq in self.held:
            self.client.release(seq)
        self.held = []
        for t in self._step_transfers:
            self.transfers.issue(t, self.clock.now)
        self._step_transfers = []

    # -- storage prefetches on the serving clock (SGLang 0.5.23 HiCache storage) -----------

    def storage_prefetch_ready(self, r: Request, m) -> bool:
        """Whether `r` may be scheduled now as far as its storage prefetch goes (SGLang's
        `check_prefetch_progress`, `_can_terminate_prefetch`), telling the cache what
        arrived (`limit_prefetch`). The prefetch is the read the cache reports for `r`
        (`storage_prefetch`) queued on the one storage -> host stream from `r`'s
        arrival, when SGLang issues it (`_prefetch_kvcache`); it is placed when `r` is
        first considered, so its size is the one storage gives then. `best_effort` takes
        the whole pages arrived; `wait_complete` waits for all; `timeout` waits until
        `PREFETCH_TIMEOUT_BASE_S` + `PREFETCH_TIMEOUT_PER_KI_TOKEN_S` per 1024 tokens after
        the first poll it blocked, then takes what arrived."""
        tc, now = self.transfers, self.clock.now
        rid = r.spec.request_id
        p = self._prefetches.get(rid)
        if p is None:
            asked, size = self.cache.storage_prefetch(r.seq, m)
            if not size:
                return True
            at = now if rid in self._prefetched else r.arrival
            self._prefetched.add(rid)
            seconds = self.cache.tier_link_seconds("storage", "host", size)
            done = tc.issue(TierTransfer("storage", "host", size), at)
            p = self._prefetches[rid] = _Prefetch(done - seconds, done, size, asked)
        if now >= p.done:
            p.arrived = p.size
        else:
            policy = self.cache.prefetch_policy
            if p.blocked is None:
                p.blocked = now
            if policy == "wait_complete":
                return False
            if policy == "timeout" and now < p.blocked + self.prefetch_timeout(p.asked):
                return False
            page = self.cache.page_size
            per_page = self.cache.tier_link_seconds("storage", "host", page)
            p.arrived = min(p.size, int((now - p.start) / per_page + 1e-9) * page)
        if p.blocked is not None and p.released is None:
            p.released = now  # what it waited for the prefetch (not for room after it)
        self.cache.limit_prefetch(r.seq, p.arrived)
        return True

    @staticmethod
    def prefetch_timeout(tokens: int) -> float:
        """SGLang's `timeout` budget for a prefetch asking for `tokens` tokens."""
        return PREFETCH_TIMEOUT_BASE_S + tokens / 1024 * PREFETCH_TIMEOUT_PER_KI_TOKEN_S

    def prefetch_admitted(self, r: Request) -> None:
        """`r` was admitted: its prefetch ends (what did not arrive is not read: the stream
        is freed if nothing queued behind it), its wait is recorded."""
        p = self._prefetches.pop(r.spec.request_id, None)
        if p is None:
            return
        tc, now = self.transfers, self.clock.now
        if p.blocked is not None:
            r.prefetch_wait_s += p.released - p.blocked
        if p.arrived < p.size:  # terminated early (`terminate_prefetch`)
            tc.tokens_moved["storage_to_host"] -= p.size - p.arrived
            link = ("storage", "host")
            if tc.link_free.get(link) == p.done:
                tc.link_free[link] = now

    def prefetch_wake_times(self) -> list[float]:
        """When a prefetch a waiting request is held for lets it go: its completion, or
        under `timeout` its deadline once it blocked."""
        timeout = self.cache.prefetch_policy == "timeout"
        out = []
        for p in self._prefetches.values():
            out.append(p.done)
            if timeout and p.blocked is not None:
                out.append(p.blocked + self.prefetch_timeout(p.asked))
        return out


class _Prefetch:
    """One request's storage prefetch on the serving clock: when its read started and
    completes, its tokens (and those it asked for), when it first held the request back and when it let it go,
    what had arrived then."""

    __slots__ = ("start", "done", "size", "asked", "blocked", "released", "arrived")

    def __init__(self, start: float, done: float, size: int, asked: int) -> None:
        self.start = start
        self.done = done
        self.size = size
        self.asked = asked
        self.blocked: float | None = None
        self.released: float | None = None
        self.arrived = size


#: longest decode window taken in one go (bounds the per-step time vector)
MAX_WINDOW = 4096
