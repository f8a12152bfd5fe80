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
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from cachelib.types import Sequence
from experiments.engine.request import Request
from experiments.engine.scheduler import Scheduler, _new_pages, _pages_limit
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

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A decode step inside a page the table already holds publishes nothing on backends
        # that promise so: its grow and commit are skipped and the commit batched (`r.lag`)
        # until the page fills or the request is released (synchronous loop only: async
        # publishes known tokens only, which the batched count does not track).
        self.lazy = self.cache.decode_steps_are_noops and not self.config.async_scheduling
        self.gpu_free = 0.0  # when the last non-empty step ends
        self.finished_pending = False  # vLLM's finished_req_ids: one more schedule() after a finish
        self.async_scheduling = self.config.async_scheduling

    @property
    def has_requests(self) -> bool:
        """vLLM's `has_requests()`: unfinished requests, or finished ones not yet reported."""
        return bool(self.waiting or self.running) or self.finished_pending

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
            seq = Sequence(one.request_id, one.prompt, one.extra, prefix_id=one.prefix_id)
            r = Request(one, seq, arrival=arrival, index=index, sample_of=spec.request_id if j else None)
            r.vllm = VllmCounters(known=len(seq))
            self.waiting.append(r)

    def stuck(self, plan: StepPlan) -> bool:
        """An empty step with nothing running: only a waiting head that cannot fit even the
        empty cache leaves it so (a step that preempted the last running request admits
        nothing by rule 3; the next one takes the request back)."""
        return plan.empty and not plan.preempted and not self.running and bool(self.waiting)

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
        lazy = self.lazy
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
            if lazy and n == 1 and end % page and end <= len(r.seq.page_table) * page:
                r.lag = end - r.seq.num_computed  # no new page and none fills: nothing to call
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
        self.flush(r)
        while True:
            ops = self.client.grow(r.seq, v.computed + n)
            if ops is not None:
                self.executor.apply_copies(ops)
                if publish:
                    self.publish(r, min(v.computed + n, v.known))
                return True
            victim = self.running.pop()
            self.preempt_request(victim)
            plan.preempted = True
            if victim is r:
                return False

    def admit_waiting(self, plan: StepPlan, budget: int) -> None:
        """Rule 3: FCFS admissions while budget and the running limit allow; the first
        request whose whole sequence does not fit stops the pass."""
        waiting, client = self.waiting, self.client
        skipped: list[Request] = []
        while waiting and budget > 0 and len(self.running) < self.config.max_running:
            r = waiting[0]
            if r.vllm.stale:
                skipped.append(waiting.popleft())  # output still in flight: resume later
                continue
            seq = r.seq
            m = client.match(seq)
            if not client.can_admit(seq, m, len(seq)):
                break
            n = min(len(seq) - m.num_tokens, budget)
            ops = client.admit(seq, m, m.num_tokens + n)
            if ops is None:  # cannot happen after can_admit; refuse loudly rather than guess
                raise RuntimeError(f"{self.cache.name}: admit refused what can_admit accepted")
            self.executor.apply_copies(ops)
            waiting.popleft()
            self.running.append(r)
            # a tiered cache may have loaded part of the hit back inside admit
            hit = seq.num_computed
            n -= hit - m.num_tokens
            r.vllm.running = True
            r.vllm.computed = hit
            self.publish(r, hit + n)
            if r.first_admit_hit is None:
                r.first_admit_hit = hit
            r.hit_tokens += hit
            r.host_hit_tokens += hit - m.num_tokens
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
        if not plan.items:
            plan.end = start
            return
        seconds, tokens = self.executor.step([(r.seq, n, s) for r, n, s in plan.items])
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


#: longest decode window taken in one go (bounds the per-step time vector)
MAX_WINDOW = 4096
