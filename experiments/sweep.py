"""A resumable grid: workloads x page sizes x capacities x backends.

Each finished cell is written to `OUT/cells/<key>.json` the moment it finishes; a rerun
skips every cell whose file exists, so an interrupted sweep resumes where it stopped. One
report per (workload, page size) is rendered into `OUT/<workload>-p<page>/`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from experiments.runner import CellConfig, build_workload, check_capacity

DEFAULT_CAPACITIES = [25_000, 50_000, 100_000, 200_000]


def run_sweep(args, backends, knobs_of, cells_of, execute, bounds, render, commit) -> int:
    out_dir = Path(args.output_dir)
    cell_dir = out_dir / "cells"
    cell_dir.mkdir(parents=True, exist_ok=True)
    workloads = args.workloads or (["mooncake"] if args.trace else [args.workload])
    knobs = knobs_of(args)
    capacities = args.capacity_tokens or DEFAULT_CAPACITIES
    started = time.perf_counter()
    plan: list[tuple[str, int, list[CellConfig]]] = []
    for wname in workloads:
        wknobs = knobs if wname == (args.workload if not args.trace else "mooncake") else {}
        for page in args.page_size:
            wl = build_workload(CellConfig(backend=backends[0], workload=wname, capacity_tokens=capacities[0], knobs=wknobs, seed=args.seed))
            for cap in capacities:
                check_capacity(wl, cap, page)
            plan.append((wname, page, cells_of(args, backends, capacities, page, wname, wknobs)))
    todo = [c for _, _, cells in plan for c in cells if not (cell_dir / f"{c.key()}.json").exists()]
    total = sum(len(cells) for _, _, cells in plan)
    print(f"sweep: {total} cells, {total - len(todo)} already done, {len(todo)} to run", file=sys.stderr)
    # run in batches so each finished batch is on disk before the next starts
    batch = max(args.jobs, 1)
    for i in range(0, len(todo), batch):
        chunk = todo[i : i + batch]
        for cfg, res in zip(chunk, execute(chunk, args.jobs, not args.no_progress, args.ray)):
            (cell_dir / f"{cfg.key()}.json").write_text(json.dumps(res) + "\n")
        print(f"  {min(i + batch, len(todo))}/{len(todo)} cells", file=sys.stderr)
    for wname, page, cells in plan:
        wl = build_workload(cells[0])
        results: dict[str, Any] = {
            "command": "python -m experiments " + " ".join(sys.argv[1:]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "commit": commit(),
            "workload": {"name": wl.name, "config": wl.config, "requests": len(wl)},
            "settings": {k: getattr(cells[0], k) for k in ("page_size", "executor", "device", "model", "token_budget", "max_running", "ordering", "protocol", "seed")},
            "backends": backends,
            "capacities": capacities,
            "bounds": None if args.no_bounds else bounds(wl, page, capacities),
            "cells": [json.loads((cell_dir / f"{c.key()}.json").read_text()) for c in cells],
        }
        sub = out_dir / f"{wname}-p{page}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        render(results, sub)
        print(f"wrote {sub}/report.md")
    print(f"sweep done in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0
