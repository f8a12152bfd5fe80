"""Metrics of a serving run, as the report shows them (DESIGN §6)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cachelib.types import CacheStats
from experiments.engine.request import ServingResult

#: points kept of the pages-in-use timeline and of the TTFT distribution in result JSON
SERIES_POINTS = 400


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _downsample(timeline: list[tuple[float, int]], points: int) -> list[tuple[float, int]]:
    if len(timeline) <= points:
        return [(float(t), int(p)) for t, p in timeline]
    idx = np.linspace(0, len(timeline) - 1, points).round().astype(int)
    return [(float(timeline[i][0]), int(timeline[i][1])) for i in idx]


def serving_metrics(res: ServingResult, stats: CacheStats, *, setup_seconds: float = 0.0) -> dict[str, Any]:
    """Summary of a serving run plus the series the plots need (downsampled)."""
    # samples forked from a request (parallel sampling) share its prompt: count it once
    done = [r for r in res.requests if not r["aborted"] and r.get("sample_of") is None]
    rows = [r for r in res.requests if not r["aborted"]]
    prompt = sum(r["prompt_tokens"] for r in done)
    hits = sum(r["hit_tokens_first"] for r in done)
    decoded = sum(max(r["generated"] - 1, 0) for r in rows)
    computed = sum(r["computed_tokens"] for r in res.requests)
    generated = sum(r["generated"] for r in rows)
    ttft = sorted(r["ttft"] for r in done if r["ttft"] is not None)
    tpot = [r["tpot"] for r in done if r["tpot"] is not None]
    span = res.makespan if res.makespan > 0 else float("nan")
    return {
        "requests": sum(1 for r in res.requests if r.get("sample_of") is None),
        "samples": len(res.requests),
        "finished": len(done),
        "aborted": res.aborted,
        "prompt_tokens": prompt,
        "hit_tokens": hits,
        "hit_rate": hits / prompt if prompt else 0.0,
        # prompt tokens whose KV was computed, recomputation after preemption included
        "prefill_tokens_computed": computed - decoded,
        "generated_tokens": generated,
        "evicted_pages": stats.evicted_pages,
        "copied_pages": stats.copied_pages,
        "peak_pages": res.peak_pages,
        "metadata_bytes_end": stats.metadata_bytes,
        "cache_us_per_request": res.cache_seconds / len(res.requests) * 1e6 if res.requests else 0.0,
        "ttft_p50": _pct(ttft, 50),
        "ttft_p99": _pct(ttft, 99),
        "tpot_p50": _pct(tpot, 50),
        "throughput_tokens_per_s": generated / span if res.makespan > 0 else None,
        "makespan_s": res.makespan,
        "prefix_setup_s": setup_seconds,
        "preemptions": res.preemptions,
        "steps": res.steps,
        "ttft_quantiles": np.quantile(ttft, np.linspace(0, 1, min(SERIES_POINTS, len(ttft)))).tolist() if ttft else [],
        "pages_timeline": _downsample(res.timeline, SERIES_POINTS),
    }
