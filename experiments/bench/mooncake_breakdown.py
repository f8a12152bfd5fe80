"""Where `make mooncake`'s time goes: CPU seconds per part, one cell at a time, in one process.

    python -m experiments.bench.mooncake_breakdown [--trace FILE] [--limit N]
        [--backend apc radix radix-aged paged none] [--capacity-tokens 200000 ... 10000000]
        [--no-bounds] [--output bench-results/mooncake_breakdown.json]

`make mooncake` runs 5 backends x 4 capacities, each cell under the replay and the serving
protocol, plus the bounds (Belady and infinite) beside them; its wall time is roughly the
sum of these parts over its two workers. This script times each part separately with the
thread's CPU time (`time.thread_time`), which a loaded machine does not inflate: the trace
load, every cell's replay and serving (with the serving steps taken, and the cache's own
share as the serving protocol reports it), and the bounds. The `none` backend's serving
time is the engine's own cost (its cache does next to nothing); what the others spend
beyond it is their cache. The figures and tables are not timed here (a second or two).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
from pathlib import Path

from experiments.bench import FULL_TRACE, RESULTS, HelpFormatter, write_output
from experiments.report.results import git_commit
from experiments.runs.runner import CellConfig, bounds, build_workload, run_cell
from experiments.workloads.generators import Workload

BACKENDS = ("apc", "radix", "radix-aged", "paged", "none")
CAPACITIES = (200_000, 1_000_000, 3_000_000, 10_000_000)


def cell_parts(cfg: CellConfig, workload: Workload) -> dict[str, float | int]:
    """CPU seconds of `cfg`'s replay and serving, serving's steps and its cache seconds."""
    out: dict[str, float | int] = {}
    for protocol in ("replay", "serving"):
        t = time.thread_time()
        res = run_cell(dataclasses.replace(cfg, protocol=protocol), workload)
        out[f"{protocol}_cpu_s"] = round(time.thread_time() - t, 3)
        if protocol == "replay":
            out["replay_cache_s"] = round(res["replay"]["cache_seconds"], 3)
        else:  # serving reports µs per request
            out["serving_cache_s"] = round(res["serving"]["cache_us_per_request"] * len(workload.requests) / 1e6, 3)
    out["serving_steps"] = res["serving"]["steps"]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.mooncake_breakdown",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--trace", type=Path, default=FULL_TRACE, help="the Mooncake conversation trace")
    p.add_argument("--limit", type=int, default=None, help="first N requests only (default: the whole trace)")
    p.add_argument("--backend", nargs="+", default=list(BACKENDS), help="backends to time")
    p.add_argument("--capacity-tokens", nargs="+", type=int, default=list(CAPACITIES), help="capacities to time")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--no-bounds", action="store_true", help="leave the bounds out")
    p.add_argument("--output", type=Path, default=RESULTS / "mooncake_breakdown.json", help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    knobs: dict[str, object] = {"path": str(args.trace)}
    if args.limit is not None:
        knobs["limit"] = args.limit
    template = CellConfig(
        backend=args.backend[0], workload="mooncake", capacity_tokens=args.capacity_tokens[0], page_size=args.page_size,
        knobs=knobs,
    )  # fmt: skip
    out: dict[str, object] = {
        "benchmark": "mooncake_breakdown",
        "command": "python -m experiments.bench.mooncake_breakdown "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": git_commit(),
        "clock": "thread",
        "load_avg": os.getloadavg(),
    }
    t = time.thread_time()
    workload = build_workload(template)  # bad input fails here, before any cell
    out["load_cpu_s"] = round(time.thread_time() - t, 3)
    out["requests"] = len(workload.requests)
    cells = []
    for cap in args.capacity_tokens:
        for backend in args.backend:
            cfg = dataclasses.replace(template, backend=backend, capacity_tokens=cap)
            row = {"backend": backend, "capacity_tokens": cap, **cell_parts(cfg, workload)}
            cells.append(row)
            print(json.dumps(row), flush=True)
    out["cells"] = cells
    if not args.no_bounds:
        t = time.thread_time()
        bounds(workload, args.page_size, list(args.capacity_tokens))
        out["bounds_cpu_s"] = round(time.thread_time() - t, 3)
        print(f"bounds: {out['bounds_cpu_s']} s", flush=True)
    out["total_cpu_s"] = round(
        out["load_cpu_s"] + sum(c["replay_cpu_s"] + c["serving_cpu_s"] for c in cells) + out.get("bounds_cpu_s", 0.0), 3
    )  # type: ignore[operator]
    out["max_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["load_avg_end"] = os.getloadavg()
    write_output(args.output, json.dumps(out, indent=1) + "\n")
    print(f"total {out['total_cpu_s']} s CPU; wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
