"""A resumable grid: workloads x page sizes x capacities x backends.

Each finished cell is written to `OUT/cells/<key>.json` the moment it finishes
(experiments/cell_store.py: atomically, a temporary file renamed into place, so an
interrupted write never looks finished); a rerun skips every cell whose file holds a whole
result, so an interrupted sweep resumes where it stopped, and a torn, empty or error file is
run again. The key hashes the cell's whole configuration and its provenance (the code
version, the content of a trace file), so changing any setting, the code or the trace makes
new cells rather than reusing stale ones.

How this fits "outputs never mixed": OUT itself is not replaced as a whole, since its cells
are the sweep's resumable cache; each cell file is atomic, and each report folder
`OUT/<workload>-p<page>/` is written into a temporary sibling and swapped in whole
(experiments/output_dir.py), so its `results.json`, `report.md` and `results.csv` always
come from one run. `OUT.lock` keeps a second sweep out of OUT while one runs.

Cells run in local processes (`--jobs N`) or on Ray (`--ray local|ADDRESS`, see
`experiments/ray_runner.py`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from experiments.cell_pool import TasksFailed
from experiments.cell_store import CellStore
from experiments.output_dir import OutputLock, StagedDir, check_writable_dir
from experiments.provenance import provenance
from experiments.results import REPORT_ENTRIES, document, write
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


def run_sweep(args, backends: list[str]) -> int:
    from experiments.cli_compare import _knobs as knobs_of

    out_dir = Path(os.path.abspath(args.output_dir))
    knobs = knobs_of(args)
    check_writable_dir(out_dir)  # before any work
    with OutputLock(out_dir):
        return _sweep_locked(args, backends, knobs, out_dir)


def _sweep_locked(args, backends: list[str], knobs: dict[str, Any], out_dir: Path) -> int:
    from experiments.cli_compare import _cells as cells_of
    from experiments.cli_compare import execute

    store = CellStore(out_dir / "cells")
    workloads = list(dict.fromkeys(args.workloads or (["mooncake"] if args.trace else [args.workload])))
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
        prov = provenance(wl.config)
        for page in page_sizes:
            for cap in capacities:
                check_capacity(wl, cap, page)
            plan.append((wname, page, cells_of(args, backends, capacities, page, wname, per[wname], prov)))
    every = [c for _, _, cells in plan for c in cells]
    todo = [c for c in every if store.load(c) is None]
    print(f"sweep: {len(every)} cells, {len(every) - len(todo)} already done, {len(todo)} to run", file=sys.stderr)
    try:
        if args.ray:
            _run_on_ray(todo, store, args)
        else:
            execute(todo, args.jobs, store, not args.no_progress)
    except TasksFailed as exc:
        raise TasksFailed(exc.failures, note=f"finished cells are kept in {store.directory}; rerun to resume") from None
    argv = getattr(args, "argv", None)
    for wname, page, cells in plan:
        wl = build_workload(cells[0])
        cell_results = [store.load(c) for c in cells]
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
        with StagedDir(sub, owned=REPORT_ENTRIES) as stage:
            write(doc, stage.path)
            stage.publish()
        print(f"wrote {sub}/report.md")
    print(f"sweep done in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0


class _RaySaver:
    """Saves each cell Ray finishes and reports progress (`run_on_ray`'s `on_result`)."""

    def __init__(self, store: CellStore, total: int, progress: bool) -> None:
        self.store, self.total, self.progress = store, total, progress
        self.finished = 0

    def __call__(self, cfg: CellConfig, res: dict[str, Any]) -> None:
        self.store.save(cfg, res)
        self.finished += 1
        if self.progress:
            print(
                f"  {self.finished}/{self.total} cells ({cfg.backend} @ {cfg.capacity_tokens:,} tokens, page {cfg.page_size}, {cfg.workload})",
                file=sys.stderr,
            )


def _run_on_ray(todo: list[CellConfig], store: CellStore, args) -> None:
    from experiments.cell_pool import Failure
    from experiments.ray_runner import CellFailed, run_on_ray

    try:
        run_on_ray(
            todo,
            args.ray,
            _RaySaver(store, len(todo), not args.no_progress),
            num_cpus=args.jobs if args.jobs > 1 else None,
        )
    except CellFailed as exc:
        raise TasksFailed([Failure(name, error=RuntimeError(err)) for name, err in exc.failures.items()]) from None
