"""The comparison commands: `run` (one backend), `compare` (several, one report), `sweep`
(a resumable grid), `report` (re-render from JSON), `workloads` (what can be generated)."""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from cachelib import available_backends, get_backend
from experiments.report import load, render
from experiments.results import document, write
from experiments.runner import CellConfig, bounds, build_workload, check_capacity, run_cell

DEFAULT_OUTPUT = Path("reports/latest")
#: the README's main job: documents x questions, a working set of about 200k tokens
DEFAULT_WORKLOAD = "shared_doc_qa"
DEFAULT_KNOBS = {"num_documents": 100, "num_requests": 1000, "rate": 20.0}
DEFAULT_CAPACITIES = [25_000, 50_000, 100_000, 200_000]


def _list(text: str) -> list[str]:
    return [t for t in text.replace(",", " ").split() if t]


def _knobs(args: argparse.Namespace) -> dict[str, Any]:
    knobs: dict[str, Any] = {} if args.knob or args.workload != DEFAULT_WORKLOAD or args.trace else dict(DEFAULT_KNOBS)
    for item in args.knob or []:
        if "=" not in item:
            raise ValueError(f"--knob expects NAME=VALUE, got {item!r}")
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
        raise ValueError("name a backend with --backend")
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


def _cells(args, backends, capacities, page_size, workload_name, knobs) -> list[CellConfig]:
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
                )
            )
    return cells


def _run_one(cfg: CellConfig) -> dict[str, Any]:
    return run_cell(cfg)


def _execute(cells: list[CellConfig], jobs: int, progress: bool, ray_address: str | None = None, side=None):
    """Run cells locally (in `jobs` processes) or on a Ray cluster; results in input order.

    `side`, a picklable `(fn, args)`, runs beside the cells (the bounds) and its result is
    returned second."""
    if ray_address:
        from experiments.ray_runner import run_on_ray

        return run_on_ray(cells, ray_address), (side[0](*side[1]) if side else None)
    if jobs <= 1 or len(cells) <= 1:
        out = []
        for i, cfg in enumerate(cells, 1):
            out.append(run_cell(cfg, progress=progress))
            if progress:
                print(
                    f"  [{i}/{len(cells)}] {cfg.backend} @ {cfg.capacity_tokens:,} tokens: {out[-1]['wall_seconds']:.1f}s",
                    file=sys.stderr,
                )
        return out, (side[0](*side[1]) if side else None)
    results: list[dict[str, Any] | None] = [None] * len(cells)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(cells), desc="cells", unit="cell")
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        side_future = pool.submit(side[0], *side[1]) if side else None  # first: it is the longest
        futures = {pool.submit(_run_one, cfg): i for i, cfg in enumerate(cells)}
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            if bar is not None:
                bar.update(1)
        side_result = side_future.result() if side_future else None
    if bar is not None:
        bar.close()
    return results, side_result


def _bounds_of(cfg: CellConfig, page_size: int, capacities: list[int]) -> dict[str, Any]:
    return bounds(build_workload(cfg), page_size, capacities)


def cmd_compare(args: argparse.Namespace, *, single: bool = False) -> int:
    backends = _backends(args, default_all=not single)
    _check_model(args.model)
    if single and len(backends) != 1:
        raise ValueError("run takes one --backend; use compare for several")
    workload_name = "mooncake" if args.trace else args.workload
    knobs = _knobs(args)
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
    cells = _cells(args, backends, capacities, page_size, workload_name, knobs)
    side = None if args.no_bounds else (_bounds_of, (cells[0], page_size, capacities))
    results, bound = _execute(cells, args.jobs, not args.no_progress, side=side)
    out = document(args.argv, workload, cells, results, backends, capacities, bound)
    out["wall_seconds"] = time.perf_counter() - started
    out_dir = Path(args.output_dir)
    paths = write(out, out_dir)
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
    print(f"wrote {', '.join(str(p) for p in paths)} in {out['wall_seconds']:.1f}s")
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
    paths = render(results, out_dir)
    print("wrote " + ", ".join(str(p) for p in paths))
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
