"""Storage (L3) transfers on the serving clock (`radix-hicache` with `storage_backend`,
SGLang 0.5.23 HiCache storage; experiments/engine/vllm_scheduler.py
`storage_prefetch_ready`): a request's prefetch is read on the one storage -> host stream
from its arrival; `best_effort` takes the whole pages that arrived when the scheduler
considers the request, `wait_complete` holds it until the read is done, `timeout` holds
it up to base + per-1024-token seconds from the first poll it blocked, then takes what
arrived; a storage write runs after its backup's acknowledgement with the host copy
locked until it completes.

Figures: a KV of 1,000,000 bytes per token; storage at 10 GB/s reads 10 tokens per ms
(a 16-token page in 1.6 ms); the host link at 1000 GB/s (a 64-token load-back 64 us);
a fixed 10 ms step. The scenario: A (a 64-token document + 16) is computed, backed up
and written to storage; four 120-token fillers push it off the GPU and the host; B (the
document + 16 others) then finds it in storage only."""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import create_cache
from cachelib.errors import InvalidRequestError
from cachelib.tiers import PREFETCH_TIMEOUT_BASE_S, PREFETCH_TIMEOUT_PER_KI_TOKEN_S, pipelined_step_seconds
from cachelib.types import Sequence
from experiments.engine import ServingConfig
from experiments.engine.cache_client import CacheClient
from experiments.engine.executors import FixedStepExecutor
from experiments.engine.serving import serve
from experiments.engine.transfers import TransferClock
from experiments.workloads.spec import RequestSpec

STEP = 0.01
KV = 1_000_000
PAGE = 16
DOC = np.arange(1000, 1064, dtype=np.int32)
LAYERS = FixedStepExecutor.num_layers
B_AT = 10.0


def _spec(rid: str, tokens, at: float) -> RequestSpec:
    return RequestSpec(rid, np.asarray(tokens, dtype=np.int32), 2, at)


def _requests(busy: bool, b_extra: int = 16) -> list[RequestSpec]:
    """The scenario; `busy`: D (16 tokens) arrives 5 ms before B, so B is first considered
    at the end of D's step, 5 ms after its arrival."""
    out = [_spec("a", np.concatenate([DOC, np.arange(2000, 2016)]), 0.0)]
    out += [_spec(f"f{i}", np.arange(5000 + 1000 * i, 5120 + 1000 * i), 1.0 + i) for i in range(4)]
    if busy:
        out.append(_spec("d", np.arange(20000, 20016), B_AT - 0.005))
    out.append(_spec("b", np.concatenate([DOC, np.arange(3000, 3000 + b_extra)]), B_AT))
    return out


def _serve(policy: str, busy: bool, *, read_gbps: float = 10.0, timed: bool = True, b_extra: int = 16):
    cache = create_cache(
        "radix-hicache",
        num_pages=8,
        page_size=PAGE,
        host_capacity_tokens=256,
        kv_bytes_per_token=KV,
        host_read_gbps=1000.0,
        host_write_gbps=1000.0,
        storage_backend="file",
        storage_read_gbps=read_gbps,
        storage_write_gbps=10.0,
        prefetch_threshold=16,
        prefetch_policy=policy,
    )
    config = ServingConfig(token_budget=512, max_running=16, time_transfers=timed)
    res = serve(cache, _requests(busy, b_extra), FixedStepExecutor(STEP), config)
    cache.check_invariants()
    return {r["request_id"]: r for r in res.requests}, res, cache


def _load_step(tokens: int) -> float:
    """B's prefill step with `tokens` loaded back from the host layer by layer."""
    return pipelined_step_seconds(STEP, tokens * KV / 1000e9, LAYERS)


def test_best_effort_takes_the_whole_pages_arrived_when_considered():
    """B is considered 5 ms after it arrived: 50 tokens were read, 3 whole pages taken."""
    recs, res, cache = _serve("best_effort", busy=True)
    b = recs["b"]
    elapsed = 0.005
    arrived = int(elapsed * 10e9 / KV / PAGE) * PAGE
    assert arrived == 48
    assert b["storage_hit_tokens"] == arrived and b["host_hit_tokens"] == arrived
    assert b["prefetch_wait_s"] == 0.0
    assert b["ttft"] == pytest.approx(elapsed + _load_step(arrived), rel=1e-9)
    assert res.transfers["storage_to_host_tokens"] == arrived  # the rest was never read
    assert cache.tier_traffic()["prefetched"] == arrived


