"""The two bounds on a trace, with how long each took (and, optionally, backends beside them).

    python -m experiments.bench.oracle_bench [--limit 2000] [--page-size 16]
        [--capacity-tokens 200000 unlimited] [--concurrency 1] [--backend apc radix]
        [--output FILE]

Page keys are computed once and shared by every bound (their time is reported apart).
Backends, when named, run the replay protocol at the same capacity, so each row reads
backend <= Belady <= infinite.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from cachelib import create_cache
from experiments import defaults
from experiments.engine import replay, unlimited_pages
from experiments.oracle import belady_hits, infinite_hits, page_keys
from experiments.workloads.mooncake import load_mooncake

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "data/mooncake_conversation_2000.jsonl"


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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--page-size", type=int, default=defaults.PAGE_SIZE)
    ap.add_argument("--capacity-tokens", nargs="+", default=["200000", "unlimited"])
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--backend", nargs="*", default=[])
    ap.add_argument("--output", type=Path)
    args = ap.parse_args(argv)
    requests = load_mooncake(args.trace, args.limit)
    ps = args.page_size
    t0 = time.perf_counter()
    keys = page_keys(requests, ps)
    out: dict[str, Any] = {
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
    if args.output:
        args.output.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
