"""The engine's objects on their own: call-order checks, declared executor capabilities,
schedulers sharing one clock."""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import Sequence, create_cache
from cachelib.types import NO_EXTRA
from experiments.engine import (
    CacheClient,
    CallOrderError,
    CostModelExecutor,
    ModelExecutor,
    ServingConfig,
    VirtualClock,
    serve,
)
from experiments.engine.serving import drive
from experiments.engine.vllm import VllmScheduler
from experiments.workloads.spec import RequestSpec


def _seq(rid: str, n: int = 10) -> Sequence:
    return Sequence(rid, np.arange(n, dtype=np.int32))


def test_cache_client_times_calls_and_enforces_the_call_order():
    client = CacheClient(create_cache("apc", num_pages=16, page_size=4))
    s = _seq("a")
    with pytest.raises(CallOrderError, match="not admitted"):
        client.commit(s, 4)
    m = client.match(s)
    assert client.admit(s, m, len(s)) is not None and client.is_live(s)
    with pytest.raises(CallOrderError, match="already admitted"):
        client.admit(s, client.match(s), len(s))
    client.commit(s, len(s))
    child = s.fork("a/1")
    assert client.fork(s, child) is not None and client.num_live == 2
    with pytest.raises(CallOrderError, match="already live"):
        client.fork(s, child)
    client.release(child)
    client.release(s)
    with pytest.raises(CallOrderError, match="already released"):
        client.release(s)
    assert client.num_live == 0 and client.seconds > 0
    client.cache.check_invariants()


@pytest.mark.parametrize("backend", ["apc", "radix", "none"])
def test_advance_makes_the_calls_one_by_one_would(backend):
    """`CacheClient.advance` (flush, grow, publish in one timed region) leaves the cache, the
    sequence and the returned copies as the separate calls do, when the grow fits and when
    it does not (the flush commit made, nothing grown); it refuses a sequence not live."""

    def run(one_region: bool):
        client = CacheClient(create_cache(backend, num_pages=4, page_size=4))
        a, b = _seq("a", 9), _seq("b", 30)
        client.admit(a, client.match(a), 5)
        client.commit(a, 5)
        a.append(np.arange(100, 110, dtype=np.int32))
        out = []
        for committed, to, published in ((6, 12, 12), (12, 13, 0), (13, 19, 19)):
            if one_region:
                out.append(client.advance(a, committed, to, published))
            else:
                if committed > a.num_computed:
                    client.commit(a, committed)
                ops = client.grow(a, to)
                if ops is not None and published > a.num_computed:
                    client.commit(a, published)
                out.append(ops)
            out.append((a.num_computed, list(a.page_table)))
        with pytest.raises(CallOrderError, match="not admitted"):
            client.advance(b, 1, 2, 2)
        stats = client.cache.stats()
        client.cache.check_invariants()
        return out, stats.pages_free, stats.pages_cached, stats.hit_tokens

    got, want = run(True), run(False)
    assert got == want
    assert got[0][-2] is None  # the last grow did not fit