def test_best_effort_at_arrival_takes_nothing():
    """SGLang's best_effort on an idle server: the request is scheduled the moment it
    arrives, before any page of its prefetch landed, and recomputes (reproduced)."""
    recs, _, cache = _serve("best_effort", busy=False)
    assert recs["b"]["storage_hit_tokens"] == 0 and recs["b"]["host_hit_tokens"] == 0
    assert recs["b"]["ttft"] == pytest.approx(STEP, rel=1e-9)
    assert cache.tier_traffic()["prefetched"] == 0


def test_wait_complete_delays_the_first_token_by_the_prefetch():
    recs, res, _ = _serve("wait_complete", busy=False)
    b = recs["b"]
    read = 64 * KV / 10e9  # 6.4 ms
    assert b["storage_hit_tokens"] == 64 and b["host_hit_tokens"] == 64
    assert b["prefetch_wait_s"] == pytest.approx(read, rel=1e-9)
    assert b["ttft"] == pytest.approx(read + _load_step(64), rel=1e-9)
    assert res.transfers["storage_to_host_tokens"] == 64
    assert res.transfers["storage_to_host_bytes"] == 64 * KV


def test_wait_complete_when_busy_waits_for_the_next_poll():
    """Considered 5 ms after arrival (not done: 6.4 ms), B is skipped and taken at the
    next step's poll, 10 ms later."""
    recs, _, _ = _serve("wait_complete", busy=True)
    assert recs["b"]["storage_hit_tokens"] == 64
    assert recs["b"]["prefetch_wait_s"] == pytest.approx(STEP, rel=1e-9)
    assert recs["b"]["ttft"] == pytest.approx(0.005 + STEP + _load_step(64), rel=1e-9)


def test_timeout_takes_what_arrived_at_the_deadline():
    """Storage at 0.016 GB/s reads one page a second; the 64-token read would take 4 s.
    B blocks at its arrival; at the deadline 1 + 64/1024 x 0.25 s later, one page arrived."""
    recs, _, _ = _serve("timeout", busy=False, read_gbps=0.016)
    b = recs["b"]
    deadline = PREFETCH_TIMEOUT_BASE_S + 64 / 1024 * PREFETCH_TIMEOUT_PER_KI_TOKEN_S
    assert deadline == 1.015625
    assert b["storage_hit_tokens"] == 16
    assert b["prefetch_wait_s"] == pytest.approx(deadline, rel=1e-9)
    assert b["ttft"] == pytest.approx(deadline + _load_step(16), rel=1e-9)
    done, _, _ = _serve("wait_complete", busy=False, read_gbps=0.016)
    assert done["b"]["storage_hit_tokens"] == 64
    assert done["b"]["prefetch_wait_s"] == pytest.approx(4.0, rel=1e-9)


def test_timeout_counts_the_tokens_asked_for():
    """B asks storage for the 96 tokens past its match (112 - 1, whole pages) and storage
    holds 64: the budget counts the 96 asked (SGLang's `stats_requested_tokens`)."""
    recs, _, _ = _serve("timeout", busy=False, read_gbps=0.016, b_extra=48)
    deadline = PREFETCH_TIMEOUT_BASE_S + 96 / 1024 * PREFETCH_TIMEOUT_PER_KI_TOKEN_S
    assert recs["b"]["prefetch_wait_s"] == pytest.approx(deadline, rel=1e-9)
    assert recs["b"]["storage_hit_tokens"] == 16


def test_timeout_before_the_deadline_is_wait_complete():
    recs, _, _ = _serve("timeout", busy=False)
    ref, _, _ = _serve("wait_complete", busy=False)
    assert recs["b"] == ref["b"]


def test_instant_transfers_take_the_whole_prefetch_for_every_policy():
    """`time_transfers` off: the prefetch completes at once, whatever the policy (the
    replay protocol's timing); no prefetch waits."""
    for policy in ("best_effort", "wait_complete", "timeout"):
        recs, res, cache = _serve(policy, busy=True, timed=False)
        assert res.transfers is None
        assert all(r["prefetch_wait_s"] == 0.0 for r in recs.values())
        assert sum(r["storage_hit_tokens"] for r in recs.values()) == cache.storage_hit_tokens_total


