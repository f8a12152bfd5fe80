"""`VllmScheduler`: the serving policy that makes vLLM 0.33's V1 decisions (`--scheduler vllm`).

Follows `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`, `_update_after_schedule`,
`update_from_output`, `_preempt_request`) and `async_scheduler.py` of vLLM 0.33.0, FCFS, no
speculative decoding, no KV connector but the tiers'. Checked request for request against the
real scheduler (tests/fixtures/vllm_0_33/, tests/test_vllm_scheduler.py). The rules:

1. A step has a token budget. Running requests go first, in admission order (a re-admitted
   request joins at the end): each gets `min(tokens left, budget left)`, the rest of its
   prefill or one decode token (`kernels.plan_rows`).
2. When a running request's allocation fails, the *last* running request is preempted
   (its pages released, its computed count reset to 0, to the *front* of the waiting
   queue) and the allocation retried; when the victim is the request itself the running
   pass stops (`call_rows`, `preempt_for`).
3. No admission in a step that preempted. Otherwise waiting requests in order while budget
   remains and fewer than `max_running` run: hit = the cache's match (at most length - 1),
   first chunk = `min(tokens - hit, budget left)`, and the request must fit *as a whole*
   (`scheduler_reserve_full_isl`, vLLM's default): `cache.can_admit(seq, match, len(seq))`.
   If it does not, the pass stops; no request behind it is tried (`admit_waiting`).
4. Pages are published (`commit`, vLLM's `cache_blocks`) when they are allocated, so a later
   request of the same step hits them. vLLM publishes only known tokens:
   `min(computed + new, num_tokens)`.
5. A token is sampled only when a chunk reaches the end of the request's tokens (with async,
   its in-flight ones); the last sampled token never gets KV (`kernels.after_schedule`,
   `kernels.deliver`).

Async scheduling (vLLM's `AsyncScheduler`; the engine loop is `serving.drive_async`): a step
is scheduled while the previous one is still in flight. A decoding request then holds an
output *placeholder* and is scheduled again before its token is known; one whose in-flight
token will be its last is skipped; a request preempted with output in flight delivers it
later (`stale`), is not re-admitted before that, and finishes in the waiting queue if that
output was its last.

The running requests are rows (`running.RunningRows`); each rule above is one function over
them in experiments/engine/kernels.py, compiled by numba where installed and run by numpy
otherwise (`kernel=`). A request's object is brought up to date only for a cache call, its
first token, its preemption or its finish. The tokens a request samples are appended to its
`Sequence` when a cache call or the executor needs them: fresh ids drawn then (cost model,
fixed step; an id is only ever compared for equality), or the model's samples as it returns
them. A backend's lazy promise (`decode_steps_are_noops`, `decode_noops_when`) excuses a
decode step inside a held page from its cache calls (synchronous loop only): its commit is
made with the row's next call. While nothing but decoding happens, `window_steps` /
`run_decode_window` take k decode steps at once with the outcome of taking them one by one.
Timed tier transfers are `tiered.TierSteps`'.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import numpy as np

from cachelib.interface import DECODE_NOOPS_CONDITIONS, DECODE_NOOPS_IF_PRIVATE, DECODE_NOOPS_WHILE_FREE, PrefixCache
from cachelib.types import CopyOp, Sequence
from experiments.engine import kernels as K
from experiments.engine.cache_client import CacheClient
from experiments.engine.clock import VirtualClock
from experiments.engine.compiled import engine_kernels
from experiments.engine.executors import Executor
from experiments.engine.request import (
    Request,
    ServingConfig,
    ServingResult,
    VllmCounters,
    new_sequence,
    request_record,
    tier_record,
)
from experiments.engine.running import GatheredRows, RunningRows
from experiments.engine.tiered import TierSteps
from experiments.workloads.spec import RequestSpec

#: longest decode window taken in one go (bounds the per-step time vector)
MAX_WINDOW = 4096
_NO_ROWS = np.zeros(0, dtype=np.int64)


class Loads(NamedTuple):
    """A replica's work in tokens and pages, summed over its waiting and running requests
    (a cluster's `ClusterView.outstanding_tokens`, `prefill_tokens`, `active_pages`)."""

    outstanding: int
    prefill: int
    pages: int


@dataclass(slots=True)
class StepPlan:
    """One `schedule()` over the rows as they stand at its end: `n[i]` tokens for row i (0:
    not scheduled), `start` the rows' computed counts before the step, `sampled` the tokens
    each samples (0 or 1); for the async loop, which requests the rows were. `index` is its
    step number once executed (None: an empty step)."""

    n: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    start: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    sampled: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    requests: list[Request] | None = None
    preempted: bool = False
    admitted: bool = False
    #: the rows admitted this step, `n` and `start` each, until `close_admissions`
    joined_n: list[int] = field(default_factory=list)
    joined_start: list[int] = field(default_factory=list)
    index: int | None = None
    end: float = 0.0

    @property
    def empty(self) -> bool:
        """Nothing scheduled: the step takes no time."""
        return not np.count_nonzero(self.n)

    def join(self, n: int, start: int) -> None:
        """A row admitted with `n` tokens from `start` (a list append: the arrays grow once,
        in `close_admissions`)."""
        self.joined_n.append(n)
        self.joined_start.append(start)
        self.admitted = True

    def close_admissions(self) -> None:
        """The rows admitted this step join `n` and `start`."""
        if self.joined_n:
            self.n = np.concatenate((self.n, np.array(self.joined_n, dtype=np.int64)))
            self.start = np.concatenate((self.start, np.array(self.joined_start, dtype=np.int64)))
            self.joined_n, self.joined_start = [], []


class VllmScheduler:
    """One replica scheduling as vLLM 0.33's V1 `Scheduler` (FCFS): the module docstring."""

    policy: ClassVar[str] = "vllm"

    def __init__(
        self,
        client: CacheClient,
        executor: Executor,
        config: ServingConfig,
        clock: VirtualClock,
        *,
        keep_outputs: bool = False,
        kernel: str = "auto",
    ) -> None:
        self.kernels = engine_kernels(kernel)  # a bad name fails here, before anything is built
        self.kernel = self.kernels.name
        self.client = client
        self.cache = cache = client.cache
        self.executor = executor
        self.config = config
        self.clock = clock
        self.keep_outputs = keep_outputs
        self.async_scheduling = config.async_scheduling
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rows = RunningRows()
        self.loading: deque[Request] = deque()  # vLLM's kv_holding_waiting: admitted, loading
        self.result = ServingResult()
        self.gpu_free = 0.0  # when the last non-empty step ends
        self.finished_pending = False  # vLLM's finished_req_ids: one more schedule() after a finish
        self.admissions = 0  # admissions so far: the next one's number (`RunningRows.admission`)
        self.page = cache.page_size
        # records carry reuse by tier (a reference model duck-typing the contract has none)
        self.tiered = isinstance(cache, PrefixCache) and len(cache.memory_tiers) > 1
        self.tiers: TierSteps | None = None
        if config.time_transfers and self.tiered and cache.load_timing is not None:
            self.tiers = TierSteps(cache, executor.num_layers)
        self.lazy, self.lazy_when, self.promise = self._lazy_rule()
        # a decode step that fills a page publishes nothing either when commits past the
        # prompt publish nothing (`commit_publishes_decode` False: none, radix)
        self.quiet_fills = self.lazy and not cache.commit_publishes_decode
        #: the executor samples its own tokens (the model): appended as it returns them
        self.eager_tokens = not executor.samples_fresh_tokens
        #: `Request.output` is read: the outputs are kept, or the model samples them
        self.record_outputs = keep_outputs or self.eager_tokens

    def _lazy_rule(self) -> tuple[bool, str | None, int]:
        """Whether decode steps inside a held page skip their cache calls, under which
        condition (`PrefixCache.decode_noops_when`; None: unconditional), as the kernels'
        promise code. Synchronous loop only: async publishes known tokens only."""
        cache = self.cache
        when = None if cache.decode_steps_are_noops else cache.decode_noops_when
        if when is not None and when not in DECODE_NOOPS_CONDITIONS:
            raise ValueError(
                f"{cache.name}: unknown decode_noops_when {when!r}; one of {', '.join(DECODE_NOOPS_CONDITIONS)}, or None"
            )
        lazy = (cache.decode_steps_are_noops or when is not None) and not self.async_scheduling
        promise = {None: K.PROMISE_ALWAYS, DECODE_NOOPS_WHILE_FREE: K.PROMISE_WHILE_FREE}.get(
            when, K.PROMISE_IF_PRIVATE
        )
        return lazy, when, promise if lazy else K.PROMISE_ALWAYS

    # -- the replica's queues ------------------------------------------------------------

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
        share the prompt through the prefix cache, not by forking. Its sequence is built
        when it is first considered (`sequence`)."""
        lens = spec.output_lens
        for j in range(spec.n):
            one = spec
            if spec.n > 1:
                rid = spec.request_id if j == 0 else f"{spec.request_id}/{j}"
                forced = spec.forced_output if j == 0 else None
                one = dataclasses.replace(
                    spec, request_id=rid, output_len=lens[j], n=1, sample_lens=None, forced_output=forced
                )
            r = Request(one, None, arrival=arrival, index=index, sample_of=spec.request_id if j else None)
            r.counters = VllmCounters(known=one.prompt_len)
            self.waiting.append(r)

    @staticmethod
    def sequence(r: Request) -> Sequence:
        """`r`'s sequence, built the first time the policy needs it (to match or admit `r`):
        a request waits without one. Built at arrival instead, a long queue held every
        waiting prompt's tokens and output room (on the Mooncake conversation trace up to
        5-8k waiting requests, 250-350 MB)."""
        seq = r.seq
        if seq is None:
            seq = r.seq = new_sequence(r.spec)
        return seq

    def loads(self) -> Loads:
        """Over the waiting and running requests: prompt tokens whose KV is not computed (a
        preempted request's prompt counts again) plus output tokens not generated; the prompt
        tokens alone; the full pages of their prompts."""
        outstanding = prefill = pages = 0
        for r in self.waiting:  # a waiting request has computed nothing
            prefill += r.spec.prompt_len
            outstanding += r.spec.prompt_len + r.target - r.generated
            pages += r.spec.prompt_len // self.page
        rows = self.rows
        if len(rows):
            prompts = rows.total - rows.target
            left = prompts - np.minimum(rows.computed, prompts)
            prefill += int(left.sum())
            outstanding += int((left + rows.target - rows.generated).sum())
            pages += int((prompts // self.page).sum())
        return Loads(outstanding, prefill, pages)

    # -- the synchronous loop's step --------------------------------------------------------

    def step(self) -> float:
        """`EngineCore.step`: schedule, execute, process; returns when the step ends (`now`
        for an empty one, after aborting a head that can never fit: `stuck`)."""
        plan = self.schedule()
        now = self.clock.now
        if plan.empty:
            if self.stuck(plan):
                self.give_up_on_head()
            elif self.tiers is not None:
                return self.wake_time(now)
            return now
        k = self.window_steps(plan)
        if k > 1:
            return self.run_decode_window(plan, k)
        self.execute(plan)
        self.process(plan)
        return plan.end

    def stuck(self, plan: StepPlan) -> bool:
        """An empty step with nothing running: only a waiting head that cannot fit even the
        empty cache leaves it so (a step that preempted the last running request admits
        nothing by rule 3; the next one takes the request back)."""
        return (
            plan.empty
            and not plan.preempted
            and not self.running
            and bool(self.waiting)
            and (self.tiers is None or self.next_event(None, after=self.clock.now) is None)
        )

    def give_up_on_head(self) -> None:
        """Nothing runs or is in flight and the head cannot fit even the empty cache: it
        never will. vLLM would wait forever; the head is recorded as aborted instead."""
        self.finish(self.waiting.popleft(), self.clock.now, aborted=True, admitted=False)

    # -- schedule() ------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """`Scheduler.schedule()`: the running pass, then (unless it preempted) admissions,
        then `_update_after_schedule` over every row."""
        plan = StepPlan()
        if self.tiers is not None:
            for seq in self.tiers.poll(self.clock.now):
                self.client.release(seq)
        budget = self.config.token_budget
        if len(self.rows):
            self.running_pass(plan, budget)
            budget -= int(plan.n.sum())
        if not plan.preempted and (self.waiting or self.loading):
            self.admit_waiting(plan, budget)
            plan.close_admissions()
        rows = self.rows
        plan.sampled = self.kernels.after_schedule(
            rows.computed, rows.known, rows.placeholders, rows.in_flight, plan.n, self.async_scheduling
        )
        if self.async_scheduling:
            plan.requests = list(self.running)
        self.finished_pending = False
        return plan

    def running_pass(self, plan: StepPlan, budget: int) -> None:
        """Rules 1-2: the budget split in running order, then the cache calls, in order, of
        the rows the lazy rule does not excuse; a preemption cuts the plan at the rows it
        removed."""
        rows = self.rows
        n, kind = self.kernels.plan_rows(
            rows.computed, rows.known, rows.placeholders, rows.total, rows.capacity, rows.prompt,
            budget, self.page, self.lazy, self.quiet_fills,
        )  # fmt: skip
        plan.n, plan.start = n, rows.computed.copy()
        unproven = None
        if self.promise != K.PROMISE_ALWAYS:  # (the arguments cost more than the rest of a plain step)
            unproven = self.unproven(rows.computed + n, (kind >= K.EXCUSED) & (kind < K.CALLS))
        if unproven is not None:
            self.call_rows_checked(plan, kind, unproven)
        else:
            todo = (kind > K.EXCUSED).nonzero()[0]  # (flatnonzero: the same, through two more calls)
            if todo.size:
                self.call_rows(plan, todo, kind[todo].tolist())
        m = len(self.running)
        if m != len(plan.n):  # preempted: the rows it removed leave the plan
            plan.n, plan.start = plan.n[:m], plan.start[:m]

    def unproven(self, end: np.ndarray, lazy_rows: np.ndarray) -> np.ndarray | None:
        """Under a conditional lazy promise, the rows whose excuse is not proven before any
        call (`kernels.unproven_rows`), or None when there is none."""
        if self.promise == K.PROMISE_ALWAYS:
            return None
        free = self.cache.pages_free() if self.promise == K.PROMISE_WHILE_FREE else 0
        rows = self.rows
        unproven = self.kernels.unproven_rows(
            end, rows.capacity, self.page, self.promise, free, rows.private, lazy_rows
        )
        return unproven if np.count_nonzero(unproven) else None

    def call_rows(self, plan: StepPlan, rows: np.ndarray, kinds: list[int]) -> None:
        """The cache calls of `rows` (their `kinds`), in row order, in one timed region
        (`CacheClient.advance_all`) up to a grow that does not fit: its preemptions run
        outside it (`preempt_for`), then the calls of the rows still running resume. Every
        row is brought up to date first (a call reads only its own row's sequence)."""
        steps = self.advance_steps(plan, rows, kinds)
        pos = 0
        while pos < len(rows):
            done = self.client.advance_all(steps[pos:])
            made = done if done[-1] is not None else done[:-1]
            self.rows_called(rows[pos : pos + len(made)].tolist(), made)
            pos += len(done)
            if done[-1] is not None:
                continue  # every call made
            i = int(rows[pos - 1])  # its grow did not fit: its flush is made
            seq, _, end, published = steps[pos - 1]
            ops = self.preempt_for(self.running[i], end, published, plan)
            if ops is None:
                return  # it preempted itself: the running pass stops there
            self.rows_called([i], [ops])
            keep = pos + np.flatnonzero(rows[pos:] < len(self.running))  # the rows preempted for it are gone
            rows, steps, pos = rows[keep], [steps[j] for j in keep.tolist()], 0

    def advance_steps(self, plan: StepPlan, todo: np.ndarray, kinds: list[int]) -> list[tuple]:
        """Each of the rows `todo` brought up to date, and its `CacheClient.advance_all` step: a
        FILLS row only publishes to its end; a NEW_PAGE row flushes and grows; any other
        flushes, grows and publishes its known tokens (`min(end, known)`). The flush is the
        commit the lazy rule deferred (to the row's computed count); without the rule there
        is none (async: computed tokens past the known ones are not published)."""
        rows, running, lazy = self.rows, self.running, self.lazy
        # one gather per field, then plain ints: a numpy scalar read per row costs more than the row's rule
        known, starts = rows.known[todo], plan.start[todo]
        holds = (known + rows.placeholders[todo]).tolist()
        ends = (starts + plan.n[todo]).tolist()
        steps = []
        fields = zip(todo.tolist(), kinds, holds, starts.tolist(), ends, known.tolist(), strict=True)
        for i, kind, have, start, end, kn in fields:
            r = running[i]
            seq = r.seq
            if have > len(seq):  # (`materialize`, inline: this loop is the step's hot path)
                self.append_outputs(r, self.executor.fresh_token_run(have - len(seq)))
            flush = start if lazy else seq.num_computed
            if kind == K.FILLS:
                steps.append((seq, 0, None, end))
            elif kind == K.NEW_PAGE:
                steps.append((seq, flush, end, 0))
            else:
                steps.append((seq, flush, end, min(end, kn)))
        return steps

    def call_rows_checked(self, plan: StepPlan, kind: np.ndarray, unproven: np.ndarray) -> None:
        """The calls of a step with rows a conditional lazy promise did not clear ahead: one
        row at a time, each unproven one excused only if its condition holds at its turn
        (`decode_step_excused`), else given every call, as without the promise."""
        for i in np.flatnonzero(plan.n).tolist():
            if i >= len(self.running):
                break  # preempted by an earlier row's allocation
            k = int(kind[i])
            if unproven[i] and not self.decode_step_excused(self.running[i].seq):
                k = K.CALLS  # the condition fails now: every call, as without the promise
            elif k == K.EXCUSED:
                continue
            seq, flush, end, published = self.advance_steps(plan, np.array([i]), [k])[0]
            if end is None:
                self.publish(seq, published)
                ops: list[CopyOp] | None = []
            else:
                ops = self.client.advance(seq, flush, end, published)
                if ops is None:
                    ops = self.preempt_for(self.running[i], end, published, plan)
                    if ops is None:
                        return  # it preempted itself: the running pass stops there
            self.rows_called([i], [ops])

    def decode_step_excused(self, seq: Sequence) -> bool:
        """Under a conditional lazy promise, whether the cache calls of a decode step of `seq`
        inside a page it holds may be skipped now, at the moment they would come: a page is
        free (`DECODE_NOOPS_WHILE_FREE`), or the cache says `seq` writes no shared block
        (`DECODE_NOOPS_IF_PRIVATE`)."""
        if self.lazy_when == DECODE_NOOPS_WHILE_FREE:
            return self.cache.pages_free() > 0
        return self.cache.decode_steps_private(seq)

    def rows_called(self, called: list[int], ops: list[list[CopyOp]]) -> None:
        """After the calls made for rows `called` (each one's copies `ops`): the copies
        applied, each row's table and published count read back."""
        for o in ops:
            if o:
                self.executor.apply_copies(o)
        rows, running, page = self.rows, self.running, self.page
        # a scalar write per row: for the ~15 rows a step calls, cheaper than building arrays to scatter
        capacity, committed = rows.capacity, rows.committed
        for i in called:
            seq = running[i].seq
            capacity[i] = len(seq.page_table) * page
            committed[i] = seq.num_computed
        if self.lazy_when == DECODE_NOOPS_IF_PRIVATE:  # a call may have shared or copied its blocks
            private = self.cache.decode_steps_private
            for i in called:
                rows.private[i] = private(running[i].seq)

    def preempt_for(self, r: Request, end: int, published: int, plan: StepPlan) -> list[CopyOp] | None:
        """Rule 2 once `r`'s grow to `end` did not fit (its flush made): preempt the last
        running request and retry (publishing to `published` when it fits) until it does;
        None when `r` itself was preempted."""
        while True:
            victim = self.running[-1]
            self.preempt_request(victim)
            plan.preempted = True
            if victim is r:
                return None
            ops = self.client.advance(r.seq, 0, end, published)
            if ops is not None:
                return ops

    def preempt_request(self, r: Request) -> None:
        """`_preempt_request` of the last running request: its pages released; it waits at
        the front with every token so far, its in-flight output marked stale."""
        i = len(self.running) - 1
        self.leave_row(i, r)
        self.release(r)
        old = r.seq
        r.seq = Sequence(old.request_id, old.tokens.copy(), old.extra, prefix_id=old.prefix_id)
        r.seq.cache_memo = old.cache_memo  # same tokens: the cache's per-sequence memo still holds
        c = r.counters
        c.computed, c.stale, c.placeholders = 0, c.in_flight, 0
        r.preempted += 1
        self.result.preemptions += 1
        self.waiting.appendleft(r)

    # -- admissions (rule 3) -----------------------------------------------------------------

    def admit_waiting(self, plan: StepPlan, budget: int) -> None:
        """FCFS admissions while budget and the running limit allow; the first request whose
        whole sequence does not fit stops the pass. A request whose output is still in
        flight (stale) or whose storage prefetch holds it back is skipped this round."""
        if self.loading:
            budget = self.admit_loaded(plan, budget)
            if budget < 0:
                return  # a loaded request did not fit: vLLM's waiting pass stops there
        waiting, client, tiers = self.waiting, self.client, self.tiers
        skipped: list[Request] = []
        while waiting and budget > 0 and len(self.running) < self.config.max_running:
            r = waiting[0]
            if r.counters.stale:
                skipped.append(waiting.popleft())  # output still in flight: resume later
                continue
            seq = self.sequence(r)
            m = client.match(seq)
            if tiers is not None and not tiers.prefetch_ready(r, m, self.clock.now):
                skipped.append(waiting.popleft())  # SGLang skips it this round (prefetching)
                continue
            if not client.can_admit(seq, m, len(seq)):
                break
            budget -= self.admit(r, m, min(len(seq) - m.num_tokens, budget), plan)
        waiting.extendleft(reversed(skipped))  # back in front, in their order

    def admit(self, r: Request, m, n: int, plan: StepPlan) -> int:
        """Admit the waiting head `r` with its first chunk of `n` tokens past match `m`;
        returns the budget it takes (0 when it waits for its load out of the running list)."""
        seq = r.seq
        ops = self.client.admit(seq, m, m.num_tokens + n)
        if ops is None:  # cannot happen after can_admit; refuse loudly rather than guess
            raise RuntimeError(f"{self.cache.name}: admit refused what can_admit accepted")
        self.executor.apply_copies(ops)
        self.waiting.popleft()
        if self.tiers is not None:
            self.tiers.prefetch_admitted(r, self.clock.now)
        hit = seq.num_computed  # a tiered cache may have loaded part of the hit back inside admit
        self.count_hit(r, hit, hit - m.num_tokens)
        tiers = self.tiers
        if tiers is not None and tiers.loads_wait(hit - m.num_tokens):
            start = max(self.clock.now, self.gpu_free)
            tiers.start_loads(start)  # WAITING_FOR_REMOTE_KVS: scheduled once its load completes
            r.counters.computed = hit
            r.load_wait_s -= start  # + the time it is scheduled (`admit_loaded`)
            self.loading.append(r)
            return 0
        n -= hit - m.num_tokens
        self.publish(seq, hit + n)
        self.join(r, hit, n, plan)
        return n

    def count_hit(self, r: Request, hit: int, loaded: int) -> None:
        """`r`'s admission reused `hit` tokens, `loaded` of them from below the GPU."""
        if r.first_admit_hit is None:
            r.first_admit_hit = hit
        r.hit_tokens += hit
        r.host_hit_tokens += loaded
        if loaded:  # of those loaded back, from storage (L3)
            r.storage_hit_tokens += self.cache.storage_hit_tokens(r.seq)

    def admit_loaded(self, plan: StepPlan, budget: int) -> int:
        """vLLM's pass over `kv_holding_waiting`, before the waiting queue: a request whose
        load completed by now is scheduled (its loaded blocks published, the rest of its
        prompt from its computed count); one still loading is skipped. Returns the budget
        left, or -1 when an allocation failed (the waiting pass stops)."""
        now, tiers = self.clock.now, self.tiers
        kept: list[Request] = []
        out = budget
        while self.loading and out > 0 and len(self.running) < self.config.max_running:
            r = self.loading.popleft()
            rid = r.spec.request_id
            if tiers.load_done_at(rid) > now:
                kept.append(r)  # still WAITING_FOR_REMOTE_KVS
                continue
            computed = r.counters.computed
            n = min(len(r.seq) - computed, out)
            ops = self.client.grow(r.seq, computed + n)
            if ops is None:
                kept.append(r)
                out = -1
                break
            self.executor.apply_copies(ops)
            tiers.loaded(rid)
            self.publish(r.seq, computed + n)
            r.load_wait_s += now
            self.join(r, computed, n, plan)
            out -= n
        self.loading.extendleft(reversed(kept))
        return out

    def join(self, r: Request, computed: int, n: int, plan: StepPlan) -> None:
        """`r` joins the running list (a new last row) with `n` tokens this step from `computed`."""
        private = self.lazy_when != DECODE_NOOPS_IF_PRIVATE or self.cache.decode_steps_private(r.seq)
        r.counters.admission = self.admissions
        self.rows.append(r, computed, len(r.seq.page_table) * self.page, self.admissions, private)
        self.admissions += 1
        self.running.append(r)
        plan.join(n, computed)

    def publish(self, seq: Sequence, num_tokens: int) -> None:
        """`cache_blocks`: publish `seq`'s pages up to `num_tokens` (never backwards)."""
        if num_tokens > seq.num_computed:
            self.client.commit(seq, num_tokens)

    # -- a request's object and its row -------------------------------------------------------

    def materialize(self, r: Request, tokens: int) -> Sequence:
        """`r`'s sequence holding its first `tokens` tokens: the outputs it sampled since they
        were last needed appended now, as fresh ids or its forced output (the model's own
        samples are appended as it returns them)."""
        seq = r.seq
        k = int(tokens) - len(seq)
        if k > 0:
            run = self.executor.fresh_token_run(k)
            self.append_outputs(r, run)
        return seq

    def append_outputs(self, r: Request, tokens: range | list[int]) -> None:
        """Append outputs `tokens` to `r`'s sequence; a forced output overrides what was sampled."""
        seq, forced = r.seq, r.forced
        if forced is not None:
            lo = len(seq) - r.spec.prompt_len  # its outputs so far (a preempted sequence's prompt holds them)
            tokens = list(tokens)
            tokens[: max(0, min(len(tokens), len(forced) - lo))] = forced[lo : lo + len(tokens)]
        if tokens.__class__ is range:
            seq.extend_ids(tokens)
        else:
            seq.append(np.asarray(tokens, dtype=np.int32))
        if self.record_outputs or forced is not None:  # `Request.output`'s readers
            r.output.extend(tokens)

    def leave_row(self, i: int, r: Request) -> None:
        """Row `i` (`r`) leaves the running list: its counters go back to its object."""
        rows = self.rows
        self.materialize(r, rows.known[i] + rows.placeholders[i])
        c = r.counters
        c.known, c.computed = int(rows.known[i]), int(rows.computed[i])
        c.placeholders, c.in_flight = int(rows.placeholders[i]), int(rows.in_flight[i])
        c.admission = -1
        r.generated = int(rows.generated[i])
        r.computed_tokens = int(rows.work[i])
        last = float(rows.last[i])
        r.last_token_at = None if last != last else last  # NaN: no token yet
        rows.delete(i)
        self.running.pop(i)

    # -- execute and process --------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> None:
        """The model runs the step from `max(now, gpu_free)`; an empty step takes no time.
        The model's sampled tokens join their sequences at once (the next step computes
        their KV); fresh ids are drawn when something needs them (`materialize`)."""
        now = self.clock.now
        start = max(now, self.gpu_free)
        if self.tiers is not None:
            start = self.tiers.step_start(start, now)
        if plan.empty:
            plan.end = start if self.tiers is None else self.wake_time(start)
            return
        if self.eager_tokens:
            seconds = self.model_step(plan)
        else:
            seconds = self.executor.batch_seconds(plan.n, plan.start)  # (rows computing nothing are not in it)
        if self.tiers is not None:
            seconds = self.transfer_seconds(plan, start, seconds)
        plan.end = self.gpu_free = start + seconds
        plan.index = self.result.steps
        self.result.steps += 1
        self.rows.work += plan.n
        self.record_pages(plan.end)

    def model_step(self, plan: StepPlan) -> float:
        """The executor's step over the scheduled rows' sequences (it samples their tokens,
        which join the sequences as it returns them: nothing is owed to them)."""
        running = self.running
        todo = np.flatnonzero(plan.n).tolist()
        items = [(running[i].seq, int(plan.n[i]), int(plan.start[i])) for i in todo]
        seconds, tokens = self.executor.step(items)
        for i, tok in zip(todo, tokens, strict=True):
            if tok is not None:
                self.append_outputs(running[i], [tok])
        return seconds

    def transfer_seconds(self, plan: StepPlan, start: float, compute: float) -> float:
        """The step's seconds with its timed transfers (`TierSteps.step_seconds`); the load
        stall is charged to each request that loaded in it."""
        seconds, stall, loaders = self.tiers.step_seconds(compute, start)
        if stall:
            running = self.running
            for i in np.flatnonzero(plan.n).tolist():
                if running[i].spec.request_id in loaders:
                    running[i].load_stall_s += stall
        return seconds

    def process(self, plan: StepPlan) -> None:
        """`update_from_output`: deliver each sampled token, finish what stopped. Who got a
        token at the step's end goes to the replica's `TokenGaps` (ITL; parallel samples are
        left out, as TTFT and TPOT leave them out)."""
        if self.async_scheduling:
            self.process_async(plan)
            return
        rows, itl = self.rows, self.result.itl
        prev = itl.last_step
        firsts, done, gaps, regular = self.kernels.deliver(
            rows.known, rows.generated, rows.target, rows.has_first, rows.timed, rows.last, plan.sampled,
            plan.end, plan.end, 0.0 if prev is None else prev, prev is not None,
        )  # fmt: skip
        for i in firsts.tolist():
            r = self.running[i]
            r.first_token_at, r.first_token_step = plan.end, plan.index
        itl.add_step(gaps.tolist(), int(regular), plan.end)
        self.stop_rows(done.tolist(), plan.end, plan.index)

    def stop_rows(self, done: list[int], at: float, step: int | None) -> None:
        """Rows that produced their last token finish, in running order."""
        running, rows = self.running, self.rows
        finished = [running[i] for i in done]
        for i, r in zip(done, finished, strict=True):
            self.materialize(r, rows.known[i] + rows.placeholders[i])
        for i in reversed(done):  # leave from the back: the rows before keep their numbers
            self.leave_row(i, running[i])
        for r in finished:
            self.stop(r, at, step, running=True)

    def stop(self, r: Request, at: float, step: int | None, *, running: bool) -> None:
        """`r` produced its last token: released (it left the running list) or, preempted
        with its last token in flight, out of the waiting queue (it holds no pages)."""
        r.finish_step = step
        if running:
            self.finish(r, at)
        else:
            self.waiting.remove(r)
            self.finish(r, at, admitted=False)
        self.finished_pending = True

    def process_async(self, plan: StepPlan) -> None:
        """`update_from_output` of a step processed after the next was scheduled: each of its
        requests is found again (its row by its admission, or its object when preempted
        since), the tokens delivered over them gathered in step order, then, request by
        request in that order, vLLM's in-flight and placeholder counts, the publish of its
        known tokens, and its stop."""
        items = [j for j in np.flatnonzero(plan.n).tolist() if plan.requests[j].finished_at is None]
        requests = [plan.requests[j] for j in items]
        got = GatheredRows(self.rows, requests, [self.row_of(r) for r in requests])
        itl = self.result.itl
        prev = itl.last_step
        tokens = plan.sampled[items] if items else _NO_ROWS
        firsts, done, gaps, regular = self.kernels.deliver(
            got.known, got.generated, got.target, got.has_first, got.timed, got.last, tokens,
            plan.end, plan.end, 0.0 if prev is None else prev, prev is not None,
        )  # fmt: skip
        got.scatter(self.rows)
        for j in firsts.tolist():
            requests[j].first_token_at, requests[j].first_token_step = plan.end, plan.index
        itl.add_step(gaps.tolist(), int(regular), plan.end)
        finished = set(done.tolist())
        for j, (r, item) in enumerate(zip(requests, items, strict=True)):
            self.settle_in_flight(r, int(plan.n[item]), bool(tokens[j]))
            if j in finished:
                i = self.row_of(r)
                if i is None:
                    self.stop(r, plan.end, plan.index, running=False)
                else:
                    self.stop_rows([i], plan.end, plan.index)

    def row_of(self, r: Request) -> int | None:
        """`r`'s row, or None when it is not running (preempted, or finished)."""
        admission = r.counters.admission
        return None if admission < 0 else self.rows.row_of(admission)

    def settle_in_flight(self, r: Request, n: int, delivered: bool) -> None:
        """After the async step that scheduled `n` tokens of `r` (and `delivered` its token):
        they are no longer in flight (a preempted request's stale count falls with them),
        and a delivered token takes its placeholder's place, its pages published up to the
        known tokens computed."""
        i = self.row_of(r)
        c = r.counters
        if i is None:  # preempted since (its placeholders were dropped then)
            c.in_flight -= n
            if c.stale > 0:
                c.stale -= n
            return
        rows = self.rows
        rows.in_flight[i] -= n
        if delivered and rows.placeholders[i] > 0:
            rows.placeholders[i] -= 1
            seq = self.materialize(r, rows.known[i] + rows.placeholders[i])
            self.publish(seq, int(min(rows.computed[i] - rows.in_flight[i], rows.known[i])))
            rows.committed[i] = seq.num_computed

    # -- decode windows (executors that price k decode steps at once) -------------------------

    def window_steps(self, plan: StepPlan) -> int:
        """How many steps, this one first, can be taken at once with the outcome of taking
        them one by one (synchronous loop only): every running request decodes one known
        token, none was admitted or preempted, none finishes before the last, no arrival
        (or transfer event) before it, and the pages fit without preemption. A waiting
        request stays out: budget and batch size stay, and the pages it would need only get
        scarcer."""
        if self.async_scheduling or not self.executor.supports_decode_windows:
            return 1
        if plan.admitted or plan.preempted:
            return 1
        rows, kernels = self.rows, self.kernels
        k = int(kernels.window_bound(plan.n, rows.computed, rows.known, rows.generated, rows.target, MAX_WINDOW))
        if k <= 1:
            return 1
        spare = self.cache.pages_reclaimable()
        fits = int(kernels.most_steps(rows.computed, rows.capacity, self.page, spare, k - 1))
        if not fits:
            return 1  # even the second step would preempt
        k = 1 + fits
        arrival = self.clock.next_arrival()
        if self.tiers is not None:
            arrival = self.next_event(arrival)  # a window must not pass a poll that matters
        if arrival is not None and k > 1:
            starts = self.step_starts(plan.start, k)
            k = int(np.searchsorted(starts, arrival, side="left"))  # steps starting before it
        return max(k, 1)

    def step_starts(self, computed: np.ndarray, k: int) -> np.ndarray:
        """When each of `k` decode steps starts, accumulated one step at a time from now
        (`np.cumsum` adds sequentially: the same floats as stepping)."""
        steps = self.executor.decode_step_seconds(computed, k)
        return np.cumsum(np.concatenate(([self.clock.now], steps[:-1])))

    def run_decode_window(self, plan: StepPlan, k: int) -> float:
        """`k` decode steps of every row at once; cache calls only for rows that need a page
        or fill one (the others' would publish nothing: the lazy rule)."""
        steps = self.executor.decode_step_seconds(plan.start, k)
        ends = np.cumsum(np.concatenate(([self.clock.now], steps)))[1:]
        first = self.result.steps
        self.result.steps += k
        end = float(ends[-1])
        self.gpu_free = end
        self.window_calls(plan, k)
        rows = self.rows
        rows.computed += k - 1  # the first step's is counted (`after_schedule`)
        rows.work += k
        itl = self.result.itl
        prev = itl.last_step
        _, done, gaps, regular = self.kernels.deliver(
            rows.known, rows.generated, rows.target, rows.has_first, rows.timed, rows.last,
            np.full(len(rows), k, dtype=np.int64), float(ends[0]), end, 0.0 if prev is None else prev,
            prev is not None,
        )  # fmt: skip
        itl.add_step(gaps.tolist(), int(regular), float(ends[0]))
        itl.add_window_steps(ends, int(np.count_nonzero(rows.timed)))
        self.stop_rows(done.tolist(), end, first + k - 1)
        self.record_pages(end)
        return end

    def window_calls(self, plan: StepPlan, k: int) -> None:
        """The cache calls of a decode window of `k` steps: each row that needs a page or
        fills one is brought up to date (its flush: this step's token too) and grows and
        publishes to the window's end, in row order; under a conditional promise a row it
        does not prove is decided at its turn (`decode_step_excused`)."""
        rows = self.rows
        final = plan.start + k
        calls = self.kernels.window_calls(final, rows.capacity, rows.committed, self.page, self.lazy, self.quiet_fills)
        unproven = self.unproven(final, ~calls) if self.lazy else None
        todo = np.flatnonzero(calls if unproven is None else calls | unproven).tolist()
        known = rows.known + k  # the window's k tokens are sampled
        steps, called = [], []
        for i in todo:
            if not calls[i] and self.decode_step_excused(self.running[i].seq):
                continue  # an unproven row whose condition holds at its turn
            seq = self.materialize(self.running[i], known[i])
            to = int(final[i])
            steps.append((seq, int(rows.computed[i]), to, to))
            called.append(i)
            if unproven is not None:
                self.window_advance(steps, called)
                steps, called = [], []
        self.window_advance(steps, called)

    def window_advance(self, steps: list[tuple], called: list[int]) -> None:
        """The calls of a window's rows `called` in one timed region; they always fit."""
        if not steps:
            return
        done = self.client.advance_all(steps)
        if len(done) < len(steps) or done[-1] is None:
            raise RuntimeError("decode window ran out of pages; the window check is wrong")
        self.rows_called(called, done)

    # -- finishing ------------------------------------------------------------------------------

    def finish(self, r: Request, at: float, *, aborted: bool = False, admitted: bool = True) -> None:
        """`r` is done (or given up on) at `at`: released (or, its stores in flight, held
        until they complete), recorded, and its followers may arrive."""
        if admitted:
            if self.tiers is not None and self.tiers.hold(r.spec.request_id, r.seq, at):
                self.flush(r)
            else:
                self.release(r)
        r.finished_at = at
        if self.keep_outputs:
            self.result.outputs[r.spec.request_id] = r.output
        self.clock.finished(r.spec.request_id, at)
        self.result.aborted += aborted
        rec = request_record(r, aborted)
        if self.tiered:
            rec.update(tier_record(r))
        self.result.requests.append(rec)

    def flush(self, r: Request) -> None:
        """The commit the lazy rule deferred (to `r`'s computed count)."""
        seq = r.seq
        if self.lazy and r.counters.computed > seq.num_computed:
            self.client.commit(seq, r.counters.computed)

    def release(self, r: Request) -> None:
        """`r`'s pages released, after the commit the lazy rule deferred."""
        self.flush(r)
        self.client.release(r.seq)

    def release_held(self) -> None:
        """The run is over: what finished requests still hold for their stores is released,
        and the transfers decided in a schedule that ran no step start now."""
        if self.tiers is not None:
            for seq in self.tiers.finish(self.clock.now):
                self.client.release(seq)

    def record_pages(self, at: float) -> None:
        pinned = self.cache.pages_pinned()
        res = self.result
        res.peak_pages = max(res.peak_pages, pinned)
        res.timeline.append((at, pinned))

    # -- waking up -------------------------------------------------------------------------------

    def next_event(self, arrival: float | None, after: float | None = None) -> float | None:
        """The earliest of `arrival` and what a transfer poll would act on (`TierSteps.next_event`)."""
        return self.tiers.next_event(arrival, [r.spec.request_id for r in self.loading], after)

    def wake_time(self, now: float) -> float:
        """When an empty step should look again: the next transfer event or arrival after
        `now` (`now` itself when nothing is pending: the caller then sees it `stuck`)."""
        t = self.next_event(self.clock.next_arrival(), after=now)
        return now if t is None else t
