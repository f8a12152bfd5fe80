"""The two bounds on a trace, with how long each took (and, optionally, backends beside them).

    python -m experiments.bench.oracle_bench [--limit 2000] [--page-size 16]
        [--capacity-tokens 200000 unlimited] [--concurrency 1] [--backend apc radix]
        [--output bench-results/oracle_bench.json]

Page keys are computed once and shared by every bound (their time is reported apart).
Backends, when named, run the replay protocol at the same capacity, so each row reads
backend <= Belady <= infinite.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cachelib import create_cache
from experiments.bench import RESULTS, SHIPPED_TRACE, HelpFormatter, write_output
from experiments.bounds.oracle import belady_hits, infinite_hits, page_keys
from experiments.engine import replay, unlimited_pages
from experiments.runs import defaults
from experiments.workloads.mooncake import load_mooncake

DEFAULT_TRACE = SHIPPED_TRACE


def _row(result: dict[str, Any], seconds: float) -> dict[str, Any]:
    keep = (
        "backend",
        "capacity_tokens",
        "concurrency",
        "hit_tokens",
        "prompt_tokens",
        "hit_rate",
        "evicted_pages",
        "unschedulable",
        "truncated",
    )
    return {**{k: result.get(k) for k in keep}, "seconds": round(seconds, 3)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.bench.oracle_bench",
        description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format trace")
    ap.add_argument("--limit", type=int, default=2000, help="use the trace's first N requests")
    ap.add_argument("--page-size", type=int, default=defaults.PAGE_SIZE, help="tokens per page")
    ap.add_argument(
        "--capacity-tokens",
        nargs="+",
        default=["200000", "unlimited"],
        help="capacities in tokens at which to run Belady (and the backends); 'unlimited' for no bound",
    )
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at once (replay protocol)")
    ap.add_argument(
        "--backend", nargs="*", default=[], help="backends to replay beside the bounds at each capacity (none if empty)"
    )
    ap.add_argument("--output", type=Path, default=RESULTS / "oracle_bench.json", help="JSON file to write")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    requests = load_mooncake(args.trace, args.limit)
    ps = args.page_size
    t0 = time.perf_counter()
    keys = page_keys(requests, ps)
    out: dict[str, Any] = {
        "command": " ".join(["python -m experiments.bench.oracle_bench", *(sys.argv[1:] if argv is None else argv)]),
        "trace": str(args.trace),
        "requests": len(requests),
        "page_size": ps,
        "distinct_pages": keys.num_keys,
        "nodes": keys.num_nodes,
        "pages_per_node": keys.per_node,  # 512 // page size when built from Mooncake hash ids
        "page_keys_seconds": round(time.perf_counter() - t0, 3),
        "rows": [],
    }
    t0 = time.perf_counter()
    inf = infinite_hits(requests, ps, keys=keys)
    out["rows"].append(_row(inf, time.perf_counter() - t0))
    for cap in args.capacity_tokens:
        num_pages = None if cap == "unlimited" else int(cap) // ps
        t0 = time.perf_counter()
        bel = belady_hits(requests, ps, num_pages, args.concurrency, keys=keys)
        out["rows"].append(_row(bel, time.perf_counter() - t0))
        for name in args.backend:
            pages = unlimited_pages(requests, ps) if num_pages is None else num_pages
            t0 = time.perf_counter()
            res = replay(create_cache(name, num_pages=pages, page_size=ps), requests, concurrency=args.concurrency)
            out["rows"].append(_row(res, time.perf_counter() - t0))
    for row in out["rows"]:
        print(
            f"{row['backend']:>9}  capacity {str(row['capacity_tokens']):>10}  hit rate {row['hit_rate']:.4f}"
            f"  hit tokens {row['hit_tokens']:>9}  evicted {row['evicted_pages']:>8}  {row['seconds']:.2f} s"
        )
    print(
        f"page keys: {out['distinct_pages']} distinct pages in {out['nodes']} nodes of up to"
        f" {out['pages_per_node']}, {out['page_keys_seconds']:.2f} s"
    )
    write_output(args.output, json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.output}")
    return out


if __name__ == "__main__":
    main()