@pytest.mark.parametrize("backend", ["apc", "radix", "none"])
def test_advance_all_is_advance_in_order_up_to_the_first_grow_that_does_not_fit(backend):
    """`CacheClient.advance_all` makes each step's calls as `advance` would, in order, in one
    timed region; a commit-only step (no grow) publishes; after a grow that does not fit it
    makes no further call; a sequence not live is refused before any call."""

    def setup():
        client = CacheClient(create_cache(backend, num_pages=8, page_size=4))
        seqs = [Sequence(f"s{j}", np.arange(6, dtype=np.int32) + 100 * j) for j in range(3)]
        for s in seqs:
            client.admit(s, client.match(s), 6)  # two pages each, two left
            client.commit(s, 4)
            s.append(np.arange(200 + 10 * int(s.request_id[1:]), 206 + 10 * int(s.request_id[1:]), dtype=np.int32))
        return client, seqs

    def state(client, seqs):
        client.cache.check_invariants()
        st = client.cache.stats()
        return [(s.num_computed, list(s.page_table)) for s in seqs], st.pages_free, st.pages_cached

    plan = [(0, 5, 8, 8), (1, 0, None, 6), (2, 6, 12, 12), (0, 8, 12, 9), (1, 6, 12, 12), (1, 0, None, 8)]
    a_client, a = setup()
    got = a_client.advance_all([(a[j], c, n, p) for j, c, n, p in plan])
    b_client, b = setup()
    want = []
    for j, c, n, p in plan:
        if n is None:
            if p > b[j].num_computed:
                b_client.commit(b[j], p)
            want.append([])
            continue
        ops = b_client.advance(b[j], c, n, p)
        want.append(ops)
        if ops is None:
            break
    assert got == want and got[-1] is None and len(got) == 5  # the fifth grow finds no page
    assert state(a_client, a) == state(b_client, b)
    stranger = _seq("x")
    with pytest.raises(CallOrderError, match="not admitted"):
        a_client.advance_all([(a[0], 0, 12, 12), (stranger, 0, 1, 1)])
    assert state(a_client, a) == state(b_client, b)  # refused before any call


@pytest.mark.parametrize("backend", ["apc", "radix", "paged", "none"])
def test_prefill_is_match_admit_commit_in_one_region(backend):
    """`CacheClient.prefill` (the replay's match, admit of the whole sequence and commit, one
    timed region) leaves the cache and the sequences as the separate calls do, returns the
    computed count right after admit (the hit), admits nothing when the sequence does not
    fit, and refuses a sequence already live before any call."""

    def run(one_region: bool):
        client = CacheClient(create_cache(backend, num_pages=6, page_size=4))
        out = []
        for rid, n in (("a", 9), ("b", 13), ("c", 30), ("d", 11)):
            s = Sequence(rid, np.arange(n, dtype=np.int32) % 9)  # shared prefixes: hits
            if one_region:
                m, ops, hit = client.prefill(s)
            else:
                m = client.match(s)
                ops = client.admit(s, m, len(s))
                hit = s.num_computed if ops is not None else 0
                if ops is not None:
                    client.commit(s, len(s))
            out.append((m.num_tokens, m.pages, ops, hit, s.num_computed, list(s.page_table), client.is_live(s)))
            if rid == "a":  # (it fits everywhere)
                with pytest.raises(CallOrderError, match="already admitted"):
                    client.prefill(s)
        client.cache.check_invariants()
        st = client.cache.stats()
        return out, st.pages_free, st.pages_cached, st.hit_tokens, client.num_live

    got, want = run(True), run(False)
    assert got == want
    c = got[0][2]
    assert c[2] is None and not c[-1] and c[4] == 0  # "c" did not fit: not live, nothing computed
    if backend in ("apc", "radix"):  # (paged reuses declared prefixes only)
        assert any(row[3] > 0 for row in got[0])  # a hit was returned


def test_a_failed_admit_leaves_the_sequence_unadmitted():
    client = CacheClient(create_cache("none", num_pages=2, page_size=4))
    s = _seq("big", 20)
    assert client.admit(s, client.match(s), len(s)) is None
    assert not client.is_live(s)
    with pytest.raises(CallOrderError):
        client.grow(s, 21)


def test_executors_declare_their_capabilities():
    assert CostModelExecutor.supports_decode_windows and CostModelExecutor.samples_fresh_tokens
    assert not ModelExecutor.supports_decode_windows and not ModelExecutor.samples_fresh_tokens


def _specs(prefix: str, n: int) -> list[RequestSpec]:
    rng = np.random.default_rng(7)
    return [RequestSpec(f"{prefix}{i}", rng.integers(0, 500, 64, dtype=np.int32), 8, i * 0.01) for i in range(n)]


