"""Sensitivity of `radix-aged` to its two knobs (half-life, cost weighting), replay protocol.

    .venv/bin/python -m experiments.bench.half_life_sweep --output reports/worked_example/radix-aged

(`--output` is a folder; by default `bench-results/half_life_sweep/`.)

Runs `radix` (LRU, and SGLang's LFU) and `radix-aged` at several half-lives, with and without the position
cost weight, on the workloads of the worked-example comparison; writes `half_life_sweep.json`
and `half_life_sweep.md` (hit rates beside the Belady bound at the same capacity).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from experiments.bench import RESULTS, HelpFormatter, write_output
from experiments.runs import defaults
from experiments.runs.runner import CellConfig, bounds, build_workload, run_cell

TRACE = "experiments/data/mooncake_conversation_2000.jsonl"
#: (label, workload, knobs, capacity tokens): the cases of reports/worked_example/radix-aged
CASES = [
    (
        "shared_doc_qa zipf 1.0 @ 100k",
        "shared_doc_qa",
        {"num_documents": 200, "num_requests": 2000, "rate": 20.0},
        100_000,
    ),
    ("multi_turn_chat @ 50k", "multi_turn_chat", {"num_conversations": 200, "turns": 6, "rate": 2.0}, 50_000),
    ("mooncake @ 1M", "mooncake", {"path": TRACE}, 1_000_000),
]
HALF_LIVES = [10, 50, 200, 1000, math.inf]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.bench.half_life_sweep",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "--output",
        default=str(RESULTS / "half_life_sweep"),
        help="folder to write half_life_sweep.json and half_life_sweep.md into",
    )
    ap.add_argument("--page-size", type=int, default=defaults.PAGE_SIZE, help="tokens per page")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    variants = [("radix (lru)", "radix", {}), ("radix (lfu, SGLang)", "radix", {"eviction_policy": "lfu"})]
    for cost in (27_000.0, None):
        for h in HALF_LIVES:
            label = f"radix-aged h={h:g}" + ("" if cost else ", no cost weight")
            variants.append((label, "radix-aged", {"half_life": h, "cost_context": cost}))
    rows = []
    for case, wl, knobs, cap in CASES:
        base = CellConfig(
            backend="radix", workload=wl, capacity_tokens=cap, page_size=args.page_size, knobs=knobs, protocol="replay"
        )
        workload = build_workload(base)
        belady = bounds(workload, args.page_size, [cap])["belady"][str(cap)]["hit_rate"]
        for label, backend, opts in variants:
            cfg = CellConfig(**{**base.as_dict(), "backend": backend, "backend_options": opts})
            t = time.perf_counter()
            hit = run_cell(cfg, workload)["replay"]["hit_rate"]
            rows.append(
                {
                    "case": case,
                    "variant": label,
                    "options": {k: str(v) for k, v in opts.items()},
                    "hit_rate": hit,
                    "belady": belady,
                }
            )
            print(
                f"{case:32s} {label:40s} {hit:6.1%}  (Belady {belady:.1%}, {time.perf_counter() - t:.1f}s)", flush=True
            )
    out = Path(args.output)
    write_output(out / "half_life_sweep.json", json.dumps({"page_size": args.page_size, "rows": rows}, indent=1) + "\n")
    cases = [c[0] for c in CASES]
    lines = ["| variant | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
    for label, _, _ in variants:
        cells = [next(r for r in rows if r["case"] == c and r["variant"] == label)["hit_rate"] for c in cases]
        lines.append(f"| {label} | " + " | ".join(f"{h:.1%}" for h in cells) + " |")
    lines.append(
        "| *Belady (offline)* | "
        + " | ".join(f"*{next(r for r in rows if r['case'] == c)['belady']:.1%}*" for c in cases)
        + " |"
    )
    write_output(
        out / "half_life_sweep.md", f"Replay hit rate (page size {args.page_size}).\n\n" + "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
