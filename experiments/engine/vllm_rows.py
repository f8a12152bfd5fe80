"""`VllmRowScheduler`: `VllmScheduler`'s synchronous loop with the running batch held as arrays.

The decisions are `VllmScheduler`'s, rule for rule (its docstring); only the bookkeeping
moves. With ~256 requests running, the object loop spends a few µs per request per step on
counters that change the same way for nearly all of them: a decoding request gets one
token of budget, computes it, samples one token. Here the running list's counters are
numpy rows, authoritative while a request runs (`RunningRows`), and a step is a handful of
vector operations. A request's own object is brought up to date (`sync`) only where
something reads it:

- a cache call for it: a prefill chunk, a decode step that needs a new page or fills one
  (`VllmScheduler`'s lazy rule says which need none), its preemption, its finish;
- its first token (TTFT), which sets fields on the object directly;
- a router reading the replica's load (`loads`: from the rows, no sync needed).

Syncing appends the tokens it sampled since the last sync, as fresh ids taken then (the
decode windows of `VllmScheduler` draw them per window the same way): the ids differ from
the object loop's, never the decisions, since an id is only ever compared for equality
and every fresh id is new. Step times are the executor's `batch_seconds`, which adds the
batch's terms in batch order (the same floats as `step_seconds`).

Each step's array work (budget split and the rows to call, deliveries, a decode window's
bounds, calls and deliveries) is numpy here, the reference; where numba is installed it
runs as compiled loops instead (experiments/engine/row_kernels.py, `kernel=`), the same
values to the last bit.

Used for the synchronous loop with an executor that prices steps without running a model
(`supports_decode_windows`: cost model, fixed); async scheduling, the model executor and a
cache with memory tiers whose transfers cost time (`ServingConfig.time_transfers`,
experiments/engine/transfers.py) keep `VllmScheduler`'s object loop. tests/test_vllm_rows.py runs both on the same
workloads and compares every request record, the ITL pairs, the page timeline and the
cache's counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cachelib.interface import DECODE_NOOPS_IF_PRIVATE, DECODE_NOOPS_WHILE_FREE
from cachelib.types import CopyOp, Sequence
from experiments.engine.compiled import engine_kernels, kernel_name
from experiments.engine.request import Request
from experiments.engine.scheduler import Loads, _new_pages, _pages_limit
from experiments.engine.vllm_scheduler import MAX_WINDOW, StepPlan, VllmScheduler

#: what a scheduled row's step asks of the cache (`VllmRowScheduler.schedule`)
EXCUSED, FILLS, NEW_PAGE, CALLS = 0, 1, 2, 3


def row_kind(n: int, end: int, capacity: int, page: int, prompt: int, quiet: bool = False) -> int:
    """What a scheduled row's step of `n` tokens, to `end`, asks of the cache under the lazy
    rule, its table covering `capacity` tokens, its prompt `prompt` long: a decode step
    that fills a held page needs only the commit that publishes it (FILLS: the object
    loop's flush and grow around it are no-ops); one that needs a new page, only the grow
    (NEW_PAGE: its commit would publish nothing); any other, the calls of the object loop
    (CALLS), a one-token prefill chunk included (the promise is for generated tokens:
    radix's prefill grow evicts by tokens, page or not). A decode step inside a held page
    that fills nothing needs none (EXCUSED), nor one that fills a page when its commit
    would publish nothing either (`quiet`: a cache whose commits past the prompt publish
    nothing, `VllmScheduler.quiet_fills`)."""
    if n != 1 or end <= prompt:
        return CALLS
    fills = end % page == 0
    if end <= capacity:
        return FILLS if fills and not quiet else EXCUSED
    return CALLS if fills and not quiet else NEW_PAGE


class RunningRows:
    """The running list's counters, one row per request in running order.

    `computed`, `known`, `generated`: vLLM's `num_computed_tokens`, `num_tokens` and the
    outputs delivered; `target`: outputs to generate; `capacity`: tokens its page table
    covers; `committed`: tokens published to the cache (`seq.num_computed`); `work`: tokens
    computed over its life (`Request.computed_tokens`); `last`: when its last token came
    (NaN: none yet); `has_first`: it has its first token; `timed`: it counts in ITL (not a
    parallel sample); `prompt`: its prompt's length; `private`: under a per-sequence lazy
    promise (`DECODE_NOOPS_IF_PRIVATE`), the cache's `decode_steps_private` after the row's
    last call (True otherwise).

    Storage: the int fields are the rows of one int64 block, `last` a float block, the flags
    a bool block, each with room for more rows than run (doubled when full), and every field
    is a view of its block's live prefix, remade only when rows join or leave: an admission
    writes one column instead of reallocating ten arrays, a departure compacts each block
    once. A step may update a field in place (`rows.known += sampled`) or rebind it to a
    new array of the same length (`rows.known = rows.known + k`): a rebound field is copied
    back into its block before rows join or leave (`_settle`), so both forms are safe."""

    INT_FIELDS: ClassVar[tuple[str, ...]] = (
        "computed",
        "known",
        "generated",
        "target",
        "capacity",
        "committed",
        "work",
        "prompt",
    )
    #: every row field, in `append`'s order
    FIELDS: ClassVar[tuple[str, ...]] = (*INT_FIELDS, "last", "has_first", "timed", "private")

    def __init__(self, room: int = 64) -> None:
        self._n = 0
        self._ints = np.zeros((len(self.INT_FIELDS), max(room, 1)), dtype=np.int64)
        self._last = np.zeros(self._ints.shape[1], dtype=np.float64)
        self._flags = np.zeros((3, self._ints.shape[1]), dtype=bool)
        self._bind()

    def _bind(self) -> None:
        """Point every field at its block's live prefix."""
        n = self._n
        views = (*self._ints[:, :n], self._last[:n], *self._flags[:, :n])
        (
            self.computed,
            self.known,
            self.generated,
            self.target,
            self.capacity,
            self.committed,
            self.work,
            self.prompt,
            self.last,
            self.has_first,
            self.timed,
            self.private,
        ) = views
        self._views = views

    def _settle(self) -> None:
        """Copy a field rebound since the last `_bind` back into its block (its length must
        still be the row count: anything else is an engine bug, and raises)."""
        for name, view in zip(self.FIELDS, self._views, strict=True):
            arr = getattr(self, name)
            if arr is not view:
                if arr.shape != view.shape:
                    raise ValueError(f"row field {name!r} has {arr.shape} rows, the running list {view.shape}")
                view[...] = arr

    def __len__(self) -> int:
        return self._n

    def append(self, r: Request, computed: int, capacity: int, private: bool = True) -> None:
        """A request joins the end of the running list with its object's current state."""
        self._settle()
        n = self._n
        if n == self._last.size:  # full: double the room (the live rows move once)
            room = 2 * n
            ints = np.zeros((self._ints.shape[0], room), dtype=np.int64)
            ints[:, :n] = self._ints[:, :n]
            last = np.zeros(room, dtype=np.float64)
            last[:n] = self._last[:n]
            flags = np.zeros((self._flags.shape[0], room), dtype=bool)
            flags[:, :n] = self._flags[:, :n]
            self._ints, self._last, self._flags = ints, last, flags
        self._ints[:, n] = (
            computed,
            r.vllm.known,
            r.generated,
            r.target,
            capacity,
            r.seq.num_computed,
            r.computed_tokens,
            r.seq.prompt_len,
        )
        self._last[n] = math.nan if r.last_token_at is None else r.last_token_at
        self._flags[:, n] = (r.first_token_at is not None, r.sample_of is None, private)
        self._n = n + 1
        self._bind()

    def delete(self, where: int | np.ndarray) -> None:
        """Rows leave (finished or preempted; `where`: a row number or an array of them); the
        others keep their order (each block compacted once)."""
        self._settle()
        n = self._n
        if where.__class__ is int or (where.size == 1 and where.dtype.kind in "iu"):
            # one row (most finishes, every preemption): the rows after it move up one
            # place, three slice copies (numpy copies overlapping slices correctly) instead
            # of a mask and three gathers
            i = where if where.__class__ is int else where.item()
            if not 0 <= i < n:
                raise IndexError(f"row {i} is not among the {n} running")
            self._ints[:, i : n - 1] = self._ints[:, i + 1 : n]
            self._last[i : n - 1] = self._last[i + 1 : n]
            self._flags[:, i : n - 1] = self._flags[:, i + 1 : n]
            self._n = n - 1
            self._bind()
            return
        keep = np.ones(n, dtype=bool)
        keep[where] = False
        m = int(np.count_nonzero(keep))
        if m < n:
            self._ints[:, :m] = self._ints[:, :n][:, keep]
            self._last[:m] = self._last[:n][keep]
            self._flags[:, :m] = self._flags[:, :n][:, keep]
        self._n = m
        self._bind()


@dataclass(slots=True)
class RowPlan:
    """One `schedule()` over rows: `n[i]` tokens for running row i (0: not scheduled),
    rows admitted this step included (they are the last rows); `start` the rows' computed
    counts before the step."""

    n: np.ndarray
    start: np.ndarray
    preempted: bool = False
    admitted: bool = False
    index: int | None = None
    end: float = 0.0

    @property
    def empty(self) -> bool:
        """No row scheduled: the step takes no time."""
        return not np.count_nonzero(self.n)  # (`ndarray.any` costs several times more on a few rows)


class VllmRowScheduler(VllmScheduler):
    """`VllmScheduler`'s synchronous decisions over `RunningRows` (module docstring)."""

    prices_transfers: ClassVar[bool] = False  # tiered caches with timed transfers: the object loop

    def __init__(self, *args, kernel: str = "auto", **kwargs) -> None:
        #: the compiled loops of each step's array work, or None: the numpy reference
        #: (experiments/engine/compiled.py; a bad name fails here, before anything is built)
        self.kernels = engine_kernels(kernel)
        self.kernel = kernel_name(self.kernels)  # `numba` or `numpy`: the path that runs
        super().__init__(*args, **kwargs)
        if self.async_scheduling or not self.executor.supports_decode_windows:
            raise ValueError("the row scheduler runs the synchronous loop of an executor that prices steps")
        if self.config.time_transfers and self.tiered and self.cache.load_timing is not None:
            raise ValueError(
                "the row scheduler does not price tier transfers: a tiered cache with time_transfers runs on "
                "VllmScheduler (serving.scheduler_class)"
            )
        self.rows = RunningRows()

    # -- the object view ------------------------------------------------------------

    def sync(self, i: int) -> Request:
        """Bring running row `i`'s object up to date; returns it."""
        return self.sync_row(i, self.running[i])

    def sync_row(self, i: int, r: Request) -> Request:
        """Bring `r`, row `i`, up to date: what a cache call needs (`sync_for_cache`) and
        the counters the results read; returns it."""
        self.sync_for_cache(i, r)
        rows = self.rows
        r.generated = rows.generated.item(i)  # (`item`: a Python number, no numpy scalar between)
        r.computed_tokens = rows.work.item(i)
        last = rows.last.item(i)
        r.last_token_at = None if math.isnan(last) else last
        return r

    def sync_for_cache(self, i: int, r: Request) -> Request:
        """What a cache call for `r`, row `i`, reads: the tokens it sampled since the last
        sync appended (fresh ids, or its forced output), vLLM's counts, the lag."""
        rows = self.rows
        v = r.vllm
        known = rows.known.item(i)
        k = known - len(r.seq)
        if k > 0:
            self.append_sampled(r, k)
        v.computed = rows.computed.item(i)
        v.known = known
        r.lag = v.computed - r.seq.num_computed  # computed, not yet published (lazy steps)
        return r

    def append_sampled(self, r: Request, k: int) -> None:
        """Append the `k` tokens `r` sampled since its last sync: fresh ids, or its forced output."""
        tokens: list[int] | range = self.executor.fresh_token_run(k)  # consecutive: cheap to append
        if r.forced is not None:  # the request's recorded output overrides what was sampled
            tokens = list(tokens)
            lo = len(r.output)
            tokens[: max(0, min(k, len(r.forced) - lo))] = r.forced[lo : lo + k]
        r.seq.extend_ids(tokens)
        if self.keep_outputs or r.forced is not None:  # `Request.output`'s only readers
            r.output.extend(tokens)

    def synced(self, called: list[int]) -> None:
        """After cache calls for the objects of rows `called`: each one's table and published
        count read back into its row."""
        rows, running, page = self.rows, self.running, self.cache.page_size
        capacity, committed = rows.capacity, rows.committed
        for i in called:
            seq = running[i].seq
            capacity[i] = len(seq.page_table) * page
            committed[i] = seq.num_computed
        if self.lazy_when == DECODE_NOOPS_IF_PRIVATE:  # a call may have shared or copied its blocks
            private = self.cache.decode_steps_private
            for i in called:
                rows.private[i] = private(running[i].seq)

    def loads(self, page_size: int) -> Loads:
        """`Scheduler.loads` with running requests read from their rows."""
        outstanding = prefill = pages = 0
        for r in self.waiting:
            left = r.prefill_left()
            prefill += left
            outstanding += left + r.target - r.generated
            pages += r.spec.prompt_len // page_size
        rows = self.rows
        if len(rows):
            prompts = np.fromiter((r.spec.prompt_len for r in self.running), dtype=np.int64, count=len(rows))
            left = prompts - np.minimum(rows.computed, prompts)
            prefill += int(left.sum())
            outstanding += int((left + rows.target - rows.generated).sum())
            pages += int((prompts // page_size).sum())
        return Loads(outstanding, prefill, pages)

    # -- the step -------------------------------------------------------------------

    def schedule(self) -> RowPlan:  # type: ignore[override]
        """Rules 1-3 over rows: the budget split in running order, then the cache calls, in
        order, of the rows the lazy rule does not excuse (`plan_compiled`, or the numpy
        reference `plan_and_call`), then admissions."""
        rows = self.rows
        budget = self.config.token_budget
        planned = self.plan_compiled(budget) if self.kernels is not None else None
        if planned is None:
            plan = self.plan_and_call(budget)
        else:
            plan, todo, known = planned
            if todo:
                self.call_rows(todo, known, plan)
        m = len(self.running)
        if m != len(plan.n):  # preempted: the rows it removed leave the plan
            plan.n, plan.start = plan.n[:m], plan.start[:m]
        rows.computed = rows.computed + plan.n  # `_update_after_schedule`
        budget -= int(plan.n.sum())
        if not plan.preempted:
            self.admit_rows(plan, budget)
        self.finished_pending = False
        return plan

    def plan_compiled(self, budget: int) -> tuple[RowPlan, list, list[int]] | None:
        """`plan_and_call`'s plan by the compiled loop (`row_kernels.plan_rows`): the plan,
        the rows to call with their kinds and their known counts, for `call_rows`. None
        when a conditional lazy promise may fail for a scheduled row this step
        (`unproven_rows` would name one): the numpy path then decides it at its turn
        (`call_rows_checked`)."""
        rows = self.rows
        promise, free = self.promise()
        n, todo, known, unproven = self.kernels.plan_rows(  # type: ignore[union-attr]
            rows.computed, rows.known, rows.capacity, rows.prompt, budget, self.cache.page_size, self.lazy,
            self.quiet_fills, promise, free, rows.private,
        )  # fmt: skip
        if unproven:
            return None
        return RowPlan(n, rows.computed.copy()), todo.tolist(), known.tolist()

    def promise(self) -> tuple[int, int]:
        """The lazy rule's condition as the compiled loops take it (`row_kernels.PROMISE_*`)
        and, while a page must be free, the pages free now."""
        kernels = self.kernels
        if not self.lazy or self.lazy_when is None:
            return kernels.PROMISE_ALWAYS, 0  # type: ignore[union-attr]
        if self.lazy_when == DECODE_NOOPS_WHILE_FREE:
            return kernels.PROMISE_WHILE_FREE, self.cache.pages_free()  # type: ignore[union-attr]
        if self.lazy_when == DECODE_NOOPS_IF_PRIVATE:
            return kernels.PROMISE_IF_PRIVATE, 0  # type: ignore[union-attr]
        raise ValueError(f"the compiled row step has no form of the lazy condition {self.lazy_when!r}")

    def plan_and_call(self, budget: int) -> RowPlan:
        """The budget split in running order as one cumulative sum, then the cache calls of
        the rows that need one (the numpy reference of `plan_compiled`)."""
        rows = self.rows
        start = rows.computed.copy()
        need = rows.known - rows.computed
        if int(need.sum()) <= budget:
            n = need  # every row gets all it needs (a decode step): the split below, short
        else:
            before = need.cumsum() - need  # budget the rows ahead of each would take
            # np.clip(budget - before, 0, need), as two ufuncs (np.clip's wrapper costs more
            # than the work on a few hundred rows, every step)
            n = np.minimum(np.maximum(budget - before, 0), need)
        plan = RowPlan(n, start)
        end = start + n
        page = self.cache.page_size
        todo, unproven = self.rows_to_call(n, end)
        # each row's values before any call of this step (a call changes only its own row's
        # table; a preemption ends the loop at the rows it removed)
        calls = zip(
            todo.tolist(),
            n[todo].tolist(),
            end[todo].tolist(),
            rows.capacity[todo].tolist(),
            rows.prompt[todo].tolist(),
            strict=True,
        )
        if unproven is not None and unproven[todo].any():
            # rows whose condition is checked at their turn: the calls one row at a time, as
            # the object loop makes them (a row's excuse reads the cache after the calls
            # before it, so they cannot be made ahead in one region)
            self.call_rows_checked(calls, plan, unproven)
        else:
            quiet = self.quiet_fills
            kinds = [
                (i, ni, ei, row_kind(ni, ei, cap, page, prompt, quiet) if self.lazy else CALLS)
                for i, ni, ei, cap, prompt in calls
            ]
            self.call_rows(kinds, rows.known[todo].tolist(), plan)
        return plan

    def rows_to_call(self, n: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The scheduled rows (`n` tokens each, to `end`) whose step may need a cache call, in
        order, and the rows a conditional promise did not clear (`unproven_rows`; None: no
        condition). Under the lazy rule, by the cache's promise (`decode_steps_are_noops`),
        a decode step inside a held page needs no call (EXCUSED), nor one that fills it when
        fills are quiet; the others are classified row by row (`row_kind`), the unproven
        ones at their turn, as the object loop checks them. A one-token prefill chunk is no
        decode step: it calls."""
        if not self.lazy:
            return np.flatnonzero(n > 0), None
        rows = self.rows
        inside = (n == 1) & (end <= rows.capacity) & (end > rows.prompt)
        excused = inside if self.quiet_fills else inside & (end % self.cache.page_size != 0)
        unproven = self.unproven_rows(end)
        if unproven is not None:
            excused &= ~unproven
        return np.flatnonzero((n > 0) & ~excused), unproven

    def unproven_rows(self, end: np.ndarray) -> np.ndarray | None:
        """Under a conditional lazy promise, the rows for which it is not proven, before any
        call, that the condition will hold when their turn comes in a pass that takes each
        row to `end` tokens (None: none, or an unconditional promise). Under
        `DECODE_NOOPS_WHILE_FREE` the calls before a row take at most the new pages of the
        rows ahead of it that need one (a preemption or an eviction only frees pages): while
        fewer than the pages free now, a page is still free at its turn (so no row is
        unproven while all of them together take fewer: the common step, one sum). Under
        `DECODE_NOOPS_IF_PRIVATE`, the rows the cache did not approve after their last call
        (only a call naming a sequence changes its answer)."""
        when = self.lazy_when
        if when is None:
            return None
        rows = self.rows
        if when == DECODE_NOOPS_WHILE_FREE:
            page = self.cache.page_size
            take = np.maximum(-(-end // page) - rows.capacity // page, 0)
            free = self.cache.pages_free()
            if int(take.sum()) < free:
                return None
            return np.cumsum(take) - take >= free
        private = rows.private
        return None if private.all() else ~private

    def call_rows_checked(self, calls, plan: RowPlan, unproven: np.ndarray) -> None:
        """`call_rows` for a step with rows a conditional lazy promise did not clear ahead
        (`unproven_rows`): each such row is excused only if its condition holds at its turn
        (`decode_step_excused`), and then needs no call; one that is not excused gets every
        call, as without the promise. `calls` yields (row, tokens, end, table capacity, prompt
        length)."""
        page, quiet = self.cache.page_size, self.quiet_fills
        for i, ni, ei, cap, prompt in calls:
            if i >= len(self.running):
                break  # preempted by an earlier row's allocation
            if unproven[i] and not self.decode_step_excused(self.running[i].seq):
                kind = CALLS  # the condition fails now: every call, as without the promise
            else:
                kind = row_kind(ni, ei, cap, page, prompt, quiet)
                if kind == EXCUSED:
                    continue  # an unproven row whose condition holds at its turn
            r = self.sync_for_cache(i, self.running[i])
            if kind == FILLS:
                self.publish(r, ei)
            elif not self.allocate(r, ni, plan, publish=kind == CALLS):  # type: ignore[arg-type]
                plan.n = plan.n[:i]  # it preempted itself: the running pass stops there
                plan.start = plan.start[:i]
                break
            self.synced([i])

    def call_rows(self, todo: list[tuple[int, int, int, int]], known: list[int], plan: RowPlan) -> None:
        """The cache calls of the scheduled rows `todo` (row, tokens, end, `row_kind`; `known`:
        each one's token count), in row order, as `VllmScheduler`'s running pass makes them:
        a FILLS row's publish, any other's flush, grow and (CALLS) publish, preempting the
        last running request when a grow does not fit (`preempt_for`). Every row is synced
        first (`advance_steps`), then the calls run in one timed region
        (`CacheClient.advance_all`, the same calls in the same order) up to a grow that
        does not fit; its preemptions run outside it, then the calls of the rows still
        running resume. (A call reads only its own row's sequence, so syncing the others
        first changes no call; a victim is synced again when preempted, a no-op.)"""
        steps = self.advance_steps(todo, known)
        pos = 0
        while pos < len(todo):
            done = self.client.advance_all(steps[pos:])
            made = done if done[-1] is not None else done[:-1]
            self.rows_called([row[0] for row in todo[pos : pos + len(made)]], made)
            pos += len(done)
            if done[-1] is not None:
                continue  # every call made
            i = todo[pos - 1][0]  # its grow did not fit: its flush is made
            seq, _, e, published = steps[pos - 1]
            ops = self.preempt_for(self.running[i], e, published, plan)  # type: ignore[arg-type]
            if ops is None:
                plan.n = plan.n[:i]  # it preempted itself: the running pass stops there
                plan.start = plan.start[:i]
                return
            self.executor.apply_copies(ops)
            self.synced([i])
            left = len(self.running)  # the rows preempted for it are gone
            keep = [j for j in range(pos, len(todo)) if todo[j][0] < left]
            todo = [todo[j] for j in keep]
            steps = [steps[j] for j in keep]
            pos = 0

    def advance_steps(
        self, todo: list[tuple[int, int, int, int]], known: list[int]
    ) -> list[tuple[Sequence, int, int | None, int]]:
        """Each row of `todo` synced for its calls and its `CacheClient.advance_all` step.
        `sync_for_cache` row by row, with the counts read from `known` and the step (a row
        computed `end - tokens` before it) instead of one numpy read each: a flushing row's
        commit goes to its computed count, since its lag is what it computed past its
        published count."""
        running = self.running
        steps: list[tuple[Sequence, int, int | None, int]] = []
        for (i, ni, ei, kind), kn in zip(todo, known, strict=True):
            r = running[i]
            seq = r.seq
            if kn > len(seq):
                self.append_sampled(r, kn - len(seq))
            v = r.vllm
            computed = ei - ni
            v.computed = computed
            v.known = kn
            if kind == FILLS:
                r.lag = computed - seq.num_computed  # its step is only its publish
                steps.append((seq, 0, None, ei))
            else:
                r.lag = 0  # flushed by the call
                steps.append((seq, computed, ei, min(ei, kn) if kind == CALLS else 0))
        return steps

    def rows_called(self, called: list[int], ops: list[list[CopyOp]]) -> None:
        """After the calls made for rows `called` (each one's copies `ops`): the copies
        applied, then the rows read back (`synced`)."""
        apply = self.executor.apply_copies
        for o in ops:
            if o:
                apply(o)
        self.synced(called)

    def preempt_request(self, r: Request) -> None:
        """A victim is the last running request: its row is synced, then dropped."""
        i = len(self.running)  # `allocate` popped it already: it was row `i`
        self.sync_row(i, r)
        self.rows.delete(i)
        super().preempt_request(r)

    def admit_rows(self, plan: RowPlan, budget: int) -> None:
        """Rule 3 through `VllmScheduler.admit_waiting`; each admitted request becomes a row."""
        if not self.waiting and not self.loading:
            return  # nothing to admit (most steps of a lightly loaded replica)
        step = StepPlan()
        self.admit_waiting(step, budget)
        if not step.items:
            return
        plan.admitted = True
        page = self.cache.page_size
        private = self.lazy_when == DECODE_NOOPS_IF_PRIVATE
        n, start = [], []
        for r, k, s in step.items:
            self.rows.append(
                r, s + k, len(r.seq.page_table) * page, not private or self.cache.decode_steps_private(r.seq)
            )
            n.append(k)
            start.append(s)
        plan.n = np.concatenate((plan.n, np.array(n, dtype=np.int64)))
        plan.start = np.concatenate((plan.start, np.array(start, dtype=np.int64)))

    # -- execute and process ----------------------------------------------------------

    def execute(self, plan: RowPlan) -> None:  # type: ignore[override]
        start = max(self.clock.now, self.gpu_free)
        n = plan.n
        seconds = self.executor.batch_seconds(n, plan.start)  # (rows computing nothing are not in it)
        plan.end = self.gpu_free = start + seconds
        plan.index = self.result.steps
        self.result.steps += 1
        self.rows.work += n
        self.record_pages(plan.end)

    def process(self, plan: RowPlan) -> None:  # type: ignore[override]
        """Deliveries: a scheduled row whose chunk reached its known end sampled a token."""
        if self.kernels is not None:
            self.process_compiled(plan)
            return
        rows = self.rows
        sampled = rows.computed == rows.known
        sampled &= plan.n > 0
        rows.known += sampled
        rows.generated += sampled
        # (on bools `a > b` is `a & ~b` in one ufunc; `nonzero()[0]` is `np.flatnonzero`
        # without its wrapper: these run every step on a few hundred rows)
        firsts = (sampled > rows.has_first).nonzero()[0]
        if firsts.size:
            for i in firsts.tolist():
                r = self.running[i]
                r.first_token_at, r.first_token_step = plan.end, plan.index
            rows.has_first[firsts] = True
        rows.last = self.result.itl.step_rows(rows.last, sampled & rows.timed, plan.end)
        sampled &= rows.generated >= rows.target
        self.stop_rows(sampled.nonzero()[0], plan.end, plan.index)

    def process_compiled(self, plan: RowPlan) -> None:
        """`process` by the compiled loop (`row_kernels.deliver_rows`): the same rows
        updated, first tokens, gaps and finishes."""
        rows = self.rows
        itl = self.result.itl
        prev = itl.last_step
        firsts, done, gaps, regular = self.kernels.deliver_rows(  # type: ignore[union-attr]
            rows.computed, rows.known, rows.generated, rows.target, rows.has_first, rows.timed, rows.last, plan.n,
            plan.end, 0.0 if prev is None else prev, prev is not None,
        )  # fmt: skip
        if firsts.size:
            running = self.running
            for i in firsts.tolist():
                r = running[i]
                r.first_token_at, r.first_token_step = plan.end, plan.index
        itl.add_step(gaps.tolist(), regular, plan.end)
        self.stop_rows(done, plan.end, plan.index)

    def stop_rows(self, done: np.ndarray, at: float, step: int | None) -> None:
        """Rows that produced their last token finish, in running order."""
        if not done.size:
            return
        finished = [self.sync(i) for i in done.tolist()]
        self.rows.delete(done)
        for r in finished:
            self.stop(r, at, step)

    # -- decode windows -----------------------------------------------------------------

    def window_steps(self, plan: RowPlan) -> int:  # type: ignore[override]
        """`VllmScheduler.window_steps` over rows."""
        rows = self.rows
        n = plan.n
        if plan.admitted or plan.preempted or not len(n) or len(n) != len(self.running):
            return 1
        kernels = self.kernels
        if kernels is not None:  # the same bounds, each in one compiled pass
            k = kernels.window_bound(n, rows.computed, rows.known, rows.generated, rows.target, MAX_WINDOW)
            if k <= 1:
                return 1
            spare = self.cache.pages_reclaimable()
            fits = kernels.most_steps(rows.computed, rows.capacity, self.cache.page_size, spare, k - 1)
            if not fits:
                return 1  # even the second step would preempt
            k = 1 + fits
        else:
            if np.count_nonzero(n != 1) or np.count_nonzero(rows.computed != rows.known):
                return 1
            if np.count_nonzero(rows.generated) != n.size:  # (generated is never negative)
                return 1
            k = min(MAX_WINDOW, int((rows.target - rows.generated).min()))
            if k <= 1:
                return 1
            page = self.cache.page_size
            pages = rows.capacity // page
            spare = self.cache.pages_reclaimable()
            if _new_pages(rows.computed, pages, page, 1) > spare:
                return 1  # even the second step would preempt
            k = 1 + _pages_limit(rows.computed, pages, page, spare, k - 1)
        arrival = self.clock.next_arrival()
        if arrival is not None and k > 1:
            starts = self.step_starts(plan.start, k)
            k = int(np.searchsorted(starts, arrival, side="left"))
        return max(k, 1)

    def run_decode_window(self, plan: RowPlan, k: int) -> float:  # type: ignore[override]
        """`k` decode steps of every row at once; cache calls only for rows that need a
        page or fill one (the others' would publish nothing: the lazy rule)."""
        steps = self.executor.decode_step_seconds(plan.start, k)
        ends = np.cumsum(np.concatenate(([self.clock.now], steps)))[1:]
        first = self.result.steps
        self.result.steps += k
        end = float(ends[-1])
        self.gpu_free = end
        if self.kernels is None or not self.window_compiled(plan, k, ends, first):
            self.window_numpy(plan, k, ends, first)
        self.record_pages(end)
        return end

    def window_compiled(self, plan: RowPlan, k: int, ends: np.ndarray, first: int) -> bool:
        """`window_numpy` by the compiled loops (`row_kernels.window_calls`,
        `window_deliver`): the same calls, rows, gaps and finishes. False, having changed
        nothing, when a conditional promise leaves a row unproven: `window_numpy` decides
        it at its turn."""
        rows, kernels = self.rows, self.kernels
        promise, free = self.promise()
        todo, known, doubtful = kernels.window_calls(  # type: ignore[union-attr]
            plan.start, rows.computed, rows.capacity, rows.committed, rows.known, k, self.cache.page_size, self.lazy,
            self.quiet_fills, promise, free, rows.private,
        )  # fmt: skip
        if doubtful:
            return False
        rows.known = rows.known + k  # the window's k tokens are sampled (appended at a sync)
        if len(todo):
            # every row synced first (its flush: this step's token too; then grow and publish
            # to the window's end), then their calls in one timed region (`call_rows`)
            called = todo[:, 0].tolist()
            steps = self.advance_steps([(i, ni, ei, CALLS) for i, ni, ei in todo.tolist()], known.tolist())
            done = self.client.advance_all(steps)
            if len(done) < len(steps) or done[-1] is None:
                raise RuntimeError("decode window ran out of pages; the window check is wrong")
            self.rows_called(called, done)  # type: ignore[arg-type]  # none is None (checked)
        itl = self.result.itl
        prev = itl.last_step
        done_rows, gaps, regular, many = kernels.window_deliver(  # type: ignore[union-attr]
            rows.computed, rows.generated, rows.work, rows.target, plan.start, rows.timed, rows.last, k,
            float(ends[0]), float(ends[-1]), 0.0 if prev is None else prev, prev is not None,
        )  # fmt: skip
        itl.add_step(gaps.tolist(), regular, float(ends[0]))
        itl.add_window_steps(ends, many)
        self.stop_rows(done_rows, float(ends[-1]), first + k - 1)
        return True

    def window_numpy(self, plan: RowPlan, k: int, ends: np.ndarray, first: int) -> None:
        """The calls and deliveries of a decode window of `k` steps ending at `ends` (the
        numpy reference of `window_compiled`)."""
        rows = self.rows
        end = float(ends[-1])
        final = plan.start + k
        page = self.cache.page_size
        if self.quiet_fills:  # every row is past its prompt (`window_steps`): fills publish nothing
            calls = final > rows.capacity
        else:
            calls = (final > rows.capacity) | (final // page > rows.committed // page) | (not self.lazy)
        unproven = self.unproven_rows(final) if self.lazy else None
        todo = calls if unproven is None else calls | unproven
        rows.known = rows.known + k  # the window's k tokens are sampled (appended at a sync)
        if unproven is not None and (unproven & ~calls).any():
            # rows excused only if their condition holds at their turn: one row at a time
            for i in np.flatnonzero(todo).tolist():
                if not calls[i] and self.decode_step_excused(self.running[i].seq):
                    continue  # an unproven row whose condition holds at its turn
                r = self.sync_for_cache(i, self.running[i])  # its flush: this step's token too
                to = final.item(i)
                lag, r.lag = r.lag, 0  # flush, grow, publish
                ops = self.client.advance(r.seq, r.seq.num_computed + lag, to, to)
                if ops is None:
                    raise RuntimeError("decode window ran out of pages; the window check is wrong")
                self.executor.apply_copies(ops)
                self.synced([i])
        else:
            called = calls.nonzero()[0]
            rows_called = called.tolist()
            # every row synced first (its flush: this step's token too; then grow and publish
            # to the window's end), then their calls in one timed region (`call_rows`)
            todo = zip(rows_called, (final - rows.computed)[called].tolist(), final[called].tolist(), strict=True)
            steps = self.advance_steps([(i, ni, ei, CALLS) for i, ni, ei in todo], rows.known[called].tolist())
            done = self.client.advance_all(steps) if steps else []
            if len(done) < len(steps) or (done and done[-1] is None):
                raise RuntimeError("decode window ran out of pages; the window check is wrong")
            self.rows_called(rows_called, done)  # type: ignore[arg-type]  # none is None (checked)
        rows.computed = final
        rows.generated = rows.generated + k
        rows.work = rows.work + k
        rows.last = self.result.itl.window_rows(rows.last, rows.timed, ends)
        self.stop_rows(np.flatnonzero(rows.generated >= rows.target), end, first + k - 1)
