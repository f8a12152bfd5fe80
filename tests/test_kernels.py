"""The serving policy's array rules (experiments/engine/kernels.py): each one compiled (numba)
and as written (numpy) gives the same values to the last bit, in place and returned, on
random rows; their meaning on hand-made rows; the rows that hold them.

The policy's decisions as a whole are pinned by tests/test_engine_goldens.py (every serving
configuration, both paths) and checked against vLLM by tests/test_vllm_scheduler.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cachelib import create_cache
from cachelib.hashing import numba_installed
from experiments.engine import CostModelExecutor, FixedStepExecutor, ServingConfig
from experiments.engine import kernels as K
from experiments.engine.cache_client import CacheClient
from experiments.engine.clock import VirtualClock
from experiments.engine.compiled import RULES, engine_kernels
from experiments.engine.running import RunningRows
from experiments.engine.vllm import VllmScheduler

needs_numba = pytest.mark.skipif(not numba_installed(), reason="the compiled path needs numba (the fast extra)")
KERNELS = ["numpy", *(["numba"] if numba_installed() else [])]


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return a.dtype == np.asarray(b).dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    return a == b or (a != a and b != b)  # scalars; NaN is NaN


def _both(rule: str, *args):
    """`rule` on copies of `args` by each path: its results and the arrays after it (in place)."""
    out = []
    for kernels in (engine_kernels("numpy"), engine_kernels("numba")):
        copies = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        got = getattr(kernels, rule)(*copies)
        out.append((got, [c for c in copies if isinstance(c, np.ndarray)]))
    return out


def _rows(rng, m: int, page: int):
    computed = rng.integers(0, 400, m)
    known = computed + rng.integers(0, 3, m) * rng.integers(0, 200, m)
    placeholders = rng.integers(0, 2, m) * (rng.random(m) < 0.3)
    prompt = np.minimum(known, rng.integers(1, 300, m))
    total = known + placeholders + rng.integers(0, 4, m)
    capacity = (-(-(computed + rng.integers(0, 2 * page, m)) // page)) * page
    return computed, known, placeholders, total, capacity, prompt


@needs_numba
def test_every_rule_is_the_same_compiled_and_as_written():
    rng = np.random.default_rng(5)
    for trial in range(400):
        m = int(rng.integers(0, 40))
        page = int(rng.choice([1, 4, 16]))
        computed, known, placeholders, total, capacity, prompt = _rows(rng, m, page)
        budget = int(rng.integers(0, 600))
        lazy, quiet = bool(rng.random() < 0.7), bool(rng.random() < 0.3)
        (a, _), (b, _) = _both(
            "plan_rows", computed, known, placeholders, total, capacity, prompt, budget, page, lazy, quiet
        )
        assert _same(a, b), trial
        n, kind = a
        end = computed + n
        private = rng.random(m) < 0.5
        for promise in (K.PROMISE_ALWAYS, K.PROMISE_WHILE_FREE, K.PROMISE_IF_PRIVATE):
            free = int(rng.integers(0, 6))
            lazy_rows = (kind >= K.EXCUSED) & (kind < K.CALLS)
            (x, _), (y, _) = _both("unproven_rows", end, capacity, page, promise, free, private, lazy_rows)
            assert _same(x, y), trial
        in_flight = rng.integers(0, 3, m)
        for async_loop in (False, True):
            (x, xs), (y, ys) = _both("after_schedule", computed, known, placeholders, in_flight, n, async_loop)
            assert _same(x, y) and all(_same(u, v) for u, v in zip(xs, ys, strict=True)), trial
        generated = rng.integers(0, 50, m)
        target = generated + rng.integers(0, 3, m)
        has_first, timed = rng.random(m) < 0.6, rng.random(m) < 0.8
        last = np.where(rng.random(m) < 0.3, np.nan, rng.random(m))
        prev = float(last[0]) if m and rng.random() < 0.5 and not np.isnan(last[0]) else 0.25
        tokens = (rng.random(m) < 0.7).astype(np.int64) * rng.choice([1, 5], m)
        args = (known, generated, target, has_first, timed, last, tokens, 0.5, 0.75, prev, bool(rng.random() < 0.8))
        (x, xs), (y, ys) = _both("deliver", *args)
        assert _same(x, y) and all(_same(u, v) for u, v in zip(xs, ys, strict=True)), trial
        new = np.where(rng.random(m) < 0.2, 0, rng.integers(1, 9000, m))
        (x, _), (y, _) = _both("price_rows", new, computed, 4.0 * 32 * 32 * 128, 2.0 * 8e9)
        assert _same(tuple(float(v) for v in x), tuple(float(v) for v in y)), trial
        ones = np.where(rng.random(m) < 0.9, 1, 2)
        (x, _), (y, _) = _both("window_bound", ones, computed, computed, generated, target + 40, 4096)
        assert int(x) == int(y)
        spare, most = int(rng.integers(0, 30)), int(rng.integers(1, 200))
        (x, _), (y, _) = _both("most_steps", computed, capacity, page, spare, most)
        assert int(x) == int(y)
        committed = np.minimum(computed, capacity)
        (x, _), (y, _) = _both("window_calls", computed + most, capacity, committed, page, lazy, quiet)
        assert _same(x, y)


def test_the_rules_are_the_kernels_module_and_named():
    plain = engine_kernels("numpy")
    assert plain.name == "numpy" and all(getattr(plain, r) is getattr(K, r) for r in RULES)
    with pytest.raises(ValueError, match="unknown engine kernel 'fast'"):
        engine_kernels("fast")


def test_numba_is_asked_for_only_where_installed(monkeypatch):
    from experiments.engine import compiled

    with pytest.raises(ValueError, match="unknown engine kernel 'fast'"):
        CostModelExecutor(kernel="fast")
    with pytest.raises(ValueError, match="unknown engine kernel"):
        VllmScheduler(
            CacheClient(create_cache("apc", num_pages=8, page_size=4)), CostModelExecutor(), ServingConfig(),
            VirtualClock([]), kernel="c",
        )  # fmt: skip
    monkeypatch.setattr(compiled, "numba_installed", lambda: False)
    assert CostModelExecutor(kernel="auto").kernel == "numpy"  # without numba: as written
    with pytest.raises(ValueError, match=r"needs numba: pip install 'prefix-cache-lab\[fast\]'"):
        CostModelExecutor(kernel="numba")


def test_the_budget_goes_in_running_order_and_the_lazy_rule_classifies_each_step():
    """Rows needing 5, 1, 3, 1 tokens under a budget of 7: 5, 1, 1, 0. Page 4, capacity 8:
    a decode step to 6 inside its table is excused, one to 8 fills its last page, one to 9
    needs a page, a one-token prefill chunk (to the prompt's end) calls."""
    computed = np.array([0, 5, 10, 7], dtype=np.int64)
    known = np.array([5, 6, 13, 8], dtype=np.int64)
    zero = np.zeros(4, dtype=np.int64)
    total = known + 10
    n, kind = K.plan_rows(
        computed, known, zero, total, np.array([8, 8, 12, 8]), np.array([5, 5, 13, 5]), 7, 4, True, False
    )
    assert n.tolist() == [5, 1, 1, 0]
    assert kind.tolist() == [K.CALLS, K.EXCUSED, K.CALLS, K.IDLE]
    decode = np.array([5, 7, 8], dtype=np.int64)
    n, kind = K.plan_rows(
        decode,
        decode + 1,
        np.zeros(3, np.int64),
        decode + 9,
        np.array([8, 8, 8]),
        np.array([3, 3, 3]),
        99,
        4,
        True,
        False,
    )
    assert kind.tolist() == [K.EXCUSED, K.FILLS, K.NEW_PAGE]
    _, quiet = K.plan_rows(
        decode,
        decode + 1,
        np.zeros(3, np.int64),
        decode + 9,
        np.array([8, 8, 8]),
        np.array([3, 3, 3]),
        99,
        4,
        True,
        True,
    )
    assert quiet.tolist() == [K.EXCUSED, K.EXCUSED, K.NEW_PAGE]  # fills publish nothing: excused
    _, eager = K.plan_rows(
        decode,
        decode + 1,
        np.zeros(3, np.int64),
        decode + 9,
        np.array([8, 8, 8]),
        np.array([3, 3, 3]),
        99,
        4,
        False,
        False,
    )
    assert eager.tolist() == [K.CALLS] * 3
    # async: a row whose in-flight token is its last (computed + 2 - placeholders >= total) takes no step
    n, _ = K.plan_rows(
        np.array([9]), np.array([9]), np.array([1]), np.array([10]), np.array([16]), np.array([4]), 99, 4, False, False
    )
    assert n.tolist() == [0]


def test_deliver_counts_first_tokens_finishes_and_gaps():
    """Three timed rows get a token at 2.0 after the previous step's end at 1.5: the one whose
    last token came then shares the step's gap, the one whose came at 1.0 has its own 1.0,
    the one without a token yet has no gap (its first); the untimed one has none either."""
    known, generated = np.array([5, 5, 5, 5]), np.array([1, 1, 0, 2])
    target, has_first = np.array([9, 2, 9, 9]), np.array([True, True, False, True])
    timed, last = np.array([True, True, True, False]), np.array([1.5, 1.0, np.nan, 1.5])
    firsts, done, gaps, regular = K.deliver(
        known, generated, target, has_first, timed, last, np.array([1, 1, 1, 1]), 2.0, 2.0, 1.5, True
    )
    assert firsts.tolist() == [2] and done.tolist() == [1] and gaps.tolist() == [1.0] and regular == 1
    assert generated.tolist() == [2, 2, 1, 3] and last[:3].tolist() == [2.0, 2.0, 2.0] and last[3] == 1.5


@pytest.mark.parametrize("kernel", KERNELS)
def test_batch_seconds_is_the_step_loop_to_the_last_bit(kernel):
    """The cost model's array step time adds the same terms in the same order as its loop,
    by either path; items computing nothing are not in the step."""
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


def test_fresh_token_run_is_fresh_tokens():
    """`fresh_token_run(k)` hands out the ids `fresh_tokens(k)` would, and moves the counter alike."""
    a, b = CostModelExecutor(), CostModelExecutor()
    for k in (1, 5, 0, 3):
        assert list(a.fresh_token_run(k)) == b.fresh_tokens(k)
    assert a.fresh_tokens(2) == b.fresh_tokens(2)
    f, g = FixedStepExecutor(0.01), FixedStepExecutor(0.01)
    assert list(f.fresh_token_run(4)) == g.fresh_tokens(4)


def test_running_rows_keep_their_values_through_growth_rebinding_and_deletes():
    """`RunningRows` holds fields as views of preallocated blocks: against plain lists, under
    admissions past the initial room (the blocks double), in-place updates, fields rebound
    to new arrays (copied back before rows join or leave) and deletes of single rows and of
    sets of rows, every field of every row stays right."""
    rng = np.random.default_rng(7)
    rows = RunningRows(room=2)
    ints = RunningRows.INT_FIELDS
    model: list[dict] = []
    for step in range(400):
        op = rng.integers(0, 5)
        if op <= 1 or not model:
            v = {name: int(x) for name, x in zip(ints, rng.integers(0, 1000, len(ints)), strict=True)}
            v["admission"] = step
            last = None if rng.random() < 0.3 else float(rng.random())
            first, timed, private = bool(rng.random() < 0.5), bool(rng.random() < 0.8), bool(rng.random() < 0.5)
            r = SimpleNamespace(
                counters=SimpleNamespace(known=v["known"], placeholders=v["placeholders"], in_flight=v["in_flight"]),
                generated=v["generated"], target=v["target"], computed_tokens=v["work"], last_token_at=last,
                seq=SimpleNamespace(num_computed=v["committed"], prompt_len=v["prompt"]),
                spec=SimpleNamespace(prompt_len=v["total"] - v["target"]),
                first_token_at=0.0 if first else None, sample_of=None if timed else "p",
            )  # fmt: skip
            rows.append(r, v["computed"], v["capacity"], step, private)
            model.append(
                v | {"last": np.nan if last is None else last, "has_first": first, "timed": timed, "private": private}
            )
        elif op == 2:  # in place, as a step does
            rows.known += 1
            rows.capacity[len(model) - 1] = 5
            rows.has_first[0] = True
            for v in model:
                v["known"] += 1
            model[-1]["capacity"] = 5
            model[0]["has_first"] = True
        elif op == 3:  # rebound
            rows.computed = rows.computed + 3
            rows.last = rows.last * 2
            for v in model:
                v["computed"] += 3
                v["last"] *= 2
        else:
            if rng.random() < 0.5:
                where = int(rng.integers(0, len(model)))
                gone = {where}
            else:
                gone = set(rng.choice(len(model), size=min(3, len(model)), replace=False).tolist())
                where = np.array(sorted(gone))
            rows.delete(where)
            model = [v for i, v in enumerate(model) if i not in gone]
        assert len(rows) == len(model)
        for name in RunningRows.FIELDS:
            got, want = getattr(rows, name).tolist(), [v[name] for v in model]
            assert np.array_equal(np.array(got, dtype=float), np.array(want, dtype=float), equal_nan=True), (step, name)
        for v in model:  # admissions increase in running order: each row is found by its own
            assert rows.row_of(v["admission"]) == model.index(v)
    assert rows.row_of(10**6) is None
    with pytest.raises(ValueError, match="rows"):  # a rebound field of the wrong length is refused
        rows.known = np.zeros(len(rows) + 1, dtype=np.int64)
        rows.delete(np.array([], dtype=np.int64))