def test_serving_tiers_report_storage_traffic():
    from experiments.report.metrics import tier_section

    _, res, cache = _serve("wait_complete", busy=False)
    tiers = tier_section(res)
    assert tiers["storage_hit_tokens"] == 64
    assert tiers["storage_to_host_bytes"] == 64 * KV
    assert tiers["host_to_storage_bytes"] == res.transfers["host_to_storage_tokens"] * KV > 0
    assert tiers["prefetch_wait_s"] == pytest.approx(64 * KV / 10e9, rel=1e-9)
    # every page written was timed: the clock's writes are the tree's
    assert res.transfers["host_to_storage_tokens"] == cache.tier_traffic()["stored"]
    assert tiers["storage_hit_tokens"] == cache.storage_hit_tokens_total


def test_storage_write_follows_the_backup_ack_and_holds_the_host_copy():
    """At the cache: the backup's ticket completes, then the storage write is reported;
    until its own ticket completes the host copy cannot be evicted."""
    cache = create_cache(
        "radix-hicache",
        num_pages=8,
        page_size=PAGE,
        host_capacity_tokens=256,
        kv_bytes_per_token=KV,
        host_write_gbps=1.0,
        storage_backend="file",
        storage_write_gbps=1.0,
    )
    clock = TransferClock(cache, 32)
    client = CacheClient(cache)
    seq = Sequence("x", np.arange(100, 165, dtype=np.int32))
    client.admit(seq, client.match(seq), 65)
    client.commit(seq, 65)
    client.release(seq)
    [backup] = cache.take_transfers()
    assert (backup.src, backup.dst, backup.tokens) == ("gpu", "host", 64)
    clock.poll(clock.issue(backup, 0.0))  # acknowledged at 64 ms
    [store] = cache.take_transfers()
    assert (store.src, store.dst, store.tokens) == ("host", "storage", 64) and store.ticket is not None
    done = clock.issue(store, 0.064)
    assert done == pytest.approx(0.128, rel=1e-12)
    assert cache.evict(4) == 4  # the device copy goes; the host copy stays, locked
    assert cache.tree.evict_host(64) == 0
    clock.poll(done - 1e-9)
    assert cache.tree.evict_host(64) == 0
    clock.poll(done)
    assert cache.tree.evict_host(64) == 64
    cache.check_invariants()


def test_limit_prefetch_refuses_bad_input():
    with_storage = create_cache("radix-hicache", num_pages=8, page_size=PAGE, storage_backend="file")
    seq = Sequence("x", np.arange(10, dtype=np.int32))
    with pytest.raises(InvalidRequestError, match="non-negative"):
        with_storage.limit_prefetch(seq, -1)
    for other in (
        create_cache("radix-hicache", num_pages=8, page_size=PAGE),
        create_cache("radix", num_pages=8, page_size=PAGE),
    ):
        with pytest.raises(InvalidRequestError, match="storage tier"):
            other.limit_prefetch(seq, 16)
        assert other.storage_prefetch(seq, CacheClient(other).match(seq)) == (0, 0)


def test_a_prefetch_done_while_its_request_does_not_fit_is_not_waited_for(tmp_path):
    """A request whose prefetch completed but that does not fit yet waits for the next real
    event (a ticket in flight), not for its prefetch's past completion: the engine once took
    empty steps at the same instant forever there (docs on a 40-page cache with storage)."""
    import signal

    from experiments.workloads.registry import make_workload

    requests = make_workload(
        "shared_doc_qa", seed=3, num_documents=4, doc_len=300, num_requests=60, output_len=40,
        output_dist="uniform", rate=50.0, vocab_size=5000,
    ).requests  # fmt: skip
    cache = create_cache(
        "radix-hicache", num_pages=40, page_size=PAGE, host_capacity_tokens=1280, storage_backend="file",
        prefetch_threshold=32,
    )  # fmt: skip
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the serving loop did not end"))
    signal.alarm(60)
    try:
        from experiments.engine import CostModelExecutor

        res = serve(cache, requests, CostModelExecutor(), ServingConfig(token_budget=512, max_running=16))
    finally:
        signal.alarm(0)
    assert len(res.requests) == 60 and not res.aborted
    cache.check_invariants()
