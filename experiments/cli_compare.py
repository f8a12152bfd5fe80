"""The comparison commands: `run` (one backend), `compare` (several, one report), `sweep`
(a resumable grid), `report` (re-render from JSON), `workloads` (what can be generated).

Outputs are never mixed or half-written (experiments/output_dir.py): the output folder is
checked writable before any work, locked (`OUT.lock`) for the whole run, and the report is
written into a temporary sibling that replaces OUT in one swap at the end. `compare` saves
each finished cell in `OUT.partial/` (experiments/cell_store.py) until the report is in
place, so a run that is interrupted or loses a worker keeps its finished cells and a rerun
of the same command resumes; it never writes a report that lacks cells.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from cachelib import available_backends, get_backend
from experiments.cell_pool import CellPool, Failure, Task, TasksFailed
from experiments.cell_store import CellStore
from experiments.output_dir import OutputLock, StagedDir, check_replaceable, check_writable_dir
from experiments.provenance import provenance
from experiments.report import load
from experiments.results import REPORT_ENTRIES, document, write
from experiments.runner import CellConfig, bounds, build_workload, check_capacity, run_cell

DEFAULT_OUTPUT = Path("reports/latest")
#: the README's main job: documents x questions, a working set of about 200k tokens
DEFAULT_WORKLOAD = "shared_doc_qa"
DEFAULT_KNOBS = {"num_documents": 100, "num_requests": 1000, "rate": 20.0}
DEFAULT_CAPACITIES = [25_000, 50_000, 100_000, 200_000]


class UsageError(Exception):
    """A missing or malformed option: one line for the user, exit code 2 (as argparse)."""


def _list(text: str) -> list[str]:
    return [t for t in text.replace(",", " ").split() if t]


def _knobs(args: argparse.Namespace) -> dict[str, Any]:
    knobs: dict[str, Any] = {} if args.knob or args.workload != DEFAULT_WORKLOAD or args.trace else dict(DEFAULT_KNOBS)
    for item in args.knob or []:
        if "=" not in item:
            raise UsageError(f"--knob expects NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        knobs[k.strip()] = v.strip()
    if args.trace:
        if not Path(args.trace).is_file():
            raise FileNotFoundError(f"trace file not found: {args.trace}")
        knobs["path"] = str(args.trace)
    return knobs


def _backends(args: argparse.Namespace, default_all: bool) -> list[str]:
    names = [n for item in (args.backend or []) for n in _list(item)]
    if not names:
        names = available_backends() if default_all else []
    if not names:
        raise UsageError("name a backend with --backend")
    for n in names:
        get_backend(n)  # an unknown name fails here, before any work
    return names


def _check_model(name: str) -> None:
    """An unknown --model fails before any work, not as a bare KeyError inside a cell."""
    if name == "llama3-8b":  # the default: no need to import torch to know it
        return
    from attention.model import PRESETS

    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(PRESETS)}")


def _backend_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"eviction_policy": args.eviction_policy} if args.eviction_policy else {}


def _cells(args, backends, capacities, page_size, workload_name, knobs, prov: dict[str, str]) -> list[CellConfig]:
    cells = []
    for cap in capacities:
        for b in backends:
            opts = _backend_options(args) if "eviction_policy" in get_backend(b).__init__.__code__.co_varnames else {}
            cells.append(
                CellConfig(
                    backend=b,
                    workload=workload_name,
                    capacity_tokens=cap,
                    page_size=page_size,
                    knobs=knobs,
                    seed=args.seed,
                    protocol=args.protocol,
                    executor=args.executor,
                    device=args.device,
                    model=args.model,
                    attention=args.attention,
                    device_calibration=args.device_calibration,
                    token_budget=args.token_budget,
                    max_running=args.max_running,
                    ordering=args.ordering,
                    backend_options=opts,
                    provenance=prov,
                )
            )
    return cells


def label(cfg: CellConfig) -> str:
    """A cell as errors and progress lines name it."""
    return f"cell {cfg.backend} @ {cfg.capacity_tokens:,} tokens, page {cfg.page_size}, {cfg.workload}"


def execute(
    cells: list[CellConfig], jobs: int, store: CellStore, progress: bool, side: Task | None = None
) -> tuple[list[dict[str, Any]], Any]:
    """Results of `cells` in input order, and of `side` (the bounds, run beside them).

    Cells already in `store` are reused; each cell that runs is saved there as it finishes.
    `jobs` > 1 runs each cell in its own process (experiments/cell_pool.py); then a cell
    that raises or dies does not stop the others, and `TasksFailed` names it at the end.
    With one job cells run in this process and the first failure stops the run."""
    results: list[dict[str, Any] | None] = [store.load(c) for c in cells]
    todo = [i for i, r in enumerate(results) if r is None]
    side_result = None
    if jobs <= 1 or len(todo) <= 1:
        for n, i in enumerate(todo, 1):
            try:
                results[i] = run_cell(cells[i], progress=progress)
            except Exception as exc:
                raise TasksFailed([Failure(label(cells[i]), error=exc)]) from exc
            store.save(cells[i], results[i])
            if progress:
                print(f"  [{n}/{len(todo)}] {label(cells[i])}: {results[i]['wall_seconds']:.1f}s", file=sys.stderr)
        if side is not None:
            side_result = side.fn(*side.args)
        return results, side_result  # type: ignore[return-value]
    tasks = [Task(label(cells[i]), run_cell, (cells[i],)) for i in todo]
    if side is not None:
        tasks.insert(0, side)  # first: it is the longest
    done = 0
    for t, res in CellPool(jobs).results(tasks):
        if side is not None and t == 0:
            side_result = res
            continue
        i = todo[t - (side is not None)]
        results[i] = res
        store.save(cells[i], res)
        done += 1
        if progress:
            print(f"  [{done}/{len(todo)}] {label(cells[i])}: {res['wall_seconds']:.1f}s", file=sys.stderr)
    return results, side_result  # type: ignore[return-value]


def _bounds_of(cfg: CellConfig, page_size: int, capacities: list[int]) -> dict[str, Any]:
    return bounds(build_workload(cfg), page_size, capacities)


def cmd_compare(args: argparse.Namespace, *, single: bool = False) -> int:
    if single and not args.backend:
        raise UsageError("run needs --backend NAME (compare runs every backend)")
    backends = _backends(args, default_all=not single)
    if single and len(backends) != 1:
        raise UsageError("run takes one --backend; use compare for several")
    _check_model(args.model)
    workload_name = "mooncake" if args.trace else args.workload
    knobs = _knobs(args)
    out_dir = Path(os.path.abspath(args.output_dir))  # "." has no name to put OUT.partial beside
    check_writable_dir(out_dir)  # before any work: an unwritable output fails in a second
    check_replaceable(out_dir, "results.json")
    with OutputLock(out_dir):
        return _compare_locked(args, backends, workload_name, knobs, out_dir)


def _compare_locked(
    args: argparse.Namespace, backends: list[str], workload_name: str, knobs: dict[str, Any], out_dir: Path
) -> int:
    capacities = args.capacity_tokens or DEFAULT_CAPACITIES
    page_size = args.page_size
    workload = build_workload(
        CellConfig(
            backend=backends[0], workload=workload_name, capacity_tokens=capacities[0], knobs=knobs, seed=args.seed
        )
    )
    for cap in capacities:
        check_capacity(workload, cap, page_size)
    started = time.perf_counter()
    cells = _cells(args, backends, capacities, page_size, workload_name, knobs, provenance(workload.config))
    store = CellStore(out_dir.with_name(out_dir.name + ".partial"))
    reused = sum(store.load(c) is not None for c in cells)
    if reused:
        print(f"compare: {reused} of {len(cells)} cells reused from {store.directory}", file=sys.stderr)
    side = None if args.no_bounds else Task("bounds", _bounds_of, (cells[0], page_size, capacities))
    try:
        results, bound = execute(cells, args.jobs, store, not args.no_progress, side)
    except TasksFailed as exc:
        kept = sum(store.load(c) is not None for c in cells)
        raise TasksFailed(
            exc.failures,
            note=f"{out_dir} is unchanged; {kept} finished cell(s) of {len(cells)} are kept in {store.directory}, "
            "and rerunning the same command resumes from them",
        ) from None
    out = document(args.argv, workload, cells, results, backends, capacities, bound)
    out["wall_seconds"] = time.perf_counter() - started
    with StagedDir(out_dir, owned=REPORT_ENTRIES) as stage:
        names = [p.name for p in write(out, stage.path)]
        stage.publish()
    store.discard()
    for cap in capacities:
        row = [c for c in results if c["config"]["capacity_tokens"] == cap]
        print(
            f"{workload.name} @ {cap:,} tokens: "
            + ", ".join(f"{c['config']['backend']} {_hit(c)}" for c in row)
            + (
                ""
                if out["bounds"] is None
                else f"; Belady {out['bounds']['belady'][str(cap)]['hit_rate']:.1%}, infinite {out['bounds']['infinite']['hit_rate']:.1%}"
            )
        )
    print(f"wrote {', '.join(str(out_dir / n) for n in names)} in {out['wall_seconds']:.1f}s")
    return 0


def _hit(cell: dict[str, Any]) -> str:
    section = cell.get("replay") or cell.get("serving")
    return f"{section['hit_rate']:.1%}"


def cmd_report(args: argparse.Namespace) -> int:
    results = load(args.results)
    out_dir = (
        Path(args.output_dir)
        if args.output_dir
        else (Path(args.results) if Path(args.results).is_dir() else Path(args.results).parent)
    )
    check_writable_dir(out_dir)
    check_replaceable(out_dir, "results.json")
    # rendered in place or elsewhere, the folder is swapped in whole like compare's, and
    # holds the results it was drawn from
    with OutputLock(out_dir), StagedDir(out_dir, owned=REPORT_ENTRIES) as stage:
        names = [p.name for p in write(results, stage.path)]
        stage.publish()
    print("wrote " + ", ".join(str(out_dir / n) for n in names))
    return 0


def cmd_workloads(args: argparse.Namespace) -> int:
    from experiments.workloads.registry import describe_workloads

    for name, info in describe_workloads().items():
        print(f"{name}: {info['summary']}")
        for knob, default in info["knobs"].items():
            print(f"    {knob} = {default!r}  {info['help'].get(knob, '')}")
    return 0


def add_comparison_commands(sub, positive_int) -> None:
    def common(p: argparse.ArgumentParser, many_backends: bool) -> None:
        p.add_argument(
            "--backend",
            action="append",
            help="backend name(s); repeat or comma-separate" + (" (default: all)" if many_backends else ""),
        )
        p.add_argument("--workload", default=DEFAULT_WORKLOAD, help="workload name (see `workloads`)")
        p.add_argument("--knob", action="append", metavar="NAME=VALUE", help="workload knob (repeatable)")
        p.add_argument("--trace", help="a Mooncake JSONL trace (shortcut for --workload mooncake --knob path=...)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--capacity-tokens", type=positive_int, nargs="+", help="KV capacities in tokens")
        p.add_argument("--protocol", default="both", choices=["replay", "serving", "both"])
        p.add_argument(
            "--executor", default="cost", choices=["cost", "model"], help="cost model (virtual time) or the real model"
        )
        p.add_argument("--device", default="h200", help="cost-model device profile: h200 | h100 | cpu")
        p.add_argument(
            "--model", default="llama3-8b", help="model shape: llama3-8b | tiny (model executor: tiny on CPU)"
        )
        p.add_argument(
            "--attention",
            default="auto",
            choices=["auto", "torch", "flashinfer"],
            help="model executor's kernel (auto: flashinfer when CUDA and flashinfer are present)",
        )
        p.add_argument(
            "--device-calibration",
            metavar="JSON",
            help="calibrate the cost model from a GPU benchmark JSON (reports/gpu/...)",
        )
        p.add_argument("--token-budget", type=positive_int, default=8192)
        p.add_argument("--max-running", type=positive_int, default=256)
        p.add_argument("--ordering", default="fcfs", choices=["fcfs", "lpf"])
        p.add_argument("--eviction-policy", help="radix: lru | lfu | fifo | mru | filo")
        p.add_argument("--jobs", type=positive_int, default=1, help="cells run in this many local processes")
        p.add_argument("--output-dir", default=str(DEFAULT_OUTPUT))
        p.add_argument("--no-bounds", action="store_true", help="skip the infinite and Belady bounds")
        p.add_argument("--no-progress", action="store_true")
        p.set_defaults(argv=None)

    run = sub.add_parser("run", help="one backend on a workload: replay + serving, report")
    common(run, False)
    run.add_argument("--page-size", type=positive_int, default=16)
    run.set_defaults(func=lambda a: cmd_compare(a, single=True))

    cmp_ = sub.add_parser("compare", help="every backend on the same workload and capacities: one report")
    common(cmp_, True)
    cmp_.add_argument("--page-size", type=positive_int, default=16)
    cmp_.set_defaults(func=cmd_compare)

    sw = sub.add_parser("sweep", help="a resumable grid over capacities x page sizes x workloads")
    common(sw, True)
    sw.add_argument("--page-size", type=positive_int, nargs="+", default=[16])
    sw.add_argument("--workloads", nargs="+", help="several workload names (default: --workload)")
    sw.add_argument("--ray", metavar="ADDRESS", help="run cells on a Ray cluster (needs the ray extra)")
    sw.set_defaults(func=cmd_sweep)

    rep = sub.add_parser("report", help="re-render Markdown, plots and CSV from a results JSON")
    rep.add_argument("results", help="results.json or the folder holding it")
    rep.add_argument("--output-dir")
    rep.set_defaults(func=cmd_report)

    wl = sub.add_parser("workloads", help="list the workloads and their knobs")
    wl.set_defaults(func=cmd_workloads)


def cmd_sweep(args: argparse.Namespace) -> int:
    from experiments.sweep import run_sweep

    backends = _backends(args, default_all=True)
    _check_model(args.model)
    return run_sweep(args, backends)
