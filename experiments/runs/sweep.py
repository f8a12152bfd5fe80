"""A resumable grid: workloads x page sizes x capacities x cluster shapes x backends.

Each finished cell is written to `OUT/cells/<key>.json` the moment it finishes
(experiments/runs/cell_store.py: atomically, a temporary file renamed into place, so an
interrupted write never looks finished); a rerun skips every cell whose file holds a whole
result, so an interrupted sweep resumes where it stopped, and a torn, empty or error file is
run again. The key hashes the cell's whole configuration and its provenance (the code
version, the content of a trace file), so changing any setting, the code or the trace makes
new cells rather than reusing stale ones.

How this fits "outputs never mixed": OUT itself is not replaced as a whole, since its cells
are the sweep's resumable cache; each cell file is atomic, and each report folder
`OUT/<workload>-p<page>/` is written into a temporary sibling and swapped in whole
(experiments/runs/output_dir.py), so its `results.json`, `report.md`, `results.csv` and
`per_request.jsonl` always come from one run. `OUT.lock` keeps a second sweep out of OUT while one runs.

Cells run in local processes (`--jobs N`) or on Ray (`--ray local|ADDRESS`, see
`experiments/runs/ray_runner.py`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.report.results import REPORT_ENTRIES, document, write, write_per_request
from experiments.runs.backend_options import BackendVariant
from experiments.runs.cell_pool import Failure, TasksFailed
from experiments.runs.cell_runs import run_cells
from experiments.runs.cell_store import CellStore
from experiments.runs.cluster_grid import SINGLE, ClusterShape, cells_over, left_out
from experiments.runs.output_dir import OutputLock, StagedDir, check_writable_dir, write_file_atomically
from experiments.runs.provenance import provenance
from experiments.runs.run_config import CONFIG_FILE, CONFIG_HEADER, dump_toml
from experiments.runs.runner import CellConfig, bounds, build_workload, check_capacity, check_model_run, check_timing
from experiments.runs.sizing import CapacityGiven


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep runs: `template` (every setting but the grid's) over the grid."""

    template: CellConfig
    variants: list[BackendVariant]
    workloads: dict[str, dict[str, Any]]  # workload name -> its knobs
    capacities: CapacityGiven  # per replica, in tokens, GB or vLLM's share of the device (experiments/runs/sizing.py)
    page_sizes: list[int]
    shapes: Sequence[ClusterShape] = SINGLE  # cluster sizes x routers (experiments/runs/cluster_grid.py)
    jobs: int = 1
    ray: str | None = None  # `local` or a cluster address; None: local processes
    progress: bool = True
    with_bounds: bool = True
    argv: list[str] | None = None  # the command line, for the reports (None: sys.argv)
    #: every option as given, for OUT/config.toml and each report's run_config (None: not written)
    settings: dict[str, Any] | None = None
    #: run capacities that do not fit the device beside the weights (`--force-capacity`)
    force_capacity: bool = False


def run_sweep(plan: SweepPlan, out_dir: Path) -> int:
    """Run the cells of `plan` not yet in `out_dir/cells`, then write one report per
    (workload, page size) under `out_dir`."""
    check_writable_dir(out_dir)  # before any work
    with OutputLock(out_dir):
        return _sweep_locked(plan, out_dir)


def _grid(plan: SweepPlan) -> list[tuple[str, int, list[int], list[CellConfig]]]:
    """(workload, page size, its capacities in tokens, its cells) for the whole grid; every
    capacity sized and checked first (in GB or by utilisation, a page size has its own)."""
    grid = []
    t = plan.template
    caps_given = plan.capacities
    # sized before any workload is built, unless a fraction needs each workload's working set
    fixed = (
        {}
        if caps_given.needs_workload
        else {p: caps_given.cells(p, t.model, t.device, tp=t.tp or 1) for p in plan.page_sizes}
    )
    for wname, knobs in plan.workloads.items():
        base = dataclasses.replace(t, workload=wname, knobs=knobs)
        wl = build_workload(base)
        base = dataclasses.replace(base, provenance=provenance(wl.config, base.profile))
        for page in plan.page_sizes:
            at_page = dataclasses.replace(base, page_size=page)
            sized = fixed[page] if fixed else caps_given.cells(page, t.model, t.device, wl, tp=t.tp or 1)
            caps = [tokens for tokens, _ in sized]
            check_timing(at_page, caps, force_capacity=plan.force_capacity)
            at_once = min(plan.jobs, len(plan.variants) * len(caps) * len(plan.shapes))
            check_model_run(at_page, wl, caps, at_once * max(shape.replicas for shape in plan.shapes))
            for cap in caps:
                check_capacity(wl, cap, page)
            cells = cells_over(at_page, plan.variants, caps, plan.shapes, dict(sized))
            grid.append((wname, page, caps, cells))
    return grid


def _sweep_locked(plan: SweepPlan, out_dir: Path) -> int:
    store = CellStore(out_dir / "cells")
    started = time.perf_counter()
    grid = _grid(plan)
    if plan.settings is not None:  # what this sweep runs, before it runs: `--config` repeats or resumes it
        out_dir.mkdir(parents=True, exist_ok=True)
        write_file_atomically(out_dir / CONFIG_FILE, dump_toml(plan.settings, CONFIG_HEADER))
    every = [c for _, _, _, cells in grid for c in cells]
    todo = [c for c in every if store.load(c) is None]
    print(f"sweep: {len(every)} cells, {len(every) - len(todo)} already done, {len(todo)} to run", file=sys.stderr)
    skipped = left_out(plan.shapes, plan.variants)
    if skipped:  # nothing left out silently: say which default pairs cannot run
        print(
            f"sweep: left out (the router needs KV events the backend does not publish): {'; '.join(skipped)}",
            file=sys.stderr,
        )
    try:
        if plan.ray:
            _run_on_ray(todo, store, plan)
        else:
            run_cells(todo, plan.jobs, store, plan.progress)
    except TasksFailed as exc:
        raise TasksFailed(exc.failures, note=f"finished cells are kept in {store.directory}; rerun to resume") from None
    for wname, page, caps, cells in grid:
        labels = list(dict.fromkeys(c.label for c in cells))
        wl = build_workload(cells[0])
        found = bounds(wl, page, caps, cells) if plan.with_bounds else None
        results = [store.load(c) for c in cells]
        doc = document(plan.argv, wl, cells, results, labels, caps, found)
        if plan.settings is not None:
            doc["run_config"] = plan.settings
        sub = out_dir / f"{wname}-p{page}"
        with StagedDir(sub, owned=REPORT_ENTRIES) as stage:
            write(doc, stage.path)
            write_per_request(cells, results, stage.path)
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
                f"  {self.finished}/{self.total} cells ({cfg.label} @ {cfg.capacity_tokens:,} tokens, "
                f"page {cfg.page_size}, {cfg.workload})",
                file=sys.stderr,
            )


def _run_on_ray(todo: list[CellConfig], store: CellStore, plan: SweepPlan) -> None:
    from experiments.runs.ray_runner import CellFailed, run_on_ray  # ray is an optional extra

    try:
        run_on_ray(
            todo,
            plan.ray,
            _RaySaver(store, len(todo), plan.progress),
            num_cpus=plan.jobs if plan.jobs > 1 else None,
        )
    except CellFailed as exc:
        raise TasksFailed([Failure(name, error=RuntimeError(err)) for name, err in exc.failures.items()]) from None
