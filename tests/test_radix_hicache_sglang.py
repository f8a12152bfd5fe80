"""radix-hicache against the real SGLang 0.5.23 hierarchical cache, request for request.

`tests/fixtures/sglang_0_5_23/*.hicache-golden.json.gz` hold what SGLang's own
`UnifiedRadixCache` with a host tier decided (`init_hicache`'s state: FULL component,
Python TreeCore, the real allocators and scheduler helpers; the host pool and the
controller's transfers stubbed to complete at once), run on CPU under the replay protocol
by `scripts/sglang_reference/run_sglang.py --hicache` (its docstring lists every patch).
Each golden covers the three write policies at page sizes 1 and 16: the first 1000
conversation requests at GPU 200k + host 2M tokens, two synthetic traces at a steady
eviction (one of them under the other four eviction policies too: lfu, fifo, mru, filo),
and a stress host as small as the GPU at concurrency 1 and 4. The backend must
reproduce every request's GPU hit, the host tokens it loaded back, the device tokens
evicted after every request, and what moved to the host.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from cachelib import create_cache
from experiments.engine import replay
from experiments.workloads.jsonl import load_jsonl
from experiments.workloads.mooncake import load_mooncake

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "sglang_0_5_23"
GOLDENS = sorted(FIXTURES.glob("*.hicache-golden.json.gz"))
WRITE_POLICIES = {"write_through", "write_through_selective", "write_back"}


def _load_golden(path: Path) -> dict:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


_TRACES: dict[tuple[str, int], list] = {}


def _requests(trace: dict, tmp_dir: Path) -> list:
    """The golden's trace (its first `requests`), loaded as the project loads it."""
    key = (trace["path"], trace["requests"])
    if key not in _TRACES:
        path = ROOT / trace["path"]
        if trace["kind"] == "mooncake":
            reqs = load_mooncake(path, trace["requests"])
        else:
            plain = tmp_dir / (trace["name"] + ".jsonl")
            with gzip.open(path, "rb") as src:
                plain.write_bytes(src.read())
            reqs = list(load_jsonl(plain).requests)
        assert len(reqs) == trace["requests"]
        _TRACES[key] = reqs
    return _TRACES[key]


def test_the_goldens_are_there():
    """Every trace x capacity, and in each every write policy at page sizes 1 and 16."""
    names = {p.name.split(".hicache-golden")[0] for p in GOLDENS}
    assert {
        "mooncake_conversation_1000.cap200000.host2000000.ps1",
        "mooncake_conversation_1000.cap200000.host2000000.ps16",
        "shared_doc_qa_s7.cap1024.host4096",
        "shared_doc_qa_s7.cap1024.host1024",
        "multi_turn_chat_s11.cap2048.host8192",
        "multi_turn_chat_s11.cap2048.host8192.policies",
    } <= names
    sizes = set()
    for path in GOLDENS:
        doc = _load_golden(path)
        assert doc["sglang_version"] == "0.5.23"
        assert {c["write_policy"] for c in doc["configs"]} == WRITE_POLICIES
        sizes |= {c["page_size"] for c in doc["configs"]}
    assert sizes == {1, 16}


def test_the_reference_figures_of_the_issue():
    """At page 16 on the first 1000 conversation requests (GPU 200k + host 2M), SGLang
    reuses 511,488 GPU tokens under every policy and loads back 562,496 (write_through),
    629,568 (write_back) and 0 (write_through_selective) host tokens."""
    doc = _load_golden(FIXTURES / "mooncake_conversation_1000.cap200000.host2000000.ps16.hicache-golden.json.gz")
    got = {c["write_policy"]: (c["total_hit_tokens"], c["total_host_loaded_tokens"]) for c in doc["configs"]}
    assert got == {
        "write_through": (511_488, 562_496),
        "write_through_selective": (511_488, 0),
        "write_back": (511_488, 629_568),
    }


class _EvictionLog:
    """Device tokens evicted so far, snapshot when the replay first matches each request
    (the golden's `evicted_tokens_after_request`: once the previous one is placed)."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.after_request: list[int] = []
        self._seen: set[str] = set()
        self._match = cache.match
        cache.match = self.match  # a test seam on this one instance

    def evicted(self) -> int:
        return self.cache.stats().evicted_pages * self.cache.page_size

    def match(self, seq):
        if seq.request_id not in self._seen:
            if self._seen:
                self.after_request.append(self.evicted())
            self._seen.add(seq.request_id)
        return self._match(seq)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("golden", GOLDENS, ids=[p.name.split(".hicache-golden")[0] for p in GOLDENS])
def test_radix_hicache_decides_as_sglang_0_5_23(golden, tmp_path_factory):
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
        )
        log = _EvictionLog(cache)
        result = replay(cache, requests, concurrency=cfg["concurrency"])
        evicted_after = [*log.after_request, log.evicted()]
        cache.check_invariants()
        where = f"{cfg['write_policy']}, {cfg['policy']}, page {ps}, concurrency {cfg['concurrency']}"
        by_tier = result["per_request_hits_by_tier"]
        gpu = [h[0] for h in by_tier]
        host = [h[1] for h in by_tier]
        if gpu != cfg["per_request_hits"]:
            i = _first_difference(gpu, cfg["per_request_hits"])
            differences.append(f"{where}: request {i} GPU hit {gpu[i]}, SGLang {cfg['per_request_hits'][i]}")
            continue
        if host != cfg["per_request_host_loaded"]:
            i = _first_difference(host, cfg["per_request_host_loaded"])
            differences.append(f"{where}: request {i} loaded {host[i]}, SGLang {cfg['per_request_host_loaded'][i]}")
            continue
        if evicted_after != cfg["evicted_tokens_after_request"]:
            i = _first_difference(evicted_after, cfg["evicted_tokens_after_request"])
            differences.append(
                f"{where}: after request {i} evicted {evicted_after[i]}, SGLang {cfg['evicted_tokens_after_request'][i]}"
            )
        traffic = result["tier_traffic"]
        if (traffic["backed_up"], traffic["loaded"]) != (cfg["backup_tokens"], cfg["load_back_tokens"]):
            differences.append(
                f"{where}: backed up / loaded {traffic['backed_up']} / {traffic['loaded']}, "
                f"SGLang {cfg['backup_tokens']} / {cfg['load_back_tokens']}"
            )
        if traffic["host_tokens"] != cfg["host_tokens_end"]:
            differences.append(
                f"{where}: host holds {traffic['host_tokens']} at the end, SGLang {cfg['host_tokens_end']}"
            )
        # hit_tokens counts every prompt token not recomputed, whichever tier it came from
        assert result["per_request_hits"] == [g + h if g >= 0 else -1 for g, h in zip(gpu, host, strict=True)]
        assert result["hit_tokens_by_tier"]["host"] == cfg["total_host_loaded_tokens"], where
        assert result["unschedulable"] == cfg["unschedulable"], where
        assert result["truncated"] == cfg["truncated"], where
    assert not differences, "\n".join(differences)
