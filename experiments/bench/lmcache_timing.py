"""apc-lmcache's TTFT with its transfers timed as LMCache's vLLM connector runs them, against
instant transfers (the replay protocol's timing), on the serving engine with the cost model.

    python -m experiments.bench.lmcache_timing [--trace FILE] [--limit 300]
        [--capacity-tokens 200000] [--host-tokens 400000] [--disk-tokens 2000000]
        [--output bench-results/lmcache_timing.json]

Three designs (host only; host + disk; host + disk with `lmcache_use_layerwise`), each served
twice (`ServingConfig.time_transfers` off and on): TTFT p50 / p99, tokens reused per tier, the
steps' load and store stall, and the bytes moved each way (`serving.tiers`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from experiments.bench import FULL_TRACE, RESULTS, HelpFormatter, write_output


def designs(host: int, disk: int) -> list[tuple[str, dict]]:
    both = dict(host_capacity_tokens=host, disk_capacity_tokens=disk)
    return [
        ("host", dict(host_capacity_tokens=host)),
        ("host+disk", both),
        ("host+disk layerwise", both | dict(lmcache_use_layerwise=True)),
    ]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.lmcache_timing",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--trace", type=Path, default=FULL_TRACE, help="a Mooncake JSONL trace")
    p.add_argument("--limit", type=int, default=300, help="serve only the first N requests")
    p.add_argument("--capacity-tokens", type=int, default=200_000, help="GPU KV tokens")
    p.add_argument("--host-tokens", type=int, default=400_000, help="LMCache host store, tokens")
    p.add_argument("--disk-tokens", type=int, default=2_000_000, help="LMCache disk store, tokens")
    p.add_argument("--page-size", type=int, default=16, help="GPU page (block) size in tokens")
    p.add_argument("--output", type=Path, default=RESULTS / "lmcache_timing.json", help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.trace.is_file():
        p.error(f"no trace at {args.trace} (pass --trace)")
    from cachelib import create_cache
    from experiments.engine import CostModelExecutor, ServingConfig
    from experiments.engine.serving import serve
    from experiments.report.metrics import tier_section
    from experiments.workloads.mooncake import load_mooncake

    requests = load_mooncake(args.trace, limit=args.limit)
    rows = []
    for name, opts in designs(args.host_tokens, args.disk_tokens):
        for timed in (False, True):
            cache = create_cache(
                "apc-lmcache", num_pages=args.capacity_tokens // args.page_size, page_size=args.page_size, **opts
            )
            res = serve(cache, requests, CostModelExecutor(), ServingConfig(time_transfers=timed))
            ttft = [r["ttft"] for r in res.requests if not r["aborted"]]
            row = {
                "design": name,
                "timed": timed,
                "ttft_p50": float(np.percentile(ttft, 50)),
                "ttft_p99": float(np.percentile(ttft, 99)),
                **tier_section(res),
            }
            rows.append(row)
            print(
                f"{name:20s} timed={timed!s:5s} TTFT p50 {row['ttft_p50']:.3f} s p99 {row['ttft_p99']:.3f} s  "
                f"GPU {row['gpu_hit_tokens']} lower tiers {row['host_hit_tokens']} (disk {row['storage_hit_tokens']}) tokens  load stall "
                f"{row['load_stall_s']:.3f} s store stall {row.get('store_stall_s', 0.0):.3f} s",
                flush=True,
            )
    write_output(args.output, json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
