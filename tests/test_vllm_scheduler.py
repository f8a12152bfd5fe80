"""The `vllm` scheduler policy against the real vLLM 0.33.0 V1 scheduler, request for request.

The goldens in tests/fixtures/vllm_0_33/ were made by scripts/vllm_reference/run_vllm.py,
which runs vLLM's own `Scheduler` / `AsyncScheduler`, `KVCacheManager` and `BlockPool`
unmodified on CPU with a fake model runner and 20 ms per non-empty step (its README says
how; the config is in each golden). Here the project serves the same trace on apc with the
same budget, running limit, capacity and a `FixedStepExecutor(0.02)`; every request's prefix
hit at first admission, preemptions, first-token and finish step, and the times of both
must equal vLLM's.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from cachelib import create_cache
from experiments.engine import FixedStepExecutor, ServingConfig, serve
from experiments.workloads.mooncake import load_mooncake
from experiments.workloads.spec import RequestSpec

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm_0_33"
GOLDENS = sorted(p.name.removesuffix(".golden.json.gz") for p in FIXTURES.glob("*.golden.json.gz"))
DECISIONS = ("hit_tokens_first", "preemptions", "first_token_step", "finish_step")


def load(name: str) -> tuple[dict, list[RequestSpec]]:
    golden = json.loads(gzip.decompress((FIXTURES / f"{name}.golden.json.gz").read_bytes()))
    trace = golden["trace"]
    path = ROOT / trace["path"]
    if trace["kind"] == "mooncake":
        specs = load_mooncake(str(path))
    else:
        with gzip.open(path, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        specs = [
            RequestSpec(
                str(o["id"]), np.asarray(o["prompt"], dtype=np.int32), int(o["output_len"]), arrival=float(o["arrival"])
            )
            for o in rows
        ]
    if trace.get("limit"):
        specs = specs[: trace["limit"]]
    assert len(specs) == trace["requests"] == len(golden["requests"])
    return golden, specs


class NoWindows(FixedStepExecutor):
    """The same constant step, every step taken one by one."""

    supports_decode_windows: ClassVar[bool] = False


def serve_like(golden: dict, specs: list[RequestSpec], executor: FixedStepExecutor | None = None, eager: bool = False):
    cfg = golden["config"]
    assert cfg["block_size"] == 16 and cfg["step_ms"] == 20 and cfg["policy"] == "fcfs"
    # vLLM had capacity/16 + 1 blocks, one of them BlockPool's null block: the same usable pages
    assert cfg["num_gpu_blocks"] == cfg["capacity_tokens"] // 16 + 1
    cache = create_cache("apc", num_pages=cfg["capacity_tokens"] // 16, page_size=16)
    if eager:
        cache.decode_steps_are_noops = False  # a grow and a commit every decode step
    config = ServingConfig(
        cfg["max_num_batched_tokens"], cfg["max_num_seqs"], scheduler="vllm", async_scheduling=cfg["async_scheduling"]
    )
    res = serve(cache, specs, executor or FixedStepExecutor(0.02), config)
    cache.check_invariants()
    return sorted(res.requests, key=lambda r: r["request_index"]), res


@pytest.mark.parametrize("name", GOLDENS)
def test_every_request_decides_as_vllm(name):
    golden, specs = load(name)
    rows, res = serve_like(golden, specs)
    assert [r["request_index"] for r in rows] == list(range(len(specs)))
    bad = [
        (e["request_index"], {k: r[k] for k in DECISIONS}, {k: e[k] for k in DECISIONS})
        for r, e in zip(rows, golden["requests"], strict=True)
        if any(r[k] != e[k] for k in DECISIONS)
    ]
    assert not bad, f"{len(bad)} requests differ from vLLM, first: {bad[:3]}"
    for r, e in zip(rows, golden["requests"], strict=True):
        assert not r["aborted"] and r["generated"] == e["output_tokens"]
        # the goldens round times to the µs (float-clock noise); decisions used the raw clock
        assert round(r["first_token_at"] * 1000, 3) == e["first_token_ms"], e["request_index"]
        assert round(r["finished_at"] * 1000, 3) == e["finish_ms"], e["request_index"]
    totals = golden["totals"]
    assert res.steps == totals["steps"] and res.preemptions == totals["preemptions"]
    assert sum(r["hit_tokens_first"] for r in rows) == totals["hit_tokens_first"]


@pytest.mark.parametrize("name", [g for g in GOLDENS if g.endswith(".sync")][:2])
def test_decode_windows_and_batched_commits_change_nothing(name):
    """Decode windows (many decode steps priced at once) and batched decode commits decide
    exactly as single steps with a grow and a commit each."""
    golden, specs = load(name)
    windowed, a = serve_like(golden, specs)
    single, b = serve_like(golden, specs, NoWindows(0.02), eager=True)
    assert windowed == single and a.steps == b.steps and a.makespan == b.makespan


def test_the_goldens_cover_what_the_issue_names():
    """Memory pressure (preemptions), async, and the issue's reference figures."""
    totals = {
        name: json.loads(gzip.decompress((FIXTURES / f"{name}.golden.json.gz").read_bytes()))["totals"]
        for name in GOLDENS
    }
    mc = "mooncake_conversation_2000.first1000.cap{}.{}"
    assert {k: totals[mc.format(200000, "sync")][k] for k in ("hit_tokens_first", "preemptions", "steps")} == {
        "hit_tokens_first": 511_488,
        "preemptions": 25,
        "steps": 29_264,
    }
    assert {k: totals[mc.format(1000000, "sync")][k] for k in ("hit_tokens_first", "preemptions", "steps")} == {
        "hit_tokens_first": 608_608,
        "preemptions": 0,
        "steps": 17_357,
    }
    assert mc.format(200000, "async") in totals
    assert any(n.startswith("multi_turn_chat") and t["preemptions"] > 0 for n, t in totals.items())
