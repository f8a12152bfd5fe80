"""apc-lmcache's transfers on the serving clock, as LMCache's vLLM v1 connector runs them
(backends/apc_lmcache.py T1-T4, experiments/engine/transfers.py `connector_step_seconds`):
a blocking load before the forward, a store after it, a disk hit read disk -> host then
host -> GPU, and with `lmcache_use_layerwise` the three pipelined layer by layer.

The cases: a fixed 10 ms step, 16-token pages and chunks, an 8-page GPU, KV of 1,000,000
bytes per token at 1 GB/s each way on the host link (16 tokens = 16 ms). A is a 64-token
document + 16 tokens (80 tokens: 5 chunks stored after its prefill, 80 ms); C (120
unrelated tokens, 7 chunks stored, 112 ms) pushes A off the GPU; B is the document + 10
tokens: its 64 document tokens are found on the host (or on disk) and loaded; its own 74
tokens end inside a chunk past the hit, so it stores nothing."""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import create_cache
from cachelib.errors import InvalidRequestError
from cachelib.tiers import TierTransfer, pipelined_step_seconds, pipelined_store_step_seconds
from experiments.engine import ServingConfig
from experiments.engine.executors import FixedStepExecutor
from experiments.engine.serving import serve
from experiments.engine.transfers import TransferClock
from experiments.report.metrics import tier_section
from experiments.workloads.spec import RequestSpec

STEP = 0.01
KV = 1_000_000
LAYERS = FixedStepExecutor.num_layers
DOC = np.arange(1000, 1064, dtype=np.int32)
BASE = dict(
    num_pages=8, page_size=16, lmcache_chunk_size=16, kv_bytes_per_token=KV, host_read_gbps=1.0, host_write_gbps=1.0
)
#: a disk at 0.5 GB/s read (64 tokens: 128 ms), 0.25 GB/s write, below a 128-token host
DISK = dict(host_capacity_tokens=128, disk_capacity_tokens=1024, disk_read_gbps=0.5, disk_write_gbps=0.25)


def _requests() -> list[RequestSpec]:
    def spec(rid: str, tokens: np.ndarray, arrival: float) -> RequestSpec:
        return RequestSpec(rid, tokens.astype(np.int32), 2, arrival)

    return [
        spec("a", np.concatenate([DOC, np.arange(2000, 2016)]), 0.0),
        spec("c", np.arange(5000, 5120), 1.0),
        spec("b", np.concatenate([DOC, np.arange(3000, 3010)]), 2.0),
    ]


def _serve(timed: bool, **opts):
    cache = create_cache("apc-lmcache", **(BASE | opts))
    res = serve(cache, _requests(), FixedStepExecutor(STEP), ServingConfig(token_budget=512, time_transfers=timed))
    cache.check_invariants()
    return {r["request_id"]: r for r in res.requests}, res


def test_blocking_load_and_store_add_their_transfer_time_to_the_step():
    recs, res = _serve(True, host_capacity_tokens=256)
    # A's step: its compute, then its 80-token store (80 MB at 1 GB/s) before the step ends
    assert recs["a"]["ttft"] == pytest.approx(STEP + 80 * KV / 1e9, rel=1e-9)
    assert recs["c"]["ttft"] == pytest.approx(STEP + 112 * KV / 1e9, rel=1e-9)
    b = recs["b"]
    assert b["host_hit_tokens"] == 64 and b["gpu_hit_tokens"] == 0 and b["storage_hit_tokens"] == 0
    # B's step: its 64-token load, then its compute; nothing stored
    assert b["ttft"] == pytest.approx(64 * KV / 1e9 + STEP, rel=1e-9)
    assert b["load_stall_s"] == pytest.approx(0.064, rel=1e-9)
    assert recs["a"]["load_stall_s"] == 0.0 and b["load_wait_s"] == 0.0
    t = res.transfers
    assert t["load_timing"] == "blocking"
    assert (t["host_to_gpu_tokens"], t["host_to_gpu_bytes"]) == (64, 64 * KV)
    assert (t["gpu_to_host_tokens"], t["gpu_to_host_bytes"]) == (192, 192 * KV)
    assert t["store_stall_s"] == pytest.approx(0.192, rel=1e-9)
    assert t["load_stall_s"] == pytest.approx(0.064, rel=1e-9)
    section = tier_section(res)
    assert section["store_stall_s"] == t["store_stall_s"] and section["host_to_gpu_bytes"] == 64 * KV


