"""The row scheduler (`VllmRowScheduler`) makes `VllmScheduler`'s decisions exactly.

`serve` runs the `vllm` policy's synchronous loop on rows whenever the executor prices steps
(cost model, fixed); the object loop stays the reference. Both run here on the same
workloads, backends and capacities (memory pressure included: preemptions, evictions,
windows cut by pages) and everything a run reports must be equal: every request record,
the ITL pairs, the pages timeline, the step count, the cache's counters and the step at
which each KV event was emitted (so a page published a step late shows). The real-vLLM
goldens (tests/test_vllm_scheduler.py) run through `serve`, so through the rows, too.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import create_cache
from cachelib.hashing import numba_installed
from experiments.engine import CostModelExecutor, ServingConfig
from experiments.engine.cache_client import CacheClient
from experiments.engine.clock import VirtualClock
from experiments.engine.executors import FixedStepExecutor
from experiments.engine.serving import drive, scheduler_class
from experiments.engine.token_gaps import TokenGaps
from experiments.engine.vllm_rows import VllmRowScheduler
from experiments.engine.vllm_scheduler import VllmScheduler
from experiments.workloads.registry import make_workload

WORKLOADS = {
    # a few hot documents, everything at once: admission fills memory, decoding preempts
    "docs": ("shared_doc_qa", dict(num_documents=4, doc_len=300, num_requests=60, output_len=40, output_dist="uniform", rate=50.0, vocab_size=5000)),
    # conversations whose next turn re-sends the recorded answer (forced outputs, dependent arrivals)
    "chat": ("multi_turn_chat", dict(num_conversations=8, turns=4, user_turn_len=60, answer_len=30, answer_dist="exponential", think_time=0.5, rate=20.0, vocab_size=5000)),
    # parallel samples (vLLM fans them out as requests sharing the prompt)
    "samples": ("parallel_sampling", dict(n=3, num_requests=12, rate=5.0)),
    # the shipped conversation trace's head: long prompts, chunked prefill
    "mooncake": ("mooncake", dict(limit=60)),
}  # fmt: skip

#: the paths that compute a step's array work here (experiments/engine/compiled.py): numpy
#: always, numba's compiled loops where the `fast` extra is installed (CI installs it)
KERNELS = ["numpy", *(["numba"] if numba_installed() else [])]


class EventLog:
    """When (the step count) each KV event came and what it was. Page keys are left out: a
    generated page's key hashes fresh token ids, which the two loops draw in another order."""

    def __init__(self) -> None:
        self.scheduler: VllmScheduler | None = None
        self.log: list[tuple[int, str, int]] = []

    def on_kv_event(self, event) -> None:
        self.log.append((self.scheduler.result.steps, type(event).__name__, len(event.keys)))


#: backends with host tiers, by name: what `create_cache` takes beside the GPU pages (a host
#: of twice the GPU, in tokens, is added per run)
TIERED = {
    "radix-hicache": {"write_policy": "write_through"},
    "radix-hicache-wb": {"write_policy": "write_back"},
    "apc-host": {"host_eviction": "lru"},
}


def make_cache(backend: str, num_pages: int, page_size: int):
    if backend not in TIERED:
        return create_cache(backend, num_pages=num_pages, page_size=page_size)
    name = "apc" if backend.startswith("apc") else "radix-hicache"
    host = 2 * num_pages * page_size
    return create_cache(name, num_pages=num_pages, page_size=page_size, host_capacity_tokens=host, **TIERED[backend])


