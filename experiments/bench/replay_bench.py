"""Cache-manager speed on the replay protocol: µs per request inside cache calls.

    python -m experiments.bench.replay_bench [--backend apc] [--page-size 16]
        [--capacity-tokens 200000] [--limit 2000] [--runs 3] [--clock perf|thread]
        [--output bench-results/replay_bench.json]

Each run replays the trace on a fresh cache; prompts are expanded before timing starts,
and only time inside cache calls counts (hashing included). Reports every run, the median
and the spread, plus what the machine was. `--clock thread` reads the CPU time of the
thread (`time.thread_time`) around each call instead of the wall clock: on a machine
shared with other jobs it does not count the time the process waits for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from cachelib import create_cache
from experiments.bench import CLOCK_HELP, CLOCKS, RESULTS, SHIPPED_TRACE, HelpFormatter, write_output
from experiments.engine import replay
from experiments.engine.cache_client import CacheClient
from experiments.report.results import git_commit
from experiments.runs import defaults
from experiments.workloads.mooncake import load_mooncake
from experiments.workloads.spec import RequestSpec

DEFAULT_TRACE = SHIPPED_TRACE


def bench(
    backend: str,
    requests: list[RequestSpec],
    page_size: int,
    capacity_tokens: int,
    runs: int,
    clock: str = "perf",
    **options,
) -> dict:
    per_run = []
    result = None
    for _ in range(runs):
        cache = create_cache(backend, num_pages=capacity_tokens // page_size, page_size=page_size, **options)
        result = replay(CacheClient(cache, CLOCKS[clock]), requests)
        per_run.append(result["us_per_request"])
    assert result is not None
    return {
        "backend": backend,
        "options": options,
        "page_size": page_size,
        "capacity_tokens": capacity_tokens,
        "clock": clock,
        "requests": len(requests),
        "runs_us_per_request": per_run,
        "median_us_per_request": statistics.median(per_run),
        "min_us_per_request": min(per_run),
        "max_us_per_request": max(per_run),
        "hit_rate": result["hit_rate"],
        "evicted_pages": result["evicted_pages"],
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.replay_bench",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--backend", nargs="+", default=["apc"], help="backends to time, one after another")
    p.add_argument("--page-size", type=int, default=defaults.PAGE_SIZE, help="tokens per page")
    p.add_argument("--capacity-tokens", type=int, default=200_000, help="cache capacity in tokens")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace to replay")
    p.add_argument("--limit", type=int, default=2000, help="replay the trace's first N requests")
    p.add_argument("--runs", type=int, default=3, help="replays per backend, each on a fresh cache")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="perf", help=CLOCK_HELP)
    p.add_argument("--output", type=Path, default=RESULTS / "replay_bench.json", help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")

    specs = load_mooncake(args.trace, args.limit)
    # expand prompts once, outside the timed region
    requests = [RequestSpec(s.request_id, np.ascontiguousarray(s.prompt), s.output_len, s.arrival) for s in specs]
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    load_start = os.getloadavg()  # how busy the machine was: wall-clock figures run high under load
    results = []
    for backend in args.backend:
        r = bench(backend, requests, args.page_size, args.capacity_tokens, args.runs, args.clock)
        results.append(r)
        print(
            f"{backend}: page size {args.page_size}, {args.capacity_tokens} tokens, {len(requests)} requests, "
            f"{args.clock} clock: "
            f"median {r['median_us_per_request']:.0f} us/request in cache calls "
            f"(runs {', '.join(f'{x:.0f}' for x in r['runs_us_per_request'])}), hit rate {r['hit_rate']:.2%}"
        )
    out = {
        "benchmark": "replay_cache_us_per_request",
        "command": "python -m experiments.bench.replay_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started,
        "commit": git_commit(),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "load_avg_start": load_start,
            "load_avg_end": os.getloadavg(),
        },
        "trace": str(args.trace),
        "results": results,
    }
    write_output(args.output, json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
