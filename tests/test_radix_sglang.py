"""radix against the real SGLang 0.5.23, request for request.

`tests/fixtures/sglang_0_5_23/` holds what SGLang's own `RadixCache`, allocators and
scheduler helpers decided, run unmodified on CPU under the replay protocol
(`scripts/sglang_reference/run_sglang.py`; the fixture README says how to regenerate):
for every eviction policy, page sizes 1 and 16, concurrency 1 and 4, on the shipped
conversation trace and on two synthetic traces stored as token ids (shared-document QA and
multi-turn chat, at a steady-eviction capacity and at a stress capacity where prompts do
not fit and decodes are cut short). The backend must reproduce every request's hit, the
evicted tokens after every request, and which requests were unschedulable.
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
GOLDENS = sorted(FIXTURES.glob("*.golden.json.gz"))


def _load_golden(path: Path) -> dict:
    with gzip.open(path, "rt") as fh:
        return json.load(fh)


_TRACES: dict[str, list] = {}


def _requests(trace: dict, tmp_dir: Path) -> list:
    """The golden's trace, loaded as the project loads it (cached per test session)."""
    name = trace["name"]
    if name not in _TRACES:
        path = ROOT / trace["path"]
        if trace["kind"] == "mooncake":
            _TRACES[name] = load_mooncake(path)
        else:
            plain = tmp_dir / (name + ".jsonl")
            with gzip.open(path, "rb") as src:
                plain.write_bytes(src.read())
            _TRACES[name] = list(load_jsonl(plain).requests)
        assert len(_TRACES[name]) == trace["requests"]
    return _TRACES[name]


def test_the_goldens_are_there():
    """Five traces x capacities, 20 configs each: nothing silently missing."""
    names = {p.name.split(".golden")[0] for p in GOLDENS}
    assert {
        "mooncake_conversation_2000.cap200000",
        "shared_doc_qa_s7.cap8192",
        "shared_doc_qa_s7.cap1024",
        "multi_turn_chat_s11.cap16384",
        "multi_turn_chat_s11.cap512",
    } <= names
    for path in GOLDENS:
        doc = _load_golden(path)
        assert doc["sglang_version"] == "0.5.23"
        keys = {(c["policy"], c["page_size"], c["concurrency"]) for c in doc["configs"]}
        assert keys == {(p, s, c) for p in ("lru", "lfu", "fifo", "mru", "filo") for s in (1, 16) for c in (1, 4)}


@pytest.mark.parametrize("golden", GOLDENS, ids=[p.name.split(".golden")[0] for p in GOLDENS])
def test_radix_decides_as_sglang_0_5_23(golden, tmp_path_factory):
    doc = _load_golden(golden)
    requests = _requests(doc["trace"], tmp_path_factory.mktemp("traces"))
    differences = []
    for cfg in doc["configs"]:
        ps, cap = cfg["page_size"], cfg["capacity_tokens"]
        cache = create_cache("radix", num_pages=cap // ps, page_size=ps, eviction_policy=cfg["policy"])
        evicted_after: list[int] = []
        result = _replay_recording_evictions(cache, requests, cfg["concurrency"], evicted_after)
        cache.check_invariants()
        where = f"{cfg['policy']}, page {ps}, concurrency {cfg['concurrency']}"
        hits = result["per_request_hits"]
        if hits != cfg["per_request_hits"]:
            i = _first_difference(hits, cfg["per_request_hits"])
            differences.append(f"{where}: request {i} hits {hits[i]}, SGLang {cfg['per_request_hits'][i]}")
            continue
        if result["evicted_pages"] * ps != cfg["evicted_tokens"]:
            differences.append(
                f"{where}: evicted {result['evicted_pages'] * ps} tokens, SGLang {cfg['evicted_tokens']}"
            )
        if evicted_after != cfg["evicted_tokens_after_request"]:
            i = _first_difference(evicted_after, cfg["evicted_tokens_after_request"])
            differences.append(
                f"{where}: after request {i} evicted {evicted_after[i]}, SGLang {cfg['evicted_tokens_after_request'][i]}"
            )
        assert result["unschedulable"] == cfg["unschedulable"], where
        assert result["truncated"] == cfg["truncated"], where
    assert not differences, "\n".join(differences)


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where `a` and `b` differ (the shorter length if one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class _EvictionLog:
    """Evicted tokens so far (the tree's eviction observer), and a snapshot of them each time
    the replay looks up a request for the first time, i.e. once the previous one is placed.

    The golden's `evicted_tokens_after_request[i]` is taken before request i + 1 is matched:
    it includes the finishes request i forced, and finishing for the concurrency limit before
    the next match evicts nothing (a release never evicts). The last entry is taken at the
    end of the replay (the final finishes do not evict either).
    """

    def __init__(self, cache) -> None:
        self.tokens = 0
        self.after_request: list[int] = []
        self._seen: set[str] = set()
        self._match = cache.match
        cache.on_evict = self.record
        cache.match = self.match  # a test seam on this one instance

    def record(self, namespace, start, key) -> None:
        self.tokens += len(key)

    def match(self, seq):
        if seq.request_id not in self._seen:
            if self._seen:
                self.after_request.append(self.tokens)
            self._seen.add(seq.request_id)
        return self._match(seq)


def _replay_recording_evictions(cache, requests, concurrency: int, evicted_after: list[int]) -> dict:
    """`replay`, plus the evicted tokens once each request is admitted and decoded."""
    log = _EvictionLog(cache)
    result = replay(cache, requests, concurrency=concurrency)
    evicted_after.extend(log.after_request)
    evicted_after.append(log.tokens)
    return result
