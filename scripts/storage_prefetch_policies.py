"""Serve the first requests of the shipped Mooncake conversation slice on `radix-hicache`
with a storage tier, once per SGLang 0.5.23 prefetch policy with storage transfers on the
serving clock (and once with instant transfers, the replay protocol's timing), and print
TTFT and reuse by tier.

    PYTHONPATH=. python scripts/storage_prefetch_policies.py --limit 300 --arrival-scale 1
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from cachelib import create_cache
from experiments.bench import SHIPPED_TRACE
from experiments.engine import CostModelExecutor, ServingConfig
from experiments.engine.serving import serve
from experiments.report.metrics import tier_section
from experiments.workloads.mooncake import load_mooncake


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--limit", type=int, default=300, help="requests of the trace served")
    ap.add_argument("--gpu-tokens", type=int, default=200_000, help="GPU KV capacity in tokens")
    ap.add_argument("--host-tokens", type=int, default=400_000, help="host tier capacity in tokens")
    ap.add_argument("--storage-tokens", type=int, default=2_000_000, help="storage tier capacity in tokens")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page")
    ap.add_argument("--arrival-scale", type=float, default=1.0, help="multiply every arrival time (>1: lighter load)")
    ap.add_argument("--token-budget", type=int, default=8192, help="tokens computed per step")
    args = ap.parse_args()
    for name in ("limit", "gpu_tokens", "host_tokens", "storage_tokens", "page_size", "token_budget"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if not args.arrival_scale > 0:
        ap.error("--arrival-scale must be positive")
    specs = load_mooncake(SHIPPED_TRACE, limit=args.limit)
    specs = [dataclasses.replace(s, arrival=s.arrival * args.arrival_scale) for s in specs]
    ps = args.page_size
    print("policy        clock   ttft_p50_s ttft_mean_s gpu_hit lower_hit storage_hit s2h_GB h2s_GB prefetch_wait_s")
    for policy, timed in (("best_effort", False), ("best_effort", True), ("wait_complete", True), ("timeout", True)):
        cache = create_cache(
            "radix-hicache",
            num_pages=args.gpu_tokens // ps,
            page_size=ps,
            host_capacity_tokens=args.host_tokens,
            storage_backend="file",
            storage_capacity_tokens=args.storage_tokens,
            prefetch_policy=policy,
        )
        res = serve(
            cache, specs, CostModelExecutor(), ServingConfig(time_transfers=timed, token_budget=args.token_budget)
        )
        ttft = np.array([r["ttft"] for r in res.requests if not r["aborted"]])
        t = tier_section(res)
        print(
            f"{policy:13s} {'timed' if timed else 'instant':7s} {np.median(ttft):10.3f} {ttft.mean():11.3f} "
            f"{t['gpu_hit_tokens']:7d} {t['host_hit_tokens']:9d} {t['storage_hit_tokens']:11d} "
            f"{t['storage_to_host_bytes'] / 1e9:6.2f} {t['host_to_storage_bytes'] / 1e9:6.1f} {t['prefetch_wait_s']:15.2f}"
        )


if __name__ == "__main__":
    main()
