"""Peak memory and time of the bounds (`experiments.runs.runner.bounds`) on a Mooncake trace.

    python -m experiments.bench.bounds_memory [--trace FILE] [--limit N] [--page-size 16]
        [--capacity-tokens 200000 1000000 3000000 10000000] [--expect RESULTS_JSON]
        [--output bench-results/bounds_memory.json]

Does what `make mooncake`'s bounds task does, in this process: load the trace as the
`mooncake` workload, then `bounds(workload, page_size, capacities)`. Prints one JSON object:
seconds to load and to compute the bounds, peak RSS (`ru_maxrss`, the process's high-water
mark) after loading and at the end, and the bounds themselves; writes it to `--output`. Run it in a fresh process
per measurement (the high-water mark never goes down). For ten times the conversation trace,
write one first with `python -m experiments.bench.repeat_trace TRACE --times 10 --output FILE`.
`--expect` compares the bounds with a results.json's `bounds` (e.g. `git show
HEAD:reports/mooncake/results.json > old.json`) and exits 1 if they differ in any number.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from experiments.bench import FULL_TRACE, RESULTS, HelpFormatter, write_output
from experiments.runs.runner import bounds
from experiments.workloads.registry import make_workload

DEFAULT_TRACE = FULL_TRACE
CAPACITIES = [200_000, 1_000_000, 3_000_000, 10_000_000]


def peak_rss_mb() -> float:
    """This process's peak resident set so far, in MB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.bench.bounds_memory",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace (make mooncake's)")
    ap.add_argument("--limit", type=int, help="use the trace's first N requests (default: all of them)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument(
        "--capacity-tokens", type=int, nargs="+", default=CAPACITIES, help="capacities in tokens for the Belady bound"
    )
    ap.add_argument(
        "--expect",
        type=Path,
        help="a results.json whose bounds these must equal; exit 1 if they differ (default: no comparison)",
    )
    ap.add_argument("--output", type=Path, default=RESULTS / "bounds_memory.json", help="JSON file to write")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    workload = make_workload("mooncake", path=str(args.trace), limit=args.limit)
    load_s = time.perf_counter() - t0
    rss_load = peak_rss_mb()
    t0 = time.perf_counter()
    result = bounds(workload, args.page_size, args.capacity_tokens)
    bounds_s = time.perf_counter() - t0
    out = {
        "trace": str(args.trace.resolve()),
        "requests": len(workload.requests),
        "page_size": args.page_size,
        "capacity_tokens": args.capacity_tokens,
        "load_seconds": round(load_s, 2),
        "bounds_seconds": round(bounds_s, 2),
        "peak_rss_mb_after_load": round(rss_load, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "oracle_module": sys.modules["experiments.bounds.oracle"].__file__,  # which implementation ran
        "bounds": result,
    }
    if args.expect:
        out["equals_expected"] = json.loads(args.expect.read_text())["bounds"] == result
    print(json.dumps(out, indent=1))
    write_output(args.output, json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(0 if main().get("equals_expected", True) else 1)
