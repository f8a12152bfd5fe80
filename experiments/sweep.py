"""A resumable grid: workloads x page sizes x capacities x backends.

Each finished cell is written to `OUT/cells/<key>.json` the moment it finishes (atomically:
a temporary file renamed into place, so an interrupted write never looks finished); a
rerun skips every cell whose file exists and parses, so an interrupted sweep resumes where
it stopped. The key hashes the cell's whole configuration, so changing any setting (a knob,
the seed, the executor...) makes new cells rather than reusing stale ones. One report per
(workload, page size) is rendered into `OUT/<workload>-p<page>/` from the cell files.

Cells run in local processes (`--jobs N`) or on Ray (`--ray local|ADDRESS`, see
`experiments/ray_runner.py`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from experiments.results import document, write
from experiments.runner import CellConfig, bounds, build_workload, check_capacity

DEFAULT_CAPACITIES = [25_000, 50_000, 100_000, 200_000]


def _workload_knobs(wname: str, knobs: dict[str, Any], args) -> dict[str, Any]:
    """The knobs that apply to one workload of the grid.

    Without `--knob` (and `--trace`) the knobs are the built-in defaults of `--workload`
    and belong to it alone; given knobs go to every workload of the grid that takes them."""
    if not getattr(args, "knob", None) and not args.trace:
        return knobs if wname == args.workload else {}
    from experiments.workloads.registry import WORKLOADS, knobs_of

    if len(set(args.workloads or [])) <= 1 or wname not in WORKLOADS:
        return knobs  # one workload: make_workload names a knob it does not take, or an unknown name
    accepted = knobs_of(wname)
    return {k: v for k, v in knobs.items() if k in accepted}


def _check_knobs_used(workloads: list[str], knobs: dict[str, Any], per: dict[str, dict[str, Any]]) -> None:
    from experiments.workloads.registry import WorkloadError

    unused = [k for k in knobs if not any(k in per[w] for w in workloads)]
    if unused:
        raise WorkloadError(f"knob(s) {', '.join(unused)} taken by none of the workloads {', '.join(workloads)}")


def _done(path: Path) -> bool:
    """A finished cell: its file exists and holds a result (a torn file is rerun)."""
    try:
        return "config" in json.loads(path.read_text())
    except (OSError, ValueError):
        return False


def _write_cell(cell_dir: Path, cfg: CellConfig, res: dict[str, Any]) -> None:
    path = cell_dir / f"{cfg.key()}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(res) + "\n")
    os.replace(tmp, path)


def run_sweep(args, backends: list[str]) -> int:
    from experiments.cli_compare import _cells as cells_of
    from experiments.cli_compare import _execute as execute
    from experiments.cli_compare import _knobs as knobs_of

    out_dir = Path(args.output_dir)
    cell_dir = out_dir / "cells"
    cell_dir.mkdir(parents=True, exist_ok=True)
    workloads = list(dict.fromkeys(args.workloads or (["mooncake"] if args.trace else [args.workload])))
    knobs = knobs_of(args)
    per = {w: _workload_knobs(w, knobs, args) for w in workloads}
    if getattr(args, "knob", None) or args.trace:
        _check_knobs_used(workloads, knobs, per)
    capacities = args.capacity_tokens or DEFAULT_CAPACITIES
    page_sizes = list(dict.fromkeys(args.page_size))
    started = time.perf_counter()
    plan: list[tuple[str, int, list[CellConfig]]] = []
    for wname in workloads:
        wl = build_workload(
            CellConfig(
                backend=backends[0], workload=wname, capacity_tokens=capacities[0], knobs=per[wname], seed=args.seed
            )
        )
        for page in page_sizes:
            for cap in capacities:
                check_capacity(wl, cap, page)
            plan.append((wname, page, cells_of(args, backends, capacities, page, wname, per[wname])))
    todo = [c for _, _, cells in plan for c in cells if not _done(cell_dir / f"{c.key()}.json")]
    total = sum(len(cells) for _, _, cells in plan)
    print(f"sweep: {total} cells, {total - len(todo)} already done, {len(todo)} to run", file=sys.stderr)
    if args.ray:
        from experiments.ray_runner import run_on_ray

        finished = 0

        def on_result(cfg: CellConfig, res: dict[str, Any]) -> None:
            nonlocal finished
            _write_cell(cell_dir, cfg, res)
            finished += 1
            if not args.no_progress:
                print(
                    f"  {finished}/{len(todo)} cells ({cfg.backend} @ {cfg.capacity_tokens:,} tokens, page {cfg.page_size}, {cfg.workload})",
                    file=sys.stderr,
                )

        run_on_ray(todo, args.ray, on_result, num_cpus=args.jobs if args.jobs > 1 else None)
    else:
        # run in batches so each finished batch is on disk before the next starts
        batch = max(args.jobs, 1)
        for i in range(0, len(todo), batch):
            chunk = todo[i : i + batch]
            try:
                results, _ = execute(chunk, args.jobs, not args.no_progress)
            except Exception:
                names = ", ".join(
                    f"{c.key()} ({c.backend} @ {c.capacity_tokens} tokens, page {c.page_size}, {c.workload})"
                    for c in chunk
                )
                print(f"sweep: failed while running {names}; finished cells are kept, rerun to resume", file=sys.stderr)
                raise
            for cfg, res in zip(chunk, results, strict=True):
                _write_cell(cell_dir, cfg, res)
            print(f"  {min(i + batch, len(todo))}/{len(todo)} cells", file=sys.stderr)
    argv = getattr(args, "argv", None)
    for wname, page, cells in plan:
        wl = build_workload(cells[0])
        cell_results = [json.loads((cell_dir / f"{c.key()}.json").read_text()) for c in cells]
        doc = document(
            argv,
            wl,
            cells,
            cell_results,
            backends,
            capacities,
            None if args.no_bounds else bounds(wl, page, capacities),
        )
        sub = out_dir / f"{wname}-p{page}"
        write(doc, sub)
        print(f"wrote {sub}/report.md")
    print(f"sweep done in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0
