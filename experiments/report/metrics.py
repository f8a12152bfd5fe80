"""Metrics of a serving run, as the report shows them (docs/design.md §6), and its latencies as
`vllm bench serve` reports them (`latency_section`).

Latencies (`latency_section`), in ms, each with mean, p50, p90 and p99 (`np.percentile`
over the values, as vLLM's bench computes them), over the requests that finished
(parallel samples left out, as TTFT always was):
- TTFT: arrival (joining the queue) to the first token;
- TPOT: per request, `(finished − first token) / (tokens − 1)`, requests of 2+ tokens;
- ITL: every gap between two consecutive tokens of a request (engine/token_gaps.py);
- E2E: arrival to the last token.
Throughput as `vllm bench serve` names it (`serving_metrics`), over the run's makespan:
`request_throughput` (requests finished /s), `output_throughput` (tokens generated /s) and
`total_token_throughput` (prompt tokens of the finished requests plus tokens generated, /s).
Goodput, when SLOs are given (`--slo-ttft-ms`, `--slo-tpot-ms`): requests/s over the run
(its makespan) that met every SLO given, TTFT and TPOT each at most its SLO; a one-token
request's TPOT counts as 0 (vLLM's `calculate_metrics`: `all_tpots` gets 0 for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cachelib.types import CacheStats
from experiments.engine.request import ServingResult
from experiments.engine.token_gaps import TokenGaps

#: points kept of the pages-in-use timeline and of the TTFT distribution in result JSON
SERIES_POINTS = 400
#: the quantiles of a latency summary, and their keys
QUANTILES = (("p50", 50), ("p90", 90), ("p99", 99))


@dataclass(frozen=True)
class Slos:
    """Goodput's service-level objectives in ms (None: not set)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, record: dict[str, Any]) -> bool:
        """`record` (a finished request) met every SLO given."""
        if self.ttft_ms is not None and record["ttft"] * 1000.0 > self.ttft_ms:
            return False
        tpot = record["tpot"] or 0.0  # one token: no TPOT, as vLLM counts it 0
        return self.tpot_ms is None or tpot * 1000.0 <= self.tpot_ms


#: no SLO set: no goodput
NO_SLOS = Slos()


def latency_ms(seconds: list[float] | np.ndarray) -> dict[str, float | None]:
    """Mean and quantiles, in milliseconds (None without values)."""
    if not len(seconds):
        return {"mean": None, **{k: None for k, _ in QUANTILES}}
    ms = np.asarray(seconds, dtype=float) * 1000.0
    # every quantile in one call: one partition of the (ITL: millions of gaps) values for
    # all of them, each the same order statistics and interpolation as a call of its own
    qs = np.percentile(ms, [q for _, q in QUANTILES]).tolist()
    return {"mean": float(ms.mean()), **{k: v for (k, _), v in zip(QUANTILES, qs, strict=True)}}


def latency_section(
    records: list[dict[str, Any]], gaps: TokenGaps, duration_s: float, slos: Slos = NO_SLOS
) -> dict[str, Any]:
    """TTFT, TPOT, ITL and E2E in ms over `records` and `gaps`, and the goodput over
    `duration_s` when `slos` are given (see the module docstring)."""
    done = [r for r in records if not r["aborted"] and r.get("sample_of") is None and r["finished_at"] is not None]
    out: dict[str, Any] = {
        "ttft_ms": latency_ms([r["ttft"] for r in done if r["ttft"] is not None]),
        "tpot_ms": latency_ms([r["tpot"] for r in done if r["tpot"] is not None]),
        "itl_ms": latency_ms(gaps.expanded()),
        "e2e_ms": latency_ms([r["finished_at"] - r["arrival"] for r in done]),
    }
    if slos.given:
        good = sum(1 for r in done if r["ttft"] is not None and slos.met(r))
        out["goodput"] = {
            "slo_ttft_ms": slos.ttft_ms,
            "slo_tpot_ms": slos.tpot_ms,
            "good_requests": good,
            "requests_per_s": good / duration_s if duration_s > 0 else None,
        }
    return out


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _downsample(timeline: list[tuple[float, int]], points: int) -> list[tuple[float, int]]:
    if len(timeline) <= points:
        return [(float(t), int(p)) for t, p in timeline]
    idx = np.linspace(0, len(timeline) - 1, points).round().astype(int)
    return [(float(timeline[i][0]), int(timeline[i][1])) for i in idx]


