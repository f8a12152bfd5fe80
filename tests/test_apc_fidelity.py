"""apc against vLLM V1's decisions and against the infinite-cache bound, on the Mooncake trace."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from backends.apc import APCCache
from cachelib import create_cache
from cachelib.hashing import DictIndex, RunIndex
from experiments.engine import replay, unlimited_pages
from experiments.workloads.mooncake import load_mooncake
from tests.reference.vllm_kv_manager import VllmModel

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "experiments/data/mooncake_conversation_2000.jsonl"
SHARED_TRACE = ROOT.parent / "shared/traces/mooncake/conversation_trace.jsonl"


class Recorder:
    """Wraps a cache; records every request's page table after admission and growth."""

    def __init__(self, cache):
        self.cache = cache
        self.tables: list[tuple[str, tuple[int, ...]]] = []

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def admit(self, seq, match, n):
        ops = self.cache.admit(seq, match, n)
        if ops is not None:
            self.tables.append((seq.request_id, tuple(seq.page_table)))
        return ops

    def grow(self, seq, n):
        ops = self.cache.grow(seq, n)
        if ops is not None:
            self.tables.append((seq.request_id, tuple(seq.page_table)))
        return ops


def infinite_cache_hits(requests, page_size: int) -> list[int]:
    """Per request: leading full prompt blocks seen in any earlier prompt, capped at len - 1."""
    seen: set[bytes] = set()
    hits = []
    for spec in requests:
        toks = spec.prompt
        n_full = len(toks) // page_size
        cap = (len(toks) - 1) // page_size
        keys, h = [], b""
        for i in range(n_full):
            h = hashlib.blake2b(h + toks[i * page_size : (i + 1) * page_size].tobytes(), digest_size=16).digest()
            keys.append(h)
        k = 0
        while k < cap and keys[k] in seen:
            k += 1
        hits.append(k * page_size)
        seen.update(keys)
    return hits


@pytest.fixture(scope="module")
def trace():
    return load_mooncake(TRACE, 2000)


def test_shipped_slice_is_the_head_of_the_shared_trace():
    if not SHARED_TRACE.exists():
        pytest.skip("../shared not present")
    with SHARED_TRACE.open() as fh:
        head = [next(fh) for _ in range(2000)]
    assert TRACE.read_text().splitlines(keepends=True) == head


def test_unlimited_capacity_hits_equal_the_infinite_cache_count(trace):
    cache = create_cache("apc", num_pages=unlimited_pages(trace, 16), page_size=16)
    result = replay(cache, trace)
    expected = infinite_cache_hits(trace, 16)
    assert result["per_request_hits"] == expected
    assert result["hit_tokens"] == sum(expected)
    assert result["evicted_pages"] == 0
    cache.check_invariants()


@pytest.mark.parametrize("table", [RunIndex, DictIndex])
@pytest.mark.parametrize("capacity_tokens, concurrency", [(200_000, 1), (200_000, 4), (40_000, 2)])
def test_same_decisions_as_vllm_model_under_pressure(trace, capacity_tokens, concurrency, table, monkeypatch):
    monkeypatch.setattr(APCCache, "index_type", table)
    n = 2000 if concurrency == 1 else 400
    requests = trace[:n]
    fast = Recorder(create_cache("apc", num_pages=capacity_tokens // 16, page_size=16))
    model = Recorder(VllmModel(num_pages=capacity_tokens // 16, page_size=16))
    a = replay(fast, requests, concurrency=concurrency)
    b = replay(model, requests, concurrency=concurrency)
    assert a["per_request_hits"] == b["per_request_hits"]
    assert a["unschedulable"] == b["unschedulable"] and a["truncated"] == b["truncated"]
    assert fast.tables == model.tables  # the same blocks, handed out in the same order
    assert a["evicted_pages"] == len(model.cache.evicted) > 0
    assert fast.cache.cached_blocks_in_lru_order() == model.cache.cached_blocks_in_lru_order()
    fast.cache.check_invariants()
