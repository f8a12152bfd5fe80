"""What the engine reports, pinned: every serving, cluster and replay configuration below
runs through the public API (`serve`, `serve_cluster`, `replay`) and its outcome (every
request record, the ITL pairs, the page timeline, the step count, the cache's counters,
the order of its KV events, the transfers' totals; replay's whole result) is reduced to a
digest. `tests/fixtures/engine_goldens.json` holds the digests made by the engine before it
was rewritten as one policy (issue 31, at e4f87f7); `tests/test_engine_goldens.py` checks
the engine still gives each one.

Measured values (cache seconds) and fresh token ids (they are only ever compared for
equality, and the old loops drew them in another order) are left out; everything else is in.

Regenerate (only when a change of numbers is intended, and say so in the commit):

    python -m tests.engine_goldens --write            # every configuration, this checkout's engine
    python -m tests.engine_goldens --dump DIR         # the full outcomes as JSON, to diff two checkouts
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOLDENS = ROOT / "tests" / "fixtures" / "engine_goldens.json"

#: (workload, knobs): as tests/test_vllm_rows.py had them
WORKLOADS: dict[str, tuple[str, dict[str, Any]]] = {
    # a few hot documents, everything at once: admission fills memory, decoding preempts
    "docs": ("shared_doc_qa", dict(num_documents=4, doc_len=300, num_requests=60, output_len=40, output_dist="uniform", rate=50.0, vocab_size=5000)),
    # conversations whose next turn re-sends the recorded answer (forced outputs, dependent arrivals)
    "chat": ("multi_turn_chat", dict(num_conversations=8, turns=4, user_turn_len=60, answer_len=30, answer_dist="exponential", think_time=0.5, rate=20.0, vocab_size=5000)),
    # parallel samples (vLLM fans them out as requests sharing the prompt)
    "samples": ("parallel_sampling", dict(n=3, num_requests=12, rate=5.0)),
    # the shipped conversation trace's head: long prompts, chunked prefill
    "mooncake": ("mooncake", dict(limit=60)),
}  # fmt: skip

#: backend label -> (registered name, options beside the GPU pages; `host` is replaced by
#: twice the GPU's tokens)
BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "apc": ("apc", {}),
    "radix": ("radix", {}),
    "none": ("none", {}),
    "paged": ("paged", {}),
    "hicache-wt": ("radix-hicache", {"write_policy": "write_through", "host_capacity_tokens": "host"}),
    "hicache-wb": ("radix-hicache", {"write_policy": "write_back", "host_capacity_tokens": "host"}),
    "hicache-storage": (
        "radix-hicache",
        {"host_capacity_tokens": "host", "storage_backend": "file", "prefetch_threshold": 32},
    ),
    "apc-host": ("apc", {"host_eviction": "lru", "host_capacity_tokens": "host"}),
    "apc-lmcache": ("apc-lmcache", {"host_capacity_tokens": "host", "lmcache_chunk_size": 64}),
}
TIERED = ("hicache-wt", "hicache-wb", "hicache-storage", "apc-host", "apc-lmcache")


@dataclass(frozen=True)
class Case:
    """One configuration: how it runs and what it runs."""

    kind: str  # serve | cluster | replay
    workload: str
    backend: str
    pages: int
    options: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.kind}:{self.workload}:{self.backend}:{self.pages}:{opts}"


def cases() -> Iterator[Case]:
    for workload in WORKLOADS:
        for backend in BACKENDS:
            for pages in (40, 400):
                for executor in ("cost", "fixed"):
                    for loop in ("sync", "async"):
                        timings = (True, False) if backend in TIERED else (True,)
                        for timed in timings:
                            opts = {"executor": executor, "loop": loop, "timed": timed}
                            yield Case("serve", workload, backend, pages, opts)
    for workload in ("chat", "mooncake"):
        for backend in ("apc", "radix", "hicache-wt"):
            for router in ("round_robin", "cache_aware", "kv_cost", "precise", "least_load"):
                if router in ("kv_cost", "precise") and backend == "hicache-wt":
                    continue
                yield Case("cluster", workload, backend, 100, {"router": router, "replicas": 3})
    for workload in ("docs", "chat", "samples", "beams", "mooncake"):
        for backend in BACKENDS:
            for pages in (40, 400):
                for concurrency in (1, 4):
                    yield Case("replay", workload, backend, pages, {"concurrency": concurrency})


def _requests(workload: str):
    from experiments.workloads.registry import make_workload

    if workload == "beams":
        return make_workload("beam_search", seed=3, num_requests=8).requests
    name, knobs = WORKLOADS[workload]
    return make_workload(name, seed=3, **knobs).requests


def _cache(backend: str, num_pages: int, page_size: int = 16):
    from cachelib import create_cache

    name, options = BACKENDS[backend]
    opts = {k: (2 * num_pages * page_size if v == "host" else v) for k, v in options.items()}
    return create_cache(name, num_pages=num_pages, page_size=page_size, **opts)


class EventLog:
    """The order of a cache's KV events: kind and page count (keys hash fresh token ids)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def on_kv_event(self, event) -> None:
        self.log.append((type(event).__name__, len(event.keys)))