#: a run is saturated when the requests arriving last wait this many times longer for their
#: first token than those arriving first, and at least `SATURATED_TTFT_S` (the queue grew
#: over the run instead of draining: what is compared is queues, not caches)
SATURATED_GROWTH = 4.0
SATURATED_TTFT_S = 1.0


def saturation(done: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the offered load exceeded what was served: the median TTFT of the last
    tenth of the requests by arrival against the first tenth's (a stable system keeps them
    alike; an overloaded one's queue, and so its TTFT, grows with time)."""
    timed = sorted((r["arrival"], r["ttft"]) for r in done if r["ttft"] is not None)
    tenth = len(timed) // 10
    if tenth < 5:
        return {"saturated": False, "first_tenth_ttft_s": None, "last_tenth_ttft_s": None, "requests": len(timed)}
    first = float(np.median([t for _, t in timed[:tenth]]))
    last = float(np.median([t for _, t in timed[-tenth:]]))
    grew = last >= SATURATED_GROWTH * max(first, 1e-9) and last >= SATURATED_TTFT_S
    return {"saturated": bool(grew), "first_tenth_ttft_s": first, "last_tenth_ttft_s": last, "requests": len(timed)}


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
        # CPU time in cache calls (engine/cache_client.py CPU_CLOCK), per request and sample
        "cache_us_per_request": res.cache_seconds / len(res.requests) * 1e6 if res.requests else 0.0,
        "ttft_p50": _pct(ttft, 50),
        "ttft_p99": _pct(ttft, 99),
        "tpot_p50": _pct(tpot, 50),
        # vLLM's names (`vllm/benchmarks/serve.py` BenchmarkMetrics), over the makespan
        "request_throughput": len(done) / span if res.makespan > 0 else None,
        "output_throughput": generated / span if res.makespan > 0 else None,
        "total_token_throughput": (prompt + generated) / span if res.makespan > 0 else None,
        "makespan_s": res.makespan,
        "saturation": saturation(done),
        "prefix_setup_s": setup_seconds,
        "preemptions": res.preemptions,
        "steps": res.steps,
        "ttft_quantiles": np.quantile(ttft, np.linspace(0, 1, min(SERIES_POINTS, len(ttft)))).tolist() if ttft else [],
        "pages_timeline": _downsample(res.timeline, SERIES_POINTS),
        **({"tiers": tier_section(res)} if any("host_hit_tokens" in r for r in res.requests) else {}),
    }


def tier_section(res: ServingResult) -> dict[str, Any]:
    """A tiered cache's serving run: prompt tokens reused per tier over every admission of
    the requests that finished (GPU, loaded from a lower tier, of those from storage), and
    the timed transfers (`ServingResult.transfers`: tokens and bytes per direction, the
    steps' stall on layer-by-layer loads, requests' waits for async loads, scheduling held
    up by blocking backups, storage reads and writes, requests' waits for storage
    prefetches; all 0 when transfers were instant)."""
    rows = [r for r in res.requests if not r["aborted"]]
    moved = res.transfers or {}
    return {
        "gpu_hit_tokens": sum(r["gpu_hit_tokens"] for r in rows),
        "host_hit_tokens": sum(r["host_hit_tokens"] for r in rows),
        "storage_hit_tokens": sum(r.get("storage_hit_tokens", 0) for r in rows),
        "timed_transfers": res.transfers is not None,
        "host_to_gpu_bytes": moved.get("host_to_gpu_bytes", 0),
        "gpu_to_host_bytes": moved.get("gpu_to_host_bytes", 0),
        "load_stall_s": moved.get("load_stall_s", 0.0),
        "load_wait_s": sum(r["load_wait_s"] for r in rows),
        "storage_to_host_bytes": moved.get("storage_to_host_bytes", 0),
        "host_to_storage_bytes": moved.get("host_to_storage_bytes", 0),
        "prefetch_wait_s": sum(r.get("prefetch_wait_s", 0.0) for r in rows),
        "backup_blocked_s": moved.get("backup_blocked_s", 0.0),
        # LMCache's connector: the steps' wait on synchronous stores, when timed
        **({"store_stall_s": moved["store_stall_s"]} if "store_stall_s" in moved else {}),
    }
