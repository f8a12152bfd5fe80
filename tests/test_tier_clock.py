"""Tier transfers on the serving clock (experiments/engine/transfers.py, cachelib/tiers.py):
the layer-by-layer load-back of SGLang HiCache, a node locked while its backup is in flight,
vLLM's asynchronous load wait, the metrics, and that nothing changes without tiers or
with instant transfers.

The small cases use a fixed step of 10 ms (so a step's compute is known exactly) and a KV
of 1,000,000 bytes per token at 1 GB/s each way (so 64 tokens move in 64 ms)."""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import create_cache
from cachelib.errors import InvalidRequestError
from cachelib.tiers import TierTransfer, pipelined_step_seconds
from cachelib.types import Sequence
from experiments.engine import CostModelExecutor, ServingConfig
from experiments.engine.cache_client import CacheClient
from experiments.engine.executors import FixedStepExecutor
from experiments.engine.serving import serve
from experiments.engine.transfers import TransferClock
from experiments.engine.vllm import VllmScheduler
from experiments.workloads.spec import RequestSpec

STEP = 0.01
KV = 1_000_000  # bytes per token: 64 tokens = 64 MB = 64 ms at 1 GB/s
TIER = dict(kv_bytes_per_token=KV, host_read_gbps=1.0, host_write_gbps=1.0)
LAYERS = FixedStepExecutor.num_layers

DOC = np.arange(1000, 1064, dtype=np.int32)


def _spec(rid: str, tokens: np.ndarray, arrival: float) -> RequestSpec:
    return RequestSpec(rid, tokens.astype(np.int32), 2, arrival)


def _three(b_arrival: float) -> list[RequestSpec]:
    """A (a 64-token document + 16), then C (120 unrelated tokens) which pushes A off an
    8-page GPU, then B (the document + 16 others): B's document is on the host only."""
    return [
        _spec("a", np.concatenate([DOC, np.arange(2000, 2016)]), 0.0),
        _spec("c", np.arange(5000, 5120), 1.0),
        _spec("b", np.concatenate([DOC, np.arange(3000, 3016)]), b_arrival),
    ]


def _serve(backend: str, requests, timed: bool, **opts):
    cache = create_cache(backend, num_pages=8, page_size=16, host_capacity_tokens=256, **TIER, **opts)
    config = ServingConfig(token_budget=512, max_running=16, time_transfers=timed)
    res = serve(cache, requests, FixedStepExecutor(STEP), config)
    cache.check_invariants()
    return {r["request_id"]: r for r in res.requests}, res, cache


# -- the pipeline formula ---------------------------------------------------------------


def _layer_recurrence(compute: float, load: float, layers: int) -> float:
    """Layer i's compute starts when layer i-1's ended and layer i is loaded."""
    end = 0.0
    for i in range(layers):
        end = max(end, (i + 1) * load / layers) + compute / layers
    return end


@pytest.mark.parametrize(
    "compute,load,layers", [(0.01, 0.064, 32), (0.064, 0.01, 32), (0.02, 0.02, 4), (0.5, 0.0, 32), (0.003, 0.2, 1)]
)
def test_pipelined_step_is_the_layer_recurrence(compute, load, layers):
    assert pipelined_step_seconds(compute, load, layers) == pytest.approx(
        _layer_recurrence(compute, load, layers), rel=1e-12
    )


def test_pipelined_step_exact_values():
    # load-bound: every layer's load, then the last layer's compute
    assert pipelined_step_seconds(0.01, 0.064, 32) == 0.064 + 0.01 / 32
    # compute-bound: the first layer's load, then all compute
    assert pipelined_step_seconds(0.064, 0.01, 32) == 0.064 + 0.01 / 32
    assert pipelined_step_seconds(0.01, 0.0, 32) == 0.01


# -- SGLang HiCache: layer-by-layer load-back -------------------------------------------


