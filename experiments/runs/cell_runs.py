"""The cells of a grid and how they run: in this process, in child processes, resumably.

`cells_for` expands one template `CellConfig` over capacities x backend variants;
`run_cells` runs those not yet in a `CellStore`, saving each as it finishes. `compare` and
`sweep` both use it; nothing here reads a command line.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from experiments.report.results import EncodedRows
from experiments.runs.backend_options import BackendVariant
from experiments.runs.cell_pool import CellPool, Failure, PickledOnce, Task, TasksFailed
from experiments.runs.cell_store import CellStore
from experiments.runs.runner import PER_REQUEST, CellConfig, bounds, build_workload, run_cell
from experiments.workloads.generators import Workload


def cells_for(
    template: CellConfig,
    variants: Sequence[BackendVariant],
    capacities: Sequence[int],
    sizing: Mapping[int, Mapping[str, Any]] | None = None,
) -> list[CellConfig]:
    """One cell per capacity x variant (capacity major), the rest (the page size too) as in `template`;
    `sizing`: per capacity (tokens), the CellConfig fields saying how it was given
    (`capacity_gb` or `gpu_memory_utilization`, experiments/runs/sizing.py; none: in tokens)."""
    return [
        dataclasses.replace(
            template,
            backend=v.name,
            backend_options=v.options_dict(),
            capacity_tokens=cap,
            **(sizing or {}).get(cap, {}),
        )
        for cap in capacities
        for v in variants
    ]


def cell_label(cfg: CellConfig) -> str:
    """A cell as errors and progress lines name it."""
    return f"cell {cfg.label} @ {cfg.capacity_tokens:,} tokens, page {cfg.page_size}, {cfg.workload}"


def bounds_of(
    cfg: CellConfig,
    capacities: list[int],
    cells: Sequence[CellConfig] = (),
    workload: Workload | None = None,
) -> dict[str, Any]:
    """The bounds of `cfg`'s workload (`workload` when the caller built it already) at its
    page size, with the pooled caches of the cluster cells and the tiered bound of the
    tiered cells among `cells` (a picklable task for `run_cells`'s `side`)."""
    return bounds(workload or build_workload(cfg), cfg.page_size, capacities, cells)


def run_cells(
    cells: list[CellConfig],
    jobs: int,
    store: CellStore,
    progress: bool,
    side: Task | None = None,
    workload: Workload | None = None,
) -> tuple[list[dict[str, Any]], Any]:
    """Results of `cells` in input order, and of `side` (the bounds, run beside them).

    `workload`: the workload every cell runs on, built by the caller (`compare`'s cells all
    share one); each cell then takes it instead of re-reading and re-parsing its trace (child
    processes get it pickled once for all of them, `PickledOnce`, and so does `side` where
    its arguments hold it). None: each cell builds its own (a sweep's cells differ in workload).

    Cells already in `store` are reused; each cell that runs is saved there as it finishes.
    `jobs` > 1 runs each cell in its own process (experiments/runs/cell_pool.py); then a cell
    that raises or dies does not stop the others, and `TasksFailed` names it at the end.
    Such a cell saves itself and sends back its per-request rows encoded (`run_and_save`).
    With one job cells run in this process and the first failure stops the run."""
    results: list[dict[str, Any] | None] = [store.load(c) for c in cells]
    todo = [i for i, r in enumerate(results) if r is None]
    if jobs <= 1 or len(todo) <= 1:
        return _run_here(cells, todo, results, store, progress, workload), (side.fn(*side.args) if side else None)
    shared = PickledOnce(workload) if workload is not None else None
    tasks = [Task(cell_label(cells[i]), run_and_save, (cells[i], shared, store)) for i in todo]
    if side is not None:
        args = tuple(shared if workload is not None and a is workload else a for a in side.args)
        tasks.insert(0, dataclasses.replace(side, args=args))  # first: it is the longest
    side_result, done = None, 0
    for t, res in CellPool(jobs).results(tasks):
        if side is not None and t == 0:
            side_result = res
            continue
        i = todo[t - (side is not None)]
        results[i] = res
        done += 1
        _progress(progress, done, len(todo), cells[i], res)
    return results, side_result  # type: ignore[return-value]


def run_and_save(cfg: CellConfig, workload: Workload | None, store: CellStore) -> dict[str, Any]:
    """A cell as a child process runs it: saved in `store` by the child itself, and its
    per-request records replaced by their rows in per_request.jsonl (`EncodedRows`): the
    JSON encoding of both runs beside the other cells instead of in the parent, and the
    records are not pickled to the parent at all."""
    res = run_cell(cfg, workload)
    store.save(cfg, res)
    if PER_REQUEST in res:
        res[PER_REQUEST] = EncodedRows.of(cfg, res[PER_REQUEST])
    return res


def _run_here(
    cells: list[CellConfig],
    todo: list[int],
    results: list[dict[str, Any] | None],
    store: CellStore,
    progress: bool,
    workload: Workload | None = None,
) -> list[dict[str, Any]]:
    for n, i in enumerate(todo, 1):
        try:
            results[i] = run_cell(cells[i], workload, progress=progress)
        except Exception as exc:
            raise TasksFailed([Failure(cell_label(cells[i]), error=exc, trace=traceback.format_exc())]) from exc
        store.save(cells[i], results[i])
        _progress(progress, n, len(todo), cells[i], results[i])
    return results  # type: ignore[return-value]


def _progress(progress: bool, n: int, total: int, cfg: CellConfig, res: dict[str, Any] | None) -> None:
    if progress and res is not None:
        print(f"  [{n}/{total}] {cell_label(cfg)}: {res['wall_seconds']:.1f}s", file=sys.stderr)