def test_instant_transfers_leave_every_step_its_compute():
    recs, res = _serve(False, host_capacity_tokens=256)
    assert res.transfers is None
    assert [recs[k]["ttft"] for k in "acb"] == pytest.approx([STEP] * 3, rel=1e-9)
    assert recs["b"]["host_hit_tokens"] == 64 and recs["b"]["load_stall_s"] == 0.0


def test_a_disk_hit_is_read_from_disk_then_copied_from_host():
    """The 128-token host keeps C's chunks only; B's document is read from disk (64 tokens at
    0.5 GB/s: 128 ms) into host buffers, then copied to the GPU (64 ms), then computed."""
    recs, res = _serve(True, **DISK)
    b = recs["b"]
    assert b["host_hit_tokens"] == 64  # loaded, from whichever tier below the GPU
    assert b["storage_hit_tokens"] == 64 and recs["a"]["storage_hit_tokens"] == 0
    assert b["ttft"] == pytest.approx(64 * KV / 0.5e9 + 64 * KV / 1e9 + STEP, rel=1e-9)
    assert b["load_stall_s"] == pytest.approx(0.128 + 0.064, rel=1e-9)
    # the disk's writes run after each store, at its write bandwidth, and hold no step up
    assert recs["a"]["ttft"] == pytest.approx(STEP + 0.080, rel=1e-9)
    t = res.transfers
    assert (t["storage_to_host_tokens"], t["storage_to_host_bytes"]) == (64, 64 * KV)
    assert (t["host_to_storage_tokens"], t["host_to_storage_bytes"]) == (192, 192 * KV)
    assert tier_section(res)["storage_to_host_bytes"] == 64 * KV
    assert tier_section(res)["storage_hit_tokens"] == 64
    instant, _ = _serve(False, **DISK)
    assert instant["b"]["ttft"] == pytest.approx(STEP, rel=1e-9) and instant["b"]["host_hit_tokens"] == 64
    assert instant["b"]["storage_hit_tokens"] == 64


def test_layerwise_pipelines_loads_compute_and_stores():
    recs, res = _serve(True, host_capacity_tokens=256, lmcache_use_layerwise=True)
    assert res.transfers["load_timing"] == "layerwise"
    # no store in B's step: SGLang's two-stage pipeline exactly
    assert recs["b"]["ttft"] == pytest.approx(pipelined_step_seconds(STEP, 0.064, LAYERS), rel=1e-9)
    assert recs["b"]["load_stall_s"] == pytest.approx(pipelined_step_seconds(STEP, 0.064, LAYERS) - STEP, rel=1e-9)
    # A stores 80 tokens layer by layer behind its compute
    assert recs["a"]["ttft"] == pytest.approx(pipelined_store_step_seconds(STEP, 0.0, 0.080, LAYERS), rel=1e-9)
    disk, _ = _serve(True, lmcache_use_layerwise=True, **DISK)
    # the disk read comes before the first layer's copy
    assert disk["b"]["ttft"] == pytest.approx(0.128 + pipelined_step_seconds(STEP, 0.064, LAYERS), rel=1e-9)


def _three_stage_recurrence(load: float, compute: float, store: float, layers: int) -> float:
    """Layer i loads after layer i-1's load, computes after its load and layer i-1's
    compute, stores after its compute and layer i-1's store."""
    loaded = computed = stored = 0.0
    for _ in range(layers):
        loaded += load / layers
        computed = max(computed, loaded) + compute / layers
        stored = max(stored, computed) + store / layers
    return stored


@pytest.mark.parametrize(
    "load,compute,store,layers",
    [(0.064, 0.01, 0.016, 32), (0.0, 0.01, 0.08, 32), (0.01, 0.05, 0.02, 4), (0.02, 0.02, 0.02, 8), (0.1, 0.0, 0.3, 1)],
)
def test_pipelined_store_step_is_the_three_stage_recurrence(load, compute, store, layers):
    assert pipelined_store_step_seconds(compute, load, store, layers) == pytest.approx(
        _three_stage_recurrence(load, compute, store, layers), rel=1e-12
    )
    assert pipelined_store_step_seconds(compute, load, 0.0, layers) == pipelined_step_seconds(compute, load, layers)