@pytest.mark.parametrize("policy,blocked", [("write_through", 0.0), ("write_back", 0.112)])
def test_hicache_load_back_step_is_the_pipeline(policy, blocked):
    """B loads its 64-token document back (64 ms) while it computes its 16 new tokens (one
    10 ms step): its first token comes `pipelined_step_seconds(10 ms, 64 ms, 32)` after it
    arrives; with instant transfers after one step. Under write_back, the load-back first
    evicts C's node, which is backed up then, and waited for (112 tokens: 112 ms)."""
    recs, res, _ = _serve("radix-hicache", _three(2.0), True, write_policy=policy)
    b = recs["b"]
    assert b["host_hit_tokens"] == 64 and b["gpu_hit_tokens"] == 0
    step = pipelined_step_seconds(STEP, 0.064, LAYERS)
    assert b["ttft"] == pytest.approx(blocked + step, rel=1e-9)
    assert b["load_stall_s"] == pytest.approx(step - STEP, rel=1e-9)
    assert res.transfers["host_to_gpu_tokens"] == 64
    assert res.transfers["host_to_gpu_bytes"] == 64 * KV
    instant, _, _ = _serve("radix-hicache", _three(2.0), False, write_policy=policy)
    assert instant["b"]["ttft"] == pytest.approx(STEP, rel=1e-9)
    assert instant["b"]["host_hit_tokens"] == 64
    assert instant["b"]["load_stall_s"] == 0.0


def test_hicache_node_in_flight_is_not_evictable_until_it_completes():
    """C's 112 full-page tokens are backed up from the end of its first step (1.01 s) for
    112 ms: until 1.122 s its node is locked, so B (arriving at 1.05 s) cannot evict it for
    its load-back and waits; it is admitted at 1.122 s and its step is the pipeline."""
    recs, _, _ = _serve("radix-hicache", _three(1.05), True)
    b = recs["b"]
    done = 1.0 + STEP + 0.112
    assert b["ttft"] == pytest.approx(done + pipelined_step_seconds(STEP, 0.064, LAYERS) - 1.05, rel=1e-9)
    assert b["host_hit_tokens"] == 64
    instant, _, _ = _serve("radix-hicache", _three(1.05), False)
    assert instant["b"]["ttft"] == pytest.approx(STEP, rel=1e-9)


def test_backup_lock_is_released_by_its_ticket_only():
    """At the cache: a write-through backup locks its node (nothing evictable) until
    `finish_transfers` names its ticket; the clock names it once it completes."""
    cache = create_cache("radix-hicache", num_pages=8, page_size=16, host_capacity_tokens=256, **TIER)
    clock = TransferClock(cache, 32)
    seq = Sequence("x", np.arange(100, 165, dtype=np.int32))
    client = CacheClient(cache)
    m = client.match(seq)
    client.admit(seq, m, 65)
    client.commit(seq, 65)
    client.release(seq)
    cache.check_invariants()
    assert cache.evict(4) == 0  # locked by its backup in flight
    [t] = [t for t in cache.take_transfers() if t.ticket is not None]
    assert (t.src, t.dst, t.tokens) == ("gpu", "host", 64)
    done = clock.issue(t, 5.0)
    assert done == 5.0 + 0.064
    clock.poll(done - 1e-9)
    assert cache.evict(4) == 0
    clock.poll(done)
    cache.check_invariants()
    assert cache.evict(4) == 4
    with pytest.raises(InvalidRequestError, match="ticket"):
        cache.finish_transfers([t.ticket])


def test_write_back_eviction_backup_blocks_the_step():
    """write_back backs a node up when the device evicts it, and SGLang waits for it: C's
    admission evicts A's 80 tokens, backed up before C's step can start (80 ms)."""
    recs, res, _ = _serve("radix-hicache", _three(2.0), True, write_policy="write_back")
    assert recs["c"]["ttft"] == pytest.approx(0.080 + STEP, rel=1e-9)
    assert res.transfers["backup_blocked_s"] == pytest.approx(0.080 + 0.112, rel=1e-9)  # C's, then B's eviction of C


# -- vLLM CPU offloading: the asynchronous load -----------------------------------------