def test_two_schedulers_share_one_clock_and_each_equals_serving_alone():
    """Two replicas on one clock: a driver steps whichever is due first. Each serves only
    its own requests, so each must equal `serve` of those requests alone."""
    specs_a, specs_b = _specs("a", 12), _specs("b", 12)
    clock = VirtualClock(specs_a + specs_b)
    replicas = {
        p: VllmScheduler(CacheClient(create_cache("apc", num_pages=200, page_size=16)), CostModelExecutor(), cfg, clock)
        for p, cfg in (("a", ServingConfig(256, 4)), ("b", ServingConfig(256, 4)))
    }
    busy_until = dict.fromkeys(replicas, 0.0)
    while clock.has_arrivals or any(s.has_work for s in replicas.values()):
        for arrival, spec in clock.arrived():
            replicas[spec.request_id[0]].add(spec, arrival)
        due = [p for p, s in replicas.items() if s.has_work and busy_until[p] <= clock.now]
        if not due:
            times = [t for p, t in busy_until.items() if replicas[p].has_work] + [clock.next_arrival() or np.inf]
            clock.now = max(clock.now, min(times))
            continue
        saved = clock.now
        for p in due:
            clock.now = saved
            end = replicas[p].step()
            busy_until[p] = end if end is not None else saved
        clock.now = saved
    for p, specs in (("a", specs_a), ("b", specs_b)):
        alone = serve(
            create_cache("apc", num_pages=200, page_size=16), specs, CostModelExecutor(), ServingConfig(256, 4)
        )
        got = replicas[p].result
        assert sorted(r["request_id"] for r in got.requests) == sorted(s.request_id for s in specs)
        key = lambda r: r["request_id"]  # noqa: E731
        for x, y in zip(sorted(got.requests, key=key), sorted(alone.requests, key=key), strict=True):
            assert x["hit_tokens_first"] == y["hit_tokens_first"] and x["computed_tokens"] == y["computed_tokens"]


def test_drive_is_what_serve_runs():
    specs = _specs("r", 20)
    cache = create_cache("radix", num_pages=100, page_size=16)
    clock = VirtualClock(specs)
    scheduler = VllmScheduler(CacheClient(cache), CostModelExecutor(), ServingConfig(128, 8), clock)
    drive(clock, scheduler, {s.request_id: i for i, s in enumerate(specs)})
    ref = serve(create_cache("radix", num_pages=100, page_size=16), specs, CostModelExecutor(), ServingConfig(128, 8))
    assert scheduler.result.requests == ref.requests and scheduler.result.steps == ref.steps
    assert clock.now == ref.makespan


def test_a_declared_prefix_is_live_in_the_client_once_registered():
    cache = create_cache("paged", num_pages=8, page_size=4)
    client = CacheClient(cache)
    assert client.register_prefix(np.arange(40, dtype=np.int32), NO_EXTRA) is None  # does not fit
    pid, pseq = client.register_prefix(np.arange(8, dtype=np.int32), NO_EXTRA)
    assert pseq is cache.prefix_sequence(pid) and client.is_live(pseq)
    client.commit(pseq, len(pseq))
    cache.check_invariants()


def test_a_cell_with_declared_prefixes_registers_them_through_a_client():
    """paged shares only declared prefixes: the runner registers and computes them first
    (through a `CacheClient`, so the call order is checked), then every request hits them."""
    from experiments.runs.runner import CellConfig, run_cell
    from experiments.workloads.generators import Workload

    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 500, 32, dtype=np.int32)
    specs = [
        RequestSpec(
            f"q{i}", np.concatenate([prefix, rng.integers(0, 500, 8, dtype=np.int32)]), 4, i * 0.01, prefix_id=7
        )
        for i in range(6)
    ]
    workload = Workload("declared", specs, declared_prefixes={7: prefix})
    out = run_cell(CellConfig("paged", "declared", 4096, page_size=16, protocol="both"), workload)
    assert out["replay"]["hit_tokens"] == 6 * 32 and out["serving"]
