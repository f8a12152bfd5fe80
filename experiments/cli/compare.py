"""`run` (one backend) and `compare` (several, one report).

Outputs are never mixed or half-written (experiments/runs/output_dir.py): the output folder is
checked writable before any work, locked (`OUT.lock`) for the whole run, and the report is
written into a temporary sibling that replaces OUT in one swap at the end, with
per_request.jsonl (every request of every serving cell) beside it. `compare` saves
each finished cell in `OUT.partial/` (experiments/runs/cell_store.py) until the report is in
place, so a run that is interrupted or loses a worker keeps its finished cells and a rerun
of the same command resumes; it never writes a report that lacks cells.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.cli.args import (
    PAGE_SIZE_HELP,
    add_config_option,
    add_run_arguments,
    backend_variants,
    capacities_given,
    cell_template,
    check_calibration,
    check_model,
    cluster_shapes_of,
    knobs,
    positive_int,
    resolved_settings,
)
from experiments.errors import UsageError
from experiments.report.results import REPORT_ENTRIES, document, write, write_per_request
from experiments.runs import defaults
from experiments.runs.backend_options import BackendVariant
from experiments.runs.cell_pool import Task, TasksFailed
from experiments.runs.cell_runs import bounds_of, run_cells
from experiments.runs.cell_store import CellStore
from experiments.runs.cluster_grid import ClusterShape, cells_over, left_out
from experiments.runs.output_dir import OutputLock, StagedDir, check_replaceable, check_writable_dir
from experiments.runs.provenance import provenance
from experiments.runs.run_config import CONFIG_FILE, write_config
from experiments.runs.runner import CellConfig, build_workload, check_capacity, check_model_run, check_timing
from experiments.workloads.generators import Workload


@dataclass(frozen=True)
class Comparison:
    """What one `run` or `compare` does, read from its command line."""

    template: CellConfig
    workload: Workload  # built once, before any work
    variants: list[BackendVariant]
    shapes: list[ClusterShape]
    capacities: list[int]
    sizing: dict[int, dict[str, float]]  # how each capacity was given (experiments/runs/sizing.py)
    out_dir: Path
    jobs: int
    progress: bool
    with_bounds: bool
    argv: list[str] | None
    settings: dict[str, Any]  # every option as it ran: config.toml and results.json's run_config


def add_parsers(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("run", help="one backend on a workload: replay + serving, report")
    add_config_option(run)
    add_run_arguments(run, many_backends=False)
    run.add_argument("--page-size", type=positive_int, default=defaults.PAGE_SIZE, help=PAGE_SIZE_HELP)
    run.set_defaults(func=cmd_run)
    cmp_ = sub.add_parser("compare", help="every backend on the same workload and capacities: one report")
    add_config_option(cmp_)
    add_run_arguments(cmp_, many_backends=True)
    cmp_.add_argument("--page-size", type=positive_int, default=defaults.PAGE_SIZE, help=PAGE_SIZE_HELP)
    cmp_.set_defaults(func=cmd_compare)


def cmd_run(args: argparse.Namespace) -> int:
    if not args.backend:
        raise UsageError("run needs --backend NAME (compare runs every backend)")
    return _compare(args, single=True)


def cmd_compare(args: argparse.Namespace) -> int:
    return _compare(args, single=False)


def _compare(args: argparse.Namespace, single: bool) -> int:
    variants = backend_variants(args, [args.page_size], default_all=not single)
    if single and len(variants) != 1:
        raise UsageError("run takes one --backend; use compare for several")
    check_model(args)
    check_calibration(args.device_calibration)
    workload_name = "mooncake" if args.trace else args.workload
    workload_knobs = knobs(args)
    template = cell_template(args, workload_name, workload_knobs, args.page_size)
    capacities = capacities_given(args)
    # sized before any work, unless a fraction needs the workload's working set
    sized = None if capacities.needs_workload else capacities.cells(args.page_size, args.model, args.device, tp=args.tp)
    shapes = cluster_shapes_of(args, template, variants)
    out_dir = Path(os.path.abspath(args.output_dir))  # "." has no name to put OUT.partial beside
    check_writable_dir(out_dir)  # before any work: an unwritable output fails in a second
    check_replaceable(out_dir, "results.json")
    workload = build_workload(template)  # built once: the cells, bounds and a fraction's working set share it
    if sized is None:
        sized = capacities.cells(args.page_size, args.model, args.device, workload, tp=args.tp)
    caps = [tokens for tokens, _ in sized]
    check_timing(template, caps, force_capacity=args.force_capacity)
    at_once = min(args.jobs, len(variants) * len(caps) * len(shapes)) * max(s.replicas for s in shapes)
    check_model_run(template, workload, caps, at_once)
    plan = Comparison(
        template=template,
        workload=workload,
        variants=variants,
        shapes=shapes,
        capacities=[tokens for tokens, _ in sized],
        sizing=dict(sized),
        out_dir=out_dir,
        jobs=args.jobs,
        progress=not args.no_progress,
        with_bounds=not args.no_bounds,
        argv=args.argv,
        settings=resolved_settings(args, workload_name, workload_knobs, variants),
    )
    with OutputLock(plan.out_dir):
        return _compare_locked(plan)


def _compare_locked(plan: Comparison) -> int:
    page_size = plan.template.page_size
    workload = plan.workload
    for cap in plan.capacities:
        check_capacity(workload, cap, page_size)
    started = time.perf_counter()
    template = dataclasses.replace(plan.template, provenance=provenance(workload.config, plan.template.profile))
    cells = cells_over(template, plan.variants, plan.capacities, plan.shapes, plan.sizing)
    skipped = left_out(plan.shapes, plan.variants)
    if skipped:  # nothing left out silently: say which default pairs cannot run
        print(
            f"compare: left out (the router needs KV events the backend does not publish): {'; '.join(skipped)}",
            file=sys.stderr,
        )
    store = CellStore(plan.out_dir.with_name(plan.out_dir.name + ".partial"))
    reused = sum(store.load(c) is not None for c in cells)
    if reused:
        print(f"compare: {reused} of {len(cells)} cells reused from {store.directory}", file=sys.stderr)
    # the workload built once travels with each task: no cell re-reads the trace
    side = Task("bounds", bounds_of, (cells[0], plan.capacities, cells, workload)) if plan.with_bounds else None
    try:
        results, bound = run_cells(cells, plan.jobs, store, plan.progress, side, workload)
    except TasksFailed as exc:
        kept = sum(store.load(c) is not None for c in cells)
        raise TasksFailed(
            exc.failures,
            note=f"{plan.out_dir} is unchanged; {kept} finished cell(s) of {len(cells)} are kept in "
            f"{store.directory}, and rerunning the same command resumes from them",
        ) from None
    labels = list(dict.fromkeys(c.label for c in cells))
    out = document(plan.argv, workload, cells, results, labels, plan.capacities, bound)
    out["wall_seconds"] = time.perf_counter() - started
    out["run_config"] = plan.settings
    with StagedDir(plan.out_dir, owned=(*REPORT_ENTRIES, CONFIG_FILE)) as stage:
        names = [p.name for p in write(out, stage.path, plan.jobs)]
        names.append(write_config(plan.settings, stage.path).name)
        rows = write_per_request(cells, results, stage.path)
        names += [rows.name] if rows else []
        stage.publish()
    store.discard()
    _summary(out, cells, results)
    print(f"wrote {', '.join(str(plan.out_dir / n) for n in names)} in {out['wall_seconds']:.1f}s")
    return 0


def _summary(out: dict[str, Any], cells: list[CellConfig], results: list[dict[str, Any]]) -> None:
    """One line per capacity: each backend's hit rate, and the bounds."""
    for cap in out["capacities"]:
        row = [(c, r) for c, r in zip(cells, results, strict=True) if c.capacity_tokens == cap]
        bounds = out["bounds"]
        print(
            f"{out['workload']['name']} @ {cap:,} tokens: "
            + ", ".join(f"{c.label} {_hit(r)}" for c, r in row)
            + (
                ""
                if bounds is None
                else f"; Belady {bounds['belady'][str(cap)]['hit_rate']:.1%}, infinite {bounds['infinite']['hit_rate']:.1%}"
            )
        )


def _hit(cell: dict[str, Any]) -> str:
    section = cell.get("replay") or cell.get("serving")
    return f"{section['hit_rate']:.1%}"