def test_vllm_async_load_delays_the_first_token_by_the_load():
    """B's hit needs 64 tokens from the host: vLLM admits it, loads, and schedules it once
    the load is done, so its first token comes 64 ms later than with instant transfers."""
    recs, res, _ = _serve("apc", _three(2.0), True)
    b = recs["b"]
    assert b["host_hit_tokens"] == 64 and b["gpu_hit_tokens"] == 0
    assert b["load_wait_s"] == pytest.approx(0.064, rel=1e-9)
    assert b["ttft"] == pytest.approx(0.064 + STEP, rel=1e-9)
    assert b["load_stall_s"] == 0.0
    assert res.transfers["host_to_gpu_tokens"] == 64
    instant, _, _ = _serve("apc", _three(2.0), False)
    assert instant["b"]["ttft"] == pytest.approx(STEP, rel=1e-9)
    assert instant["b"]["host_hit_tokens"] == 64


def test_vllm_finished_request_keeps_blocks_until_its_stores_end():
    """A's prompt chunks (80 tokens) are stored from the end of its first step for 80 ms;
    A finishes after its second step (20 ms): its blocks stay held until 90 ms."""
    cache = create_cache("apc", num_pages=8, page_size=16, host_capacity_tokens=256, **TIER)
    config = ServingConfig(token_budget=512, max_running=16)
    from experiments.engine.clock import VirtualClock

    requests = _three(2.0)[:1]
    clock = VirtualClock(requests)
    s = VllmScheduler(CacheClient(cache), FixedStepExecutor(STEP), config, clock)
    s.add(requests[0], 0.0, 0)
    s.step()
    clock.now = STEP
    s.step()
    held = s.tiers.held
    assert not s.running and len(held) == 1
    assert held[0][0] == pytest.approx(STEP + 0.080, rel=1e-12)
    assert cache.pages_pinned() > 0  # still held
    clock.now = STEP + 0.080
    s.schedule()  # its poll releases what is done
    assert not s.tiers.held and cache.pages_pinned() == 0


# -- invariants and what does not change -----------------------------------------------


@pytest.mark.parametrize(
    "backend,opts", [("radix-hicache", {}), ("radix-hicache", {"write_policy": "write_back"}), ("apc", {})]
)
def test_timed_serving_keeps_the_cache_sound(backend, opts):
    """A busy workload under memory pressure: every request finishes, the cache's
    invariants hold, the tier metrics add up (GPU + host hit = every admission's hit)."""
    from experiments.workloads.registry import make_workload

    requests = make_workload(
        "multi_turn_chat", seed=3, num_conversations=8, turns=4, user_turn_len=60, answer_len=30,
        answer_dist="exponential", think_time=0.5, rate=20.0, vocab_size=5000,
    ).requests  # fmt: skip
    cache = create_cache(backend, num_pages=40, page_size=16, host_capacity_tokens=1280, **opts)
    res = serve(cache, requests, CostModelExecutor(), ServingConfig(token_budget=512, max_running=16))
    cache.check_invariants()
    assert len(res.requests) == len(requests) and not res.aborted
    for r in res.requests:
        assert r["gpu_hit_tokens"] + r["host_hit_tokens"] == r["hit_tokens_all_admissions"]
        assert r["load_stall_s"] >= 0 and r["load_wait_s"] >= 0
    assert sum(r["host_hit_tokens"] for r in res.requests) > 0
    assert res.transfers["host_to_gpu_tokens"] == sum(r["host_hit_tokens"] for r in res.requests) or backend == "apc"


def test_one_tier_caches_have_no_transfers_and_records_are_unchanged():
    requests = _three(2.0)
    cache = create_cache("radix", num_pages=8, page_size=16)
    res = serve(cache, requests, FixedStepExecutor(STEP), ServingConfig())
    assert res.transfers is None
    assert "host_hit_tokens" not in res.requests[0]
    with pytest.raises(InvalidRequestError, match="no memory tiers"):
        cache.time_transfers()


def test_a_tiered_cache_times_its_transfers_unless_told_not_to():
    from experiments.engine.clock import VirtualClock

    def policy(config):
        cache = create_cache("radix-hicache", num_pages=8, page_size=16)
        return VllmScheduler(CacheClient(cache), CostModelExecutor(), config, VirtualClock([]))

    assert policy(ServingConfig()).tiers is not None
    assert policy(ServingConfig(time_transfers=False)).tiers is None