def test_connector_step_prices_reported_transfers_exactly():
    """At the clock: N tokens at B bytes/s take N * bytes / B, in the order T1 gives."""
    cache = create_cache("apc-lmcache", **(BASE | DISK))
    clock = TransferClock(cache, LAYERS)
    decided = [
        TierTransfer("storage", "host", 32),
        TierTransfer("host", "gpu", 48, "r"),
        TierTransfer("gpu", "host", 16),
        TierTransfer("host", "storage", 16),
    ]
    seconds, load_stall, store_stall = clock.connector_step_seconds(0.01, decided, 3.0)
    assert load_stall == pytest.approx(32 * KV / 0.5e9 + 48 * KV / 1e9, rel=1e-12)
    assert store_stall == pytest.approx(16 * KV / 1e9, rel=1e-12)
    assert seconds == pytest.approx(load_stall + 0.01 + store_stall, rel=1e-12)
    # the disk write starts when the store ends and takes its own time after the step
    assert clock.link_free[("host", "storage")] == pytest.approx(3.0 + seconds + 16 * KV / 0.25e9, rel=1e-12)
    assert clock.summary()["store_stall_s"] == store_stall


def test_lmcache_use_layerwise_must_be_a_bool_and_timing_starts_on_an_empty_cache():
    with pytest.raises(InvalidRequestError, match="lmcache_use_layerwise must be a bool"):
        create_cache("apc-lmcache", **(BASE | {"host_capacity_tokens": 256, "lmcache_use_layerwise": 1}))
    cache = create_cache("apc-lmcache", **(BASE | {"host_capacity_tokens": 256}))
    assert cache.take_transfers() == []  # not timed: nothing recorded
    from cachelib.types import Sequence
    from experiments.engine.cache_client import CacheClient

    client = CacheClient(cache)
    seq = Sequence("x", np.arange(100, 132, dtype=np.int32))
    client.admit(seq, client.match(seq), 32)
    with pytest.raises(InvalidRequestError, match="before the first request"):
        cache.time_transfers()


@pytest.mark.parametrize(
    "opts", [{"host_capacity_tokens": 256}, DISK | {"host_capacity_tokens": 64}, DISK | {"lmcache_use_layerwise": True}]
)
def test_timed_serving_moves_what_the_tiers_count(opts):
    """A busy mix (shared prefixes, chunked prefill, preemption on a small GPU): the cache
    stays sound, and the clock priced exactly the tokens LMCache's counters say moved."""
    rng = np.random.default_rng(7)
    prefixes = [rng.integers(0, 5000, 48).astype(np.int32) for _ in range(6)]
    requests = []
    for i in range(40):
        own = rng.integers(0, 5000, int(rng.integers(1, 40)))
        prompt = np.concatenate([prefixes[int(rng.integers(0, 6))], own]).astype(np.int32)
        requests.append(RequestSpec(f"r{i}", prompt, int(rng.integers(1, 6)), i * 0.02))
    cache = create_cache("apc-lmcache", **(BASE | opts))
    res = serve(cache, requests, FixedStepExecutor(STEP), ServingConfig(token_budget=64, max_running=4))
    cache.check_invariants()
    assert all(not r["aborted"] for r in res.requests)
    traffic, moved = cache.tier_traffic(), res.transfers
    for name in ("host_to_gpu", "gpu_to_host", "storage_to_host", "host_to_storage"):
        assert moved.get(f"{name}_tokens", 0) == traffic.get(f"{name}_tokens", 0)
    assert moved["host_to_gpu_tokens"] > 0 and moved["store_stall_s"] > 0
    if "disk_capacity_tokens" in opts:
        assert moved["storage_to_host_tokens"] > 0 and moved["host_to_storage_tokens"] > 0
    loaded = sum(r["host_hit_tokens"] for r in res.requests)
    assert loaded == traffic["host_loaded_tokens"] + traffic["storage_loaded_tokens"]
    assert sum(r["storage_hit_tokens"] for r in res.requests) == traffic["storage_loaded_tokens"]
