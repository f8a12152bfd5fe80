"""radix vs an independent model of SGLang 0.5.23's RadixCache, decision by decision, on the
Mooncake conversation trace (docs/design.md §6 replay protocol).

Compared exactly: every request's hit tokens, and the sequence of evicted nodes (start token
and token content), for every eviction policy, page sizes 1 and 16, concurrency 1 and 4.
Also: at unlimited capacity the hits equal an independent infinite-cache count, and `apc`
and `radix` agree at page size 16. `tests/test_radix_sglang.py` compares against what the
real SGLang 0.5.23 code decided (recorded fixtures).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xxhash

from cachelib import create_cache
from experiments.engine import replay, unlimited_pages
from experiments.workloads.mooncake import load_mooncake
from tests.reference.sglang_radix_model import SGLangRadixModel, replay_model

TRACE = Path(__file__).resolve().parents[1] / "experiments" / "data" / "mooncake_conversation_2000.jsonl"
CAPACITY = 200_000
POLICIES = ["lru", "lfu", "fifo", "mru", "filo"]


def _digest(start: int, key) -> tuple[int, int, int]:
    arr = np.asarray(key, dtype=np.int32)
    return (start, arr.size, xxhash.xxh3_64_intdigest(arr.tobytes()))


def _num_pages(requests, page_size: int, capacity: int | None) -> int:
    return unlimited_pages(requests, page_size) if capacity is None else capacity // page_size


def run_backend(requests, page_size: int, capacity: int | None, policy: str = "lru", concurrency: int = 1):
    cache = create_cache(
        "radix", num_pages=_num_pages(requests, page_size, capacity), page_size=page_size, eviction_policy=policy
    )
    evicted: list[tuple[int, int, int]] = []
    cache.on_evict = lambda ns, start, key: evicted.append(_digest(start, key))
    result = replay(cache, requests, concurrency=concurrency)
    cache.check_invariants()
    assert cache.stats().pages_pinned == 0
    return result, evicted


def run_model(requests, page_size: int, capacity: int | None, policy: str = "lru", concurrency: int = 1):
    model = SGLangRadixModel(page_size, _num_pages(requests, page_size, capacity), policy)
    pairs = [(spec.prompt.tolist(), spec.output_len) for spec in requests]
    hits, _ = replay_model(model, pairs, concurrency)
    return hits, [_digest(start, key) for start, key in model.evicted]


def infinite_cache_hits(requests, page_size: int) -> list[int]:
    """Independent count: the longest prefix any earlier request left in an unlimited cache.

    Works on Mooncake's 512-token blocks: two prompts agree token for token exactly as far as
    their hash ids agree, then over the shorter of the first differing-length equal blocks.
    A request leaves its prompt up to the last whole page of prompt + output - 1 tokens
    (generated tokens never match a prompt). Hits are capped at len - 1 and rounded to pages.
    """
    seen: dict[int, int] = {}  # chained hash of block ids 0..k -> most tokens of block k held
    hits = []
    for spec in requests:
        ids, n = spec.prompt_source.hash_ids, len(spec.prompt_source)
        lengths = [min(512, n - 512 * k) for k in range(len(ids))]
        match, chain = 0, 0
        for k, h in enumerate(ids):
            chain = hash((chain, h))
            held = seen.get(chain, 0)
            match += min(held, lengths[k])
            if held < lengths[k] or lengths[k] < 512:
                break
        hits.append(min(match, n - 1) // page_size * page_size)
        kept = min(n, (n + max(spec.output_len - 1, 0)) // page_size * page_size)
        chain = 0
        for k, h in enumerate(ids):
            if 512 * k >= kept:
                break
            chain = hash((chain, h))
            seen[chain] = max(seen.get(chain, 0), min(lengths[k], kept - 512 * k))
    return hits


@pytest.fixture(scope="module")
def trace_300():
    return load_mooncake(TRACE, limit=300)


@pytest.fixture(scope="module")
def trace_2000():
    return load_mooncake(TRACE)


def _check_fidelity(requests, page_size, capacity, policy="lru", concurrency=1):
    result, evicted = run_backend(requests, page_size, capacity, policy, concurrency)
    hits, model_evicted = run_model(requests, page_size, capacity, policy, concurrency)
    assert result["per_request_hits"] == hits
    assert len(evicted) == len(model_evicted)
    assert evicted == model_evicted
    if capacity is None:
        assert not evicted
        assert result["per_request_hits"] == infinite_cache_hits(requests, page_size)
    else:
        assert evicted, "the bounded run should evict"
    return result


@pytest.mark.parametrize("page_size", [1, 16])
def test_fidelity_unlimited_first_300(trace_300, page_size):
    _check_fidelity(trace_300, page_size, None)


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_fidelity_first_300(trace_300, policy, page_size, concurrency):
    _check_fidelity(trace_300, page_size, CAPACITY, policy, concurrency)


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", POLICIES)
def test_fidelity_first_2000(trace_2000, policy, page_size, concurrency):
    _check_fidelity(trace_2000, page_size, CAPACITY, policy, concurrency)


@pytest.mark.parametrize("n", [300, pytest.param(2000, marks=pytest.mark.slow)])
def test_apc_and_radix_agree_at_page_size_16_unlimited(trace_300, trace_2000, n):
    requests = trace_300 if n == 300 else trace_2000
    pages = unlimited_pages(requests, 16)
    apc = replay(create_cache("apc", num_pages=pages, page_size=16), requests)
    rdx = replay(create_cache("radix", num_pages=pages, page_size=16), requests)
    assert apc["per_request_hits"] == rdx["per_request_hits"]
    assert apc["hit_tokens"] == rdx["hit_tokens"] > 0
