"""apc's host tier against the real vLLM 0.33 OffloadingConnector, per request.

The goldens in tests/fixtures/vllm_0_33/offload/ come from
scripts/vllm_reference/run_vllm_offload.py: vLLM 0.33.0's own scheduler, KV cache manager,
`OffloadingConnectorScheduler` and `CPUOffloadingManager` (LRU or ARC) under the replay
protocol with instantaneous transfers (regenerate with regenerate_offload.sh). Per request
they hold the GPU hit, the tokens loaded from the host and the tokens not recomputed; per
run, the host chunks stored and evicted. apc with the same host tier must give the same
numbers for every request.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from cachelib import create_cache
from experiments.engine import replay
from experiments.workloads.mooncake import load_mooncake
from experiments.workloads.spec import RequestSpec

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm_0_33" / "offload"
GOLDENS = sorted(p.name.removesuffix(".offload.golden.json.gz") for p in FIXTURES.glob("*.offload.golden.json.gz"))
#: the Mooncake goldens replay 1000 long prompts (about a minute with LRU): slow
SLOW = {name for name in GOLDENS if name.startswith("mooncake")}


def load(name: str) -> tuple[dict, list[RequestSpec]]:
    golden = json.loads(gzip.decompress((FIXTURES / f"{name}.offload.golden.json.gz").read_bytes()))
    trace = golden["trace"]
    path = ROOT / trace["path"]
    if path.name.startswith("mooncake"):
        specs = load_mooncake(str(path), trace["limit"])
    else:
        with gzip.open(path, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        specs = [RequestSpec(str(o["id"]), np.asarray(o["prompt"], dtype=np.int32), int(o["output_len"])) for o in rows]
    if trace.get("limit"):
        specs = specs[: trace["limit"]]
    assert len(specs) == trace["requests"] == len(golden["requests"])
    return golden, specs


def test_the_goldens_are_there():
    assert len(GOLDENS) >= 10 and any(n.endswith(".lru") for n in SLOW) and any(n.endswith(".arc") for n in SLOW)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in GOLDENS], ids=GOLDENS
)
def test_per_request_hits_by_tier_equal_vllm(name):
    golden, specs = load(name)
    cfg = golden["config"]
    assert cfg["block_size"] == 16 and cfg["usable_blocks"] * 16 == cfg["capacity_tokens"]
    cache = create_cache(
        "apc",
        num_pages=cfg["capacity_tokens"] // 16,
        page_size=16,
        host_capacity_tokens=cfg["host_tokens"],
        host_eviction=cfg["eviction_policy"],
        host_block_size=cfg["host_block_size"],
        offload_prompt_only=cfg["offload_prompt_only"],
    )
    result = replay(cache, specs)
    cache.check_invariants()
    # per request: the GPU hit and every token not recomputed (the host's share is the
    # difference: `per_request_hits_by_tier` = [gpu, hit - gpu, 0])
    want = [(row[0], row[2]) for row in golden["requests"]]
    got = [(t[0], h) for t, h in zip(result["per_request_hits_by_tier"], result["per_request_hits"], strict=True)]
    assert all(
        t[0] + t[1] == h for t, h in zip(result["per_request_hits_by_tier"], result["per_request_hits"], strict=True)
    )
    diff = [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b]
    assert not diff, (
        f"{len(diff)} requests differ, first {diff[0]}: vLLM (gpu, hit) {want[diff[0]]}, apc {got[diff[0]]}"
    )
    host, totals = result["tier_traffic"], golden["totals"]
    assert result["hit_tokens"] == totals["hit_tokens"]
    assert result["hit_tokens_by_tier"]["gpu"] == totals["gpu_hit_tokens"]
    # tokens copied back: vLLM's num_external_tokens, which includes the last token of a
    # prompt loaded whole (then recomputed): so per request loaded >= hit - gpu
    assert host["loaded"] == totals["host_loaded_tokens"]
    assert host["stored_chunks"] == totals["stored_chunks"]
    assert host["evicted_chunks"] == totals["evicted_chunks"]
    assert host["host_tokens"] == totals["host_chunks_end"] * cfg["host_block_size"]
    # vLLM retries a refused store every step, apc at its next commit and at release: the
    # number of refusals differs, whether there were any does not
    assert (host["failed_stores"] > 0) == (totals["failed_stores"] > 0)


def test_the_goldens_load_from_the_host_and_evict_on_it():
    """The goldens exercise what they are for: loads, host evictions, refused stores."""
    totals = [
        json.loads(gzip.decompress((FIXTURES / f"{n}.offload.golden.json.gz").read_bytes()))["totals"] for n in GOLDENS
    ]
    assert all(t["host_loaded_tokens"] > 0 and t["evicted_chunks"] > 0 for t in totals)
    assert any(t["failed_stores"] > 0 for t in totals)