def test_time_transfers_refused_once_the_cache_holds_kv():
    cache = create_cache("radix-hicache", num_pages=8, page_size=16)
    seq = Sequence("x", np.arange(40, dtype=np.int32))
    m = cache.match(seq)
    cache.admit(seq, m, 40)
    with pytest.raises(InvalidRequestError, match="before the first request"):
        cache.time_transfers()


def test_transfer_record_directions():
    t = TierTransfer("host", "gpu", 16, "r")
    assert t.to_gpu and not TierTransfer("gpu", "host", 16).to_gpu


@pytest.mark.parametrize("backend", ["radix-hicache", "apc"])
def test_cluster_replicas_time_their_transfers(backend):
    """Each replica of a cluster prices its own cache's transfers; at the end nothing stays
    in flight or held (no page pinned)."""
    from experiments.engine.cluster import serve_cluster
    from experiments.engine.routers.registry import make_router
    from experiments.workloads.registry import make_workload

    requests = make_workload(
        "multi_turn_chat", seed=5, num_conversations=6, turns=3, user_turn_len=60, answer_len=20,
        answer_dist="exponential", think_time=0.2, rate=30.0, vocab_size=5000,
    ).requests  # fmt: skip
    caches = [create_cache(backend, num_pages=30, page_size=16, host_capacity_tokens=960) for _ in range(2)]
    res = serve_cluster(caches, requests, [CostModelExecutor(), CostModelExecutor()], make_router("round_robin", 2))
    assert len(res.requests) == len(requests)
    for cache, r in zip(caches, res.replicas, strict=True):
        cache.check_invariants()
        assert cache.stats().pages_pinned == 0
        assert r.transfers is not None and r.transfers["gpu_to_host_tokens"] > 0


def test_drain_completes_what_is_decided_or_in_flight():
    cache = create_cache("radix-hicache", num_pages=8, page_size=16, host_capacity_tokens=256, **TIER)
    clock = TransferClock(cache, 32)
    seq = Sequence("x", np.arange(100, 165, dtype=np.int32))
    m = cache.match(seq)
    cache.admit(seq, m, 65)
    cache.commit(seq, 65)
    cache.release(seq)
    assert cache.evict(4) == 0
    clock.drain()
    assert cache.evict(4) == 4 and clock.next_completion() is None
    cache.check_invariants()


def test_compare_writes_tier_metrics_everywhere(tmp_path):
    """`compare` with a tiered and a one-tier backend: results.json's tiered cell has
    `serving.tiers`, results.csv its columns, and every per_request.jsonl row the tier keys
    (None in the one-tier cell's rows), after the documented ones."""
    import csv
    import json

    from experiments.cli.main import main
    from experiments.engine.request import TIER_RECORD_KEYS
    from experiments.report.results import PER_REQUEST_FILE
    from tests.test_cli_scheduler import FIXED, PER_REQUEST_FIELDS, TINY

    out = tmp_path / "out"
    argv = ["compare", *TINY, "--backend", "radix,radix-hicache", "--capacity-tokens", "256", *FIXED]
    assert main([*argv, "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    radix, tiered = results["cells"]
    assert "tiers" not in radix["serving"]
    tiers = tiered["serving"]["tiers"]
    assert tiers["timed_transfers"] is True and tiers["gpu_to_host_bytes"] > 0
    rows = [json.loads(line) for line in (out / PER_REQUEST_FILE).read_text().splitlines()]
    keys = PER_REQUEST_FIELDS[:-1] + list(TIER_RECORD_KEYS) + ["replica"]
    assert all(list(r) == keys for r in rows)
    assert all(r["host_hit_tokens"] is None for r in rows if r["backend"] == "radix")
    mine = [r for r in rows if r["backend"] == "radix-hicache"]
    assert sum(r["gpu_hit_tokens"] for r in mine) == tiers["gpu_hit_tokens"]
    assert sum(r["host_hit_tokens"] for r in mine) == tiers["host_hit_tokens"]
    with (out / "results.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert table[1]["serving.tiers.gpu_to_host_bytes"] == str(tiers["gpu_to_host_bytes"])
    assert table[0]["serving.tiers.gpu_to_host_bytes"] == ""
