"""Metrics of a cluster run (`engine.cluster.serve_cluster`): the cluster as one serving result,
and the cluster section of a cell, with each replica beside it.

`merged_result` folds the replicas into one `ServingResult` (every record; pages pinned
summed over the replicas at every step end; steps, preemptions and cache time summed; the
cluster's makespan), so the cell's `serving` section reads as a single replica's does.
`cluster_section` adds what only a cluster has: per replica and for the whole cluster the hit
rate, TTFT, TPOT, ITL and E2E in ms (mean, p50, p90, p99; `metrics.latency_section`),
goodput when SLOs are given (a replica's over the cluster's makespan, so the replicas'
add up to the cluster's), preemptions and tokens served; the load imbalance (max / mean of
tokens served over the replicas); and what the router cost (CPU time per decision,
thread CPU time around `route`, `engine.cache_client.CPU_CLOCK`, reading the view included) and counted.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

from cachelib.types import CacheStats
from experiments.engine.cluster import ClusterResult
from experiments.engine.request import ServingResult
from experiments.engine.token_gaps import TokenGaps
from experiments.report.metrics import NO_SLOS, Slos, latency_section


def merged_result(res: ClusterResult) -> ServingResult:
    """The cluster as one `ServingResult` (see the module docstring)."""
    timeline = merged_timeline([r.timeline for r in res.replicas])
    return ServingResult(
        requests=res.requests,
        timeline=timeline,
        steps=sum(r.steps for r in res.replicas),
        preemptions=sum(r.preemptions for r in res.replicas),
        aborted=sum(r.aborted for r in res.replicas),
        cache_seconds=sum(r.cache_seconds for r in res.replicas),
        makespan=res.makespan,
        peak_pages=max((p for _, p in timeline), default=0),
        itl=TokenGaps.merged(r.itl for r in res.replicas),
    )


def merged_timeline(timelines: list[list[tuple[float, int]]]) -> list[tuple[float, int]]:
    """Pages pinned in the whole cluster after each replica's step: each replica's latest
    value, summed (every replica's timeline is in time order)."""
    current = [0] * len(timelines)
    total = 0
    out: list[tuple[float, int]] = []
    tagged = [[(t, i, p) for t, p in tl] for i, tl in enumerate(timelines)]
    for t, i, pinned in heapq.merge(*tagged):
        total += pinned - current[i]
        current[i] = pinned
        out.append((t, total))
    return out


def summed_stats(stats: list[CacheStats]) -> CacheStats:
    """One `CacheStats` for the cluster: every counter and page count summed."""
    first = stats[0]
    sums = {
        f.name: sum(getattr(s, f.name) for s in stats)
        for f in dataclasses.fields(CacheStats)
        if f.name not in ("backend", "page_size", "extra")
    }
    return CacheStats(backend=first.backend, page_size=first.page_size, **sums)


def summary(records: list[dict[str, Any]], gaps: TokenGaps, duration_s: float, slos: Slos) -> dict[str, Any]:
    """Hit rate, latencies (and goodput) and tokens served over `records` (a replica's or
    the cluster's); as `metrics.serving_metrics`, a parallel sample's shared prompt counts once."""
    done = [r for r in records if not r["aborted"] and r.get("sample_of") is None]
    rows = [r for r in records if not r["aborted"]]
    prompt = sum(r["prompt_tokens"] for r in done)
    hits = sum(r["hit_tokens_first"] for r in done)
    return {
        "requests": sum(1 for r in records if r.get("sample_of") is None),
        "finished": len(done),
        "hit_rate": hits / prompt if prompt else 0.0,
        **latency_section(records, gaps, duration_s, slos),
        "preemptions": sum(r["preemptions"] for r in records),
        # prompt tokens of what it finished plus every token it generated: the work it took
        "tokens_served": prompt + sum(r["generated"] for r in rows),
    }


def cluster_section(
    res: ClusterResult, stats: list[CacheStats], router_options: dict[str, Any], slos: Slos = NO_SLOS
) -> dict[str, Any]:
    """The cell's `cluster` section (see the module docstring)."""
    per_replica = []
    for i, (r, st) in enumerate(zip(res.replicas, stats, strict=True)):
        per_replica.append(
            {
                "replica": i,
                **summary(r.requests, r.itl, res.makespan, slos),
                "evicted_pages": st.evicted_pages,
                "peak_pages": r.peak_pages,
                "steps": r.steps,
                "makespan_s": r.makespan,
            }
        )
    served = [p["tokens_served"] for p in per_replica]
    mean = sum(served) / len(served)
    return {
        "replicas": len(res.replicas),
        "router": res.router,
        "router_options": router_options,
        "router_decisions": res.decisions,
        "router_us_per_decision": res.router_seconds / res.decisions * 1e6 if res.decisions else 0.0,
        "router_counters": res.router_stats,
        "load_imbalance": max(served) / mean if mean > 0 else None,
        **summary(res.requests, TokenGaps.merged(r.itl for r in res.replicas), res.makespan, slos),
        "per_replica": per_replica,
    }