def run(cls: type[VllmScheduler], backend: str, num_pages: int, page_size: int, requests, executor, config, **kw):
    cache = make_cache(backend, num_pages, page_size)
    clock = VirtualClock(requests)
    s = cls(CacheClient(cache), executor, config, clock, **kw)
    events = EventLog()
    events.scheduler = s
    if cache.emits_kv_events:
        cache.subscribe(events)
    drive(clock, s, {spec.request_id: i for i, spec in enumerate(requests)})
    res = s.result
    return {
        "records": sorted(res.requests, key=lambda rec: rec["request_id"]),
        "itl": (res.itl.values, res.itl.counts),
        "timeline": res.timeline,
        "steps": res.steps,
        "preemptions": res.preemptions,
        "peak": res.peak_pages,
        "stats": cache.stats(),
        "now": clock.now,
        "events": events.log,
    }


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("backend", ["apc", "radix", "none", "paged", *TIERED])
@pytest.mark.parametrize("pages", [40, 400])
@pytest.mark.parametrize("executor", ["cost", "fixed"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_rows_decide_as_the_object_loop(workload, backend, pages, executor, kernel):
    """Both paths of the rows' array work (numpy, numba) against the object loop."""
    name, knobs = WORKLOADS[workload]
    requests = make_workload(name, seed=3, **knobs).requests
    page_size = 16
    longest = max(s.prompt_len + max(s.output_lens) for s in requests)
    num_pages = max(pages, -(-longest // page_size) + 1)  # the longest request fits alone
    # the row loop prices no tier transfers: a tiered cache's loops agree with instant ones
    # (timed transfers run on the object loop alone: tests/test_tier_clock.py)
    config = ServingConfig(token_budget=512, max_running=16, time_transfers=False)

    def make():
        return CostModelExecutor(kernel=kernel) if executor == "cost" else FixedStepExecutor(0.02)

    rows = run(VllmRowScheduler, backend, num_pages, page_size, requests, make(), config, kernel=kernel)
    objects = run(VllmScheduler, backend, num_pages, page_size, requests, make(), config)
    for key in objects:
        assert rows[key] == objects[key], key
    assert rows["steps"] > 0


def test_pressure_is_exercised():
    """The small capacity really preempts and the large one really takes decode windows: the
    comparison above covers both paths."""
    name, knobs = WORKLOADS["docs"]
    requests = make_workload(name, seed=3, **knobs).requests
    config = ServingConfig(token_budget=512, max_running=16)
    small = run(VllmRowScheduler, "apc", 40, 16, requests, CostModelExecutor(), config)
    assert small["preemptions"] > 0
    big = run(VllmRowScheduler, "apc", 4000, 16, requests, CostModelExecutor(), config)
    tokens = sum(rec["generated"] for rec in big["records"])
    assert big["steps"] < tokens / 2  # far fewer steps than one per token each: windows ran


def test_serve_picks_rows_only_for_the_synchronous_priced_loop():
    sync, asyn = ServingConfig(), ServingConfig(async_scheduling=True)
    assert scheduler_class(sync, CostModelExecutor()) is VllmRowScheduler
    assert scheduler_class(sync, FixedStepExecutor(0.01)) is VllmRowScheduler
    assert scheduler_class(asyn, CostModelExecutor()) is VllmScheduler
    assert scheduler_class(ServingConfig(scheduler="legacy"), CostModelExecutor()).policy == "legacy"
    with pytest.raises(ValueError, match="synchronous loop"):
        VllmRowScheduler(
            CacheClient(create_cache("apc", num_pages=8, page_size=4)), CostModelExecutor(), asyn, VirtualClock([])
        )


@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_seconds_is_the_loop_to_the_last_bit(kernel):
    """The cost model's vectorised step time adds the same terms in the same order, by
    either path; items computing nothing are not in the step."""
    rng = np.random.default_rng(0)
    ex = CostModelExecutor(kernel=kernel)
    assert ex.kernel == kernel
    for _ in range(300):
        size = int(rng.integers(1, 300))
        new = rng.integers(1, 9000, size) * (rng.random(size) < 0.3) + 1
        new[rng.random(size) < 0.2] = 0  # rows the budget left out
        starts = rng.integers(0, 2_000_000, size)
        batch = [(None, int(n), int(s)) for n, s in zip(new, starts, strict=True) if n]
        if batch:
            assert ex.batch_seconds(new.astype(np.int64), starts.astype(np.int64)) == ex.step_seconds(batch)
            # other integer arrays (int32, a strided view) price the same
            assert ex.batch_seconds(new.astype(np.int32), np.repeat(starts, 2)[::2]) == ex.step_seconds(batch)


def test_an_engine_kernel_is_named_and_numba_is_asked_for_only_where_installed(monkeypatch):
    from experiments.engine import compiled

    with pytest.raises(ValueError, match="unknown engine kernel 'fast'"):
        CostModelExecutor(kernel="fast")
    with pytest.raises(ValueError, match="unknown engine kernel"):
        VllmRowScheduler(
            CacheClient(create_cache("apc", num_pages=8, page_size=4)), CostModelExecutor(), ServingConfig(),
            VirtualClock([]), kernel="c",
        )  # fmt: skip
    monkeypatch.setattr(compiled, "numba_installed", lambda: False)
    assert CostModelExecutor(kernel="auto").kernel == "numpy"  # without numba: the reference
    with pytest.raises(ValueError, match=r"needs numba: pip install 'prefix-cache-lab\[fast\]'"):
        CostModelExecutor(kernel="numba")


@pytest.mark.skipif(not numba_installed(), reason="the compiled path needs numba (the fast extra)")
def test_the_kernels_name_kinds_and_promises_as_the_engine_does():
    from cachelib.interface import DECODE_NOOPS_CONDITIONS
    from experiments.engine import row_kernels as k
    from experiments.engine import vllm_rows as v

    assert (k._EXCUSED, k._FILLS, k._NEW_PAGE, k._CALLS) == (v.EXCUSED, v.FILLS, v.NEW_PAGE, v.CALLS)
    # every condition a cache may declare has its number (VllmRowScheduler.promise)
    assert len({k.PROMISE_ALWAYS, k.PROMISE_WHILE_FREE, k.PROMISE_IF_PRIVATE}) == 1 + len(DECODE_NOOPS_CONDITIONS)


@pytest.mark.skipif(not numba_installed(), reason="the compiled path needs numba (the fast extra)")
def test_plan_rows_is_the_numpy_split_and_classification():
    """`row_kernels.plan_rows` against the numpy formulas of `plan_and_call`,
    `rows_to_call` and `unproven_rows` (the budget as one cumulative sum, the lazy rule by
    `row_kind`, a conditional promise's unproven rows) on random running lists: budgets
    that run out mid-list, prefill chunks, decode steps inside, into and filling pages,
    with and without the lazy rule and quiet fills, under each kind of promise."""
    from experiments.engine import row_kernels as k
    from experiments.engine.row_kernels import plan_rows
    from experiments.engine.vllm_rows import CALLS, EXCUSED, row_kind

    rng = np.random.default_rng(5)
    page = 16
    for _ in range(3000):
        m = int(rng.integers(0, 40))
        prompt = rng.integers(1, 200, m)
        computed = np.minimum(rng.integers(0, 260, m), prompt + rng.integers(0, 60, m))
        decoding = computed >= prompt
        known = np.where(decoding, computed + 1, np.minimum(prompt, computed + rng.integers(0, 120, m)))
        idle = rng.random(m) < 0.1  # nothing to compute (never in the synchronous loop; allowed)
        known[idle] = computed[idle]
        capacity = (-(-computed // page) + rng.integers(0, 2, m)) * page
        budget = int(rng.integers(1, 400))
        lazy, quiet = bool(rng.random() < 0.7), bool(rng.random() < 0.5)
        promise = int(rng.integers(0, 3))
        free, private = int(rng.integers(0, 6)), rng.random(m) < 0.9
        args = [a.astype(np.int64) for a in (computed, known, capacity, prompt)]
        n, table, known_out, unproven = plan_rows(*args, budget, page, lazy, quiet and lazy, promise, free, private)
        need = known - computed
        before = need.cumsum() - need
        want_n = need if need.sum() <= budget else np.minimum(np.maximum(budget - before, 0), need)
        assert n.tolist() == want_n.tolist()
        end = computed + want_n
        if promise == k.PROMISE_WHILE_FREE:
            take = np.maximum(-(-end // page) - capacity // page, 0)
            doubtful = np.cumsum(take) - take >= free
        else:
            doubtful = ~private if promise == k.PROMISE_IF_PRIVATE else np.zeros(m, dtype=bool)
        assert unproven == bool(lazy and (doubtful & (want_n > 0)).any())
        want = []
        for i in np.flatnonzero(want_n > 0).tolist():
            kind = row_kind(int(want_n[i]), int(end[i]), int(capacity[i]), page, int(prompt[i]), quiet and lazy)
            if not lazy:
                kind = CALLS
            if kind != EXCUSED:
                want.append([i, int(want_n[i]), int(end[i]), kind])
        assert table.tolist() == want
        assert known_out.tolist() == [int(known[row[0]]) for row in want]


@pytest.mark.skipif(not numba_installed(), reason="the compiled path needs numba (the fast extra)")
def test_deliver_rows_is_the_numpy_process():
    """`row_kernels.deliver_rows` against `process`'s numpy steps and `TokenGaps.step_rows`
    over a run of random steps: the same counters, first tokens, finishes and gap pairs."""
    from experiments.engine.row_kernels import deliver_rows

    rng = np.random.default_rng(11)
    m = 30
    a, b = TokenGaps(), TokenGaps()
    computed = rng.integers(0, 5, m).astype(np.int64)
    known = computed + rng.integers(0, 2, m)
    generated = rng.integers(0, 3, m).astype(np.int64)
    target = generated + rng.integers(1, 6, m)
    has_first = rng.random(m) < 0.5
    timed = rng.random(m) < 0.8
    last = np.where(has_first, rng.random(m), np.nan)
    mine = [x.copy() for x in (computed, known, generated, target, has_first, timed, last)]
    now = 1.0
    for _ in range(300):
        now += float(rng.random())
        n = (rng.random(m) < 0.7).astype(np.int64) * rng.integers(1, 3, m)
        # the reference: `VllmRowScheduler.process`
        sampled = (computed == known) & (n > 0)
        known += sampled
        generated += sampled
        firsts = np.flatnonzero(sampled & ~has_first)
        has_first[firsts] = True
        last = a.step_rows(last, sampled & timed, now)
        done = np.flatnonzero(sampled & (generated >= target))
        got = deliver_rows(*mine, n, now, b.last_step or 0.0, b.last_step is not None)
        assert got[0].tolist() == firsts.tolist() and got[1].tolist() == done.tolist()
        b.add_step(got[2].tolist(), got[3], now)
        for x, y in zip((computed, known, generated, target, has_first, timed, last), mine, strict=True):
            assert np.array_equal(x, y, equal_nan=True)
        # the next step's state: chunks computed, finished rows restart
        step = np.minimum(n, known - computed)
        computed += step
        mine[0] += step
        restart = generated >= target
        target[restart] += 3
        mine[3][restart] += 3
    assert (a.values, a.counts) == (b.values, b.counts)
    # before any step a last token at 0.0 is a gap of its own (`prev` is then a placeholder)
    one = [np.array([v], dtype=np.int64) for v in (0, 0, 0, 5)]
    flags = [np.array([True]), np.array([True]), np.array([0.0])]
    got = deliver_rows(*one, *flags, np.array([1], dtype=np.int64), 2.0, 0.0, False)
    assert got[2].tolist() == [2.0] and got[3] == 0


class _R:
    def __init__(self, last):
        self.last_token_at = last


def test_token_gaps_rows_equal_objects():
    """`step_rows` / `window_rows` record the pairs `step` / `window` record."""
    rng = np.random.default_rng(1)
    a, b = TokenGaps(), TokenGaps()
    objs = [_R(None) for _ in range(20)]
    last = np.full(20, np.nan)
    timed = rng.random(20) < 0.8
    now = 0.0
    for _ in range(200):
        now += float(rng.random())
        if rng.random() < 0.2:
            ends = now + np.cumsum(rng.random(int(rng.integers(1, 5))))
            a.window([o for o, t in zip(objs, timed, strict=True) if t], ends.tolist())
            last = b.window_rows(last, timed, ends)
            now = float(ends[-1])
            continue
        got = (rng.random(20) < 0.6) & timed
        a.step([o for o, g in zip(objs, got, strict=True) if g], now)
        last = b.step_rows(last, got, now)
    assert (a.values, a.counts) == (b.values, b.counts)
    assert [o.last_token_at for o in objs] == [None if np.isnan(x) else x for x in last]


@pytest.mark.parametrize("bad", [[1, 2.0], [True], [-1], [2**31]])
def test_extend_ids_refuses_what_append_refuses(bad):
    """The decode-path append validates as `append` does, and a refused call changes nothing."""
    from cachelib.errors import InvalidRequestError
    from cachelib.types import Sequence

    s = Sequence("r", np.arange(4, dtype=np.int32))
    with pytest.raises(InvalidRequestError, match="token id"):
        s.extend_ids(bad)
    assert len(s) == 4
    s.extend_ids([7, 8])
    assert s.tokens.tolist() == [0, 1, 2, 3, 7, 8]


@pytest.mark.parametrize("bad", [range(-1, 2), range(2**31 - 1, 2**31 + 1), range(5, 9, 2)])
def test_extend_ids_refuses_a_bad_run(bad):
    """A run of fresh ids (a `range`) is validated at its ends and must step by 1; a refused
    run changes nothing, an accepted one appends exactly the list it stands for."""
    from cachelib.errors import InvalidRequestError
    from cachelib.types import Sequence

    s = Sequence("r", np.arange(4, dtype=np.int32))
    with pytest.raises(InvalidRequestError, match="token id|step by 1"):
        s.extend_ids(bad)
    assert len(s) == 4
    s.extend_ids(range(2**31 - 3, 2**31))  # the largest ids fit
    s.extend_ids(range(9, 9))  # an empty run is a no-op
    s.extend_ids(range(100, 105))  # past the buffer: it grows
    assert s.tokens.tolist() == [0, 1, 2, 3, 2**31 - 3, 2**31 - 2, 2**31 - 1, 100, 101, 102, 103, 104]


def test_sequence_room_keeps_appends_in_one_buffer():
    """`room` reserves slots past the prompt: appends up to it write into the buffer the
    prompt was copied into (no regrowth), appends past it still grow it, the tokens read
    the same as without room, and the caller's prompt is never the buffer."""
    from cachelib.types import Sequence

    prompt = np.arange(5, dtype=np.int32)
    s, plain = Sequence("r", prompt, room=4), Sequence("p", prompt)
    buf = s._buf
    assert buf is not prompt and buf.size == 9
    for seq in (s, plain):
        seq.extend_ids(range(100, 103))
        seq.append_token(7)
    assert s._buf is buf  # four appended tokens: inside the room
    s.extend_ids([8, 9])  # past it: the buffer grows
    plain.extend_ids([8, 9])
    assert s.tokens.tolist() == plain.tokens.tolist() == [0, 1, 2, 3, 4, 100, 101, 102, 7, 8, 9]
    assert prompt.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bad", [-1, 2.0, True, None])
def test_sequence_room_must_be_a_non_negative_int(bad):
    from cachelib.errors import InvalidRequestError
    from cachelib.types import Sequence

    with pytest.raises(
        InvalidRequestError, match=r"room \(token slots reserved for its output\) must be a non-negative int"
    ):
        Sequence("r", np.arange(3, dtype=np.int32), room=bad)


def test_output_room_is_the_output_length_up_to_a_cap():
    """Engines reserve a request's output length, but never more than `MAX_OUTPUT_ROOM`
    slots up front (a trace may declare outputs far longer than a run generates)."""
    from experiments.engine.scheduler import MAX_OUTPUT_ROOM, output_room
    from experiments.workloads.spec import RequestSpec

    prompt = np.arange(3, dtype=np.int32)
    assert output_room(RequestSpec("a", prompt, 0)) == 0
    assert output_room(RequestSpec("a", prompt, 37)) == 37
    assert output_room(RequestSpec("a", prompt, 147_483_647)) == MAX_OUTPUT_ROOM


def test_fresh_token_run_is_fresh_tokens():
    """`fresh_token_run(k)` hands out the ids `fresh_tokens(k)` would, and moves the counter alike."""
    a, b = CostModelExecutor(), CostModelExecutor()
    for k in (1, 5, 0, 3):
        assert list(a.fresh_token_run(k)) == b.fresh_tokens(k)
    assert a.fresh_tokens(2) == b.fresh_tokens(2)
    f, g = FixedStepExecutor(0.01), FixedStepExecutor(0.01)
    assert list(f.fresh_token_run(4)) == g.fresh_tokens(4)


def test_row_kind_is_the_lazy_rule_of_the_vectorised_classification():
    """`row_kind` (one row, Python ints) classifies a step as the vector formula it replaced:
    a one-token prefill chunk (ending at or before the prompt's end) always calls; with
    `quiet` a decode step filling a held page needs no call, and one into a new page only
    its grow."""
    from experiments.engine.vllm_rows import CALLS, EXCUSED, FILLS, NEW_PAGE, row_kind

    page = 16
    grid = np.meshgrid(np.arange(0, 4), np.arange(1, 70), np.arange(0, 80, 16), np.array([0, 20, 48]), [False, True])
    n, end, cap, prompt, quiet = (a.ravel() for a in grid)
    one, inside, fills = (n == 1) & (end > prompt), end <= cap, (end % page == 0) & ~quiet
    want = np.where(
        one & inside & ~fills, EXCUSED, np.where(one & inside, FILLS, np.where(one & ~fills, NEW_PAGE, CALLS))
    )
    args = zip(n.tolist(), end.tolist(), cap.tolist(), prompt.tolist(), quiet.tolist(), strict=True)
    got = [row_kind(a, b, c, page, d, q) for a, b, c, d, q in args]
    assert got == want.tolist()
    assert row_kind(1, 20, 32, page, 20) == CALLS  # the prompt's last token, one-token chunk
    assert row_kind(1, 21, 32, page, 20) == EXCUSED
    assert {EXCUSED, FILLS, NEW_PAGE, CALLS} <= set(got)


def test_running_rows_keep_their_values_through_growth_rebinding_and_deletes():
    """`RunningRows` holds fields as views of preallocated blocks: against plain lists, under
    admissions past the initial room (the blocks double), in-place updates, fields rebound
    to new arrays (copied back before rows join or leave) and deletes of single rows and of
    sets of rows, every field of every row stays right."""
    from types import SimpleNamespace

    from experiments.engine.vllm_rows import RunningRows

    rng = np.random.default_rng(7)
    rows = RunningRows(room=2)
    model: list[list] = []  # one list of FIELDS values per row
    for step in range(400):
        op = rng.integers(0, 5)
        if op <= 1 or not model:
            vals = [int(v) for v in rng.integers(0, 1000, 8)]
            last = None if rng.random() < 0.3 else float(rng.random())
            first, timed, private = bool(rng.random() < 0.5), bool(rng.random() < 0.8), bool(rng.random() < 0.5)
            r = SimpleNamespace(
                vllm=SimpleNamespace(known=vals[1]), generated=vals[2], target=vals[3],
                seq=SimpleNamespace(num_computed=vals[5], prompt_len=vals[7]), computed_tokens=vals[6],
                last_token_at=last,
                first_token_at=0.0 if first else None, sample_of=None if timed else "p",
            )  # fmt: skip
            rows.append(r, vals[0], vals[4], private)  # type: ignore[arg-type]
            model.append([*vals, np.nan if last is None else last, first, timed, private])
        elif op == 2:  # in place, as a step does
            rows.known += 1
            rows.capacity[len(model) - 1] = 5
            rows.has_first[0] = True
            for row in model:
                row[1] += 1
            model[-1][4] = 5
            model[0][9] = True  # has_first
        elif op == 3:  # rebound, as a decode window does
            rows.computed = rows.computed + 3
            rows.last = rows.last * 2
            for row in model:
                row[0] += 3
                row[8] *= 2  # last
        else:
            if rng.random() < 0.5:
                where = int(rng.integers(0, len(model)))
                gone = {where}
            else:
                gone = set(rng.choice(len(model), size=min(3, len(model)), replace=False).tolist())
                where = np.array(sorted(gone))
            rows.delete(where)
            model = [row for i, row in enumerate(model) if i not in gone]
        assert len(rows) == len(model)
        for j, name in enumerate(RunningRows.FIELDS):
            got = getattr(rows, name).tolist()
            want = [row[j] for row in model]
            if name == "last":
                assert np.array_equal(np.array(got), np.array(want, dtype=float), equal_nan=True), (step, name)
            else:
                assert got == want, (step, name)
    with pytest.raises(ValueError, match="rows"):  # a rebound field of the wrong length is refused
        rows.known = np.zeros(len(rows) + 1, dtype=np.int64)
        rows.delete(np.array([], dtype=np.int64))


@pytest.mark.skipif(not numba_installed(), reason="the compiled path needs numba (the fast extra)")
def test_window_kernels_are_the_numpy_window():
    """`window_bound`, `most_steps`, `window_calls` and `window_deliver` against the numpy
    of `window_steps` and `window_numpy` (`_new_pages`/`_pages_limit`, the calls mask,
    `unproven_rows`, `TokenGaps.window_rows`) on random decoding rows."""
    from experiments.engine import row_kernels as k
    from experiments.engine.scheduler import _new_pages, _pages_limit

    rng = np.random.default_rng(13)
    page = 16
    a, b = TokenGaps(), TokenGaps()
    now = 0.0
    for trial in range(2000):
        m = int(rng.integers(1, 30))
        start = rng.integers(0, 300, m)
        computed = start + 1
        capacity = (-(-computed // page) + rng.integers(0, 2, m)) * page
        committed = np.minimum(computed, rng.integers(0, 300, m))
        known = computed + (rng.random(m) < 0.05)
        n = np.where(rng.random(m) < 0.05, 2, 1)
        generated = rng.integers(0, 40, m) * (rng.random(m) > 0.02)
        target = generated + rng.integers(1, 90, m)
        i64 = [x.astype(np.int64) for x in (n, computed, known, generated, target)]
        bound = k.window_bound(*i64, 64)
        eligible = not (np.count_nonzero(n != 1) or np.count_nonzero(computed != known) or not generated.all())
        assert bound == (min(64, int((target - generated).min())) if eligible else 1)
        spare, most = int(rng.integers(0, 8)), int(rng.integers(1, 64))
        fits = k.most_steps(computed.astype(np.int64), capacity.astype(np.int64), page, spare, most)
        pages = capacity // page
        if _new_pages(computed, pages, page, 1) > spare:
            assert fits == 0
        else:
            assert fits == _pages_limit(computed, pages, page, spare, most)
        # the window's calls
        steps = int(rng.integers(2, 40))
        lazy, quiet = bool(rng.random() < 0.8), bool(rng.random() < 0.5)
        quiet = quiet and lazy
        promise, free, private = int(rng.integers(0, 3)), int(rng.integers(0, 6)), rng.random(m) < 0.9
        args = [x.astype(np.int64) for x in (start, computed, capacity, committed, known)]
        table, known_out, doubtful = k.window_calls(*args, steps, page, lazy, quiet, promise, free, private)
        final = start + steps
        calls = final > capacity if quiet else (final > capacity) | (final // page > committed // page) | (not lazy)
        if promise == k.PROMISE_WHILE_FREE:
            take = np.maximum(-(-final // page) - capacity // page, 0)
            unproven = np.cumsum(take) - take >= free
        else:
            unproven = ~private if promise == k.PROMISE_IF_PRIVATE else np.zeros(m, dtype=bool)
        assert doubtful == bool(lazy and (unproven & ~calls).any())
        called = np.flatnonzero(calls)
        assert table.tolist() == [[int(i), int(final[i] - computed[i]), int(final[i])] for i in called]
        assert known_out.tolist() == (known[called] + steps).tolist()
        # the deliveries
        timed = rng.random(m) < 0.8
        last = np.where(rng.random(m) < 0.2, np.nan, now - rng.random(m))
        if trial % 3 == 0 and a.last_step is not None:
            last[rng.random(m) < 0.5] = a.last_step  # rows that got a token at the previous step
        ends = now + np.cumsum(rng.random(steps) + 0.01)
        want_last = a.window_rows(last.copy(), timed, ends)
        want_done = np.flatnonzero(generated + steps >= target)
        mine = [x.astype(np.int64) for x in (computed, generated, start, target)]  # work: a copy of start
        prev = b.last_step
        done, gaps, regular, many = k.window_deliver(
            mine[0], mine[1], mine[2], mine[3], start.astype(np.int64), timed, last, steps, float(ends[0]),
            float(ends[-1]), 0.0 if prev is None else prev, prev is not None,
        )  # fmt: skip
        b.add_step(gaps.tolist(), regular, float(ends[0]))
        b.add_window_steps(ends, many)
        assert done.tolist() == want_done.tolist() and many == int(timed.sum())
        assert mine[0].tolist() == final.tolist() and mine[1].tolist() == (generated + steps).tolist()
        assert mine[2].tolist() == (start + steps).tolist()
        assert np.array_equal(last, want_last, equal_nan=True)
        assert (a.values, a.counts, a.last_step) == (b.values, b.counts, b.last_step)
        now = float(ends[-1])