def _num_pages(requests, pages: int, page_size: int = 16) -> int:
    longest = max(s.prompt_len + max(s.output_lens) for s in requests)
    return max(pages, -(-longest // page_size) + 1)  # the longest request fits alone


def _executor(kind: str):
    from experiments.engine import CostModelExecutor, FixedStepExecutor

    return CostModelExecutor() if kind == "cost" else FixedStepExecutor(0.02)


def run_case(case: Case) -> dict[str, Any]:
    """The outcome of `case`, measured values and fresh token ids left out."""
    requests = _requests(case.workload)
    if case.kind == "replay":
        return _run_replay(case, requests)
    if case.kind == "cluster":
        return _run_cluster(case, requests)
    return _run_serve(case, requests)


def _serving_result(res, cache, events: EventLog) -> dict[str, Any]:
    stats = cache.stats()
    return {
        "records": sorted(res.requests, key=lambda rec: (rec["request_id"], rec.get("replica", 0))),
        "itl": [list(res.itl.values), list(res.itl.counts)],
        "timeline": [list(p) for p in res.timeline],
        "steps": res.steps,
        "preemptions": res.preemptions,
        "aborted": res.aborted,
        "peak": res.peak_pages,
        "makespan": res.makespan,
        "transfers": res.transfers,
        "stats": dataclasses.asdict(stats),
        "events": events.log,
    }


def _run_serve(case: Case, requests) -> dict[str, Any]:
    from experiments.engine import ServingConfig, serve

    o = case.options
    cache = _cache(case.backend, _num_pages(requests, case.pages))
    events = EventLog()
    if cache.emits_kv_events:
        cache.subscribe(events)
    config = ServingConfig(
        token_budget=512, max_running=16, async_scheduling=o["loop"] == "async", time_transfers=o["timed"]
    )
    res = serve(cache, requests, _executor(o["executor"]), config)
    cache.check_invariants()
    return _serving_result(res, cache, events)


def _run_cluster(case: Case, requests) -> dict[str, Any]:
    from experiments.engine import ServingConfig, serve_cluster
    from experiments.engine.routers.registry import make_router

    o = case.options
    n = o["replicas"]
    pages = _num_pages(requests, case.pages)
    caches = [_cache(case.backend, pages) for _ in range(n)]
    router = make_router(o["router"], n)
    res = serve_cluster(caches, requests, [_executor("cost") for _ in range(n)], router, ServingConfig(512, 16))
    out = {"makespan": res.makespan, "decisions": res.decisions, "router_stats": res.router_stats}
    out["replicas"] = [_serving_result(r, c, EventLog()) for r, c in zip(res.replicas, caches, strict=True)]
    return out


def _run_replay(case: Case, requests) -> dict[str, Any]:
    from experiments.engine import replay

    cache = _cache(case.backend, _num_pages(requests, case.pages))
    res = replay(cache, requests, concurrency=case.options["concurrency"])
    cache.check_invariants()
    return {k: v for k, v in res.items() if k not in ("cache_seconds", "us_per_request")}


def _canonical(x: Any) -> Any:
    """JSON-able, floats written exactly (repr), tuples as lists, NaN named."""
    if isinstance(x, dict):
        return {str(k): _canonical(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_canonical(v) for v in x]
    if isinstance(x, float):
        return "nan" if math.isnan(x) else repr(x)
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):  # a numpy scalar
        return _canonical(x.item())
    return x


def digest(outcome: dict[str, Any]) -> str:
    text = json.dumps(_canonical(outcome), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def summary(case: Case, outcome: dict[str, Any]) -> dict[str, Any]:
    """A few numbers to show beside a digest that moved."""
    if case.kind == "replay":
        return {k: outcome[k] for k in ("hit_tokens", "evicted_pages", "unschedulable", "truncated")}
    if case.kind == "cluster":
        return {"makespan": outcome["makespan"], "steps": [r["steps"] for r in outcome["replicas"]]}
    return {k: outcome[k] for k in ("steps", "preemptions", "makespan", "peak")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"write {GOLDENS.relative_to(ROOT)}")
    ap.add_argument("--dump", type=Path, help="write every outcome as JSON into this folder")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {}
    for case in cases():
        if args.only not in case.name:
            continue
        outcome = run_case(case)
        out[case.name] = {"digest": digest(outcome), "summary": _canonical(summary(case, outcome))}
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            name = hashlib.sha256(case.name.encode()).hexdigest()[:16]
            (args.dump / f"{name}.json").write_text(json.dumps({"case": case.name, "outcome": _canonical(outcome)}))
        print(case.name, out[case.name]["digest"], file=sys.stderr)
    if args.write:
        GOLDENS.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
