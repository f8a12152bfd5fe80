"""radix-hicache's storage tier against the real SGLang 0.5.23 HiCache storage layer,
request for request.

`tests/fixtures/sglang_0_5_23/*.hicache-storage-golden.json.gz` hold what SGLang's own
`UnifiedRadixCache` decided with a host tier and the file storage backend under it (a real
`HiCacheFile` with its `LRUFileEvictor` and `max_size`, in a temporary directory; the
controller's storage threads run inline; the prefetch issued at each request's arrival by
the scheduler's `_prefetch_kvcache`, its result popped at admission), run on CPU under the
replay protocol by `scripts/sglang_reference/run_sglang.py --hicache --storage` (its
`HiCacheStorageReplay` docstring lists what is stubbed). Each golden covers the three
write policies; the backend must reproduce every request's GPU hit, the host tokens it
loaded back, how many of those came up from storage (SGLang's `cached_tokens_storage`),
the device tokens evicted after every request, the host traffic, and the pages offered
to storage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cachelib import create_cache
from experiments.engine import replay
from tests.test_radix_hicache_sglang import _EvictionLog, _first_difference, _load_golden, _requests

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "sglang_0_5_23"
GOLDENS = sorted(FIXTURES.glob("*.hicache-storage-golden.json.gz"))
WRITE_POLICIES = {"write_through", "write_through_selective", "write_back"}


def _name(path: Path) -> str:
    return path.name.split(".hicache-storage-golden")[0]


def test_the_goldens_are_there():
    assert {_name(p) for p in GOLDENS} >= {
        "shared_doc_qa_s7.cap1024.host1024.file4096",
        "multi_turn_chat_s11.cap2048.host2048.file8192",
    }
    for path in GOLDENS:
        doc = _load_golden(path)
        assert doc["sglang_version"] == "0.5.23"
        assert {c["write_policy"] for c in doc["configs"]} == WRITE_POLICIES
        assert all(c["cache"] == "unified:python+hicache+file" for c in doc["configs"])
        # the goldens exercise storage: some request of every config loads from it
        assert all(c["total_storage_loaded_tokens"] > 0 for c in doc["configs"] if c["write_policy"] != "write_back")


def _slow_if_large(path: Path):
    return pytest.param(path, id=_name(path), marks=[pytest.mark.slow] if "mooncake" in path.name else [])


@pytest.mark.parametrize("golden", [_slow_if_large(p) for p in GOLDENS])
def test_radix_hicache_storage_decides_as_sglang_0_5_23(golden, tmp_path_factory):
    doc = _load_golden(golden)
    requests = _requests(doc["trace"], tmp_path_factory.mktemp("traces"))
    differences = []
    for cfg in doc["configs"]:
        ps, cap = cfg["page_size"], cfg["capacity_tokens"]
        cache = create_cache(
            "radix-hicache",
            num_pages=cap // ps,
            page_size=ps,
            eviction_policy=cfg["policy"],
            write_policy=cfg["write_policy"],
            host_capacity_tokens=cfg["host_capacity_tokens"],
            storage_backend="file",
            storage_capacity_tokens=cfg["storage_capacity_tokens"],
            prefetch_threshold=cfg["prefetch_threshold"],
            prefetch_policy=cfg["prefetch_policy"],
        )
        log = _EvictionLog(cache)
        result = replay(cache, requests, concurrency=cfg["concurrency"])
        evicted_after = [*log.after_request, log.evicted()]
        cache.check_invariants()
        where = f"{cfg['write_policy']}, {cfg['policy']}, page {ps}, concurrency {cfg['concurrency']}"
        by_tier = result["per_request_hits_by_tier"]
        columns = {
            "GPU hit": ([h[0] for h in by_tier], cfg["per_request_hits"]),
            # SGLang's host_loaded counts every token loaded back, storage's included
            "loaded": ([h[1] + h[2] if h[0] >= 0 else -1 for h in by_tier], cfg["per_request_host_loaded"]),
            "from storage": ([h[2] for h in by_tier], cfg["per_request_storage_loaded"]),
            "evicted after": (evicted_after, cfg["evicted_tokens_after_request"]),
        }
        for what, (ours, theirs) in columns.items():
            if ours != theirs:
                i = _first_difference(ours, theirs)
                differences.append(f"{where}: request {i} {what} {ours[i]}, SGLang {theirs[i]}")
                break
        else:
            traffic = result["tier_traffic"]
            ours = (traffic["backed_up"], traffic["loaded"], traffic["host_tokens"])
            theirs = (cfg["backup_tokens"], cfg["load_back_tokens"], cfg["host_tokens_end"])
            if ours != theirs:
                differences.append(f"{where}: backed up / loaded / host at end {ours}, SGLang {theirs}")
            offered = (traffic["storage_written_tokens"] + traffic["storage_skipped_tokens"]) // ps
            if offered != cfg["storage_written_pages"]:
                differences.append(
                    f"{where}: pages offered to storage {offered}, SGLang {cfg['storage_written_pages']}"
                )
            assert result["hit_tokens_by_tier"]["storage"] == cfg["total_storage_loaded_tokens"], where
            assert result["unschedulable"] == cfg["unschedulable"], where
    assert not differences, "\n".join(differences)
