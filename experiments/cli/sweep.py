"""`sweep`: a resumable grid over workloads x page sizes x capacities x backends
(experiments/runs/sweep.py runs it)."""

from __future__ import annotations

import argparse
import os
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
    command_knobs,
    knobs_given,
    positive_int,
    resolved_settings,
)
from experiments.errors import InputError
from experiments.runs import defaults
from experiments.runs.backend_options import BackendVariant
from experiments.runs.sweep import SweepPlan, run_sweep
from experiments.workloads.registry import WORKLOADS, knobs_of


def add_parser(sub: argparse._SubParsersAction) -> None:
    sw = sub.add_parser("sweep", help="a resumable grid over capacities x page sizes x workloads")
    add_config_option(sw)
    add_run_arguments(sw, many_backends=True)
    sw.add_argument(
        "--page-size",
        type=positive_int,
        nargs="+",
        default=[defaults.PAGE_SIZE],
        help=PAGE_SIZE_HELP + "; several: a grid",
    )
    sw.add_argument("--workloads", nargs="+", help="several workload names (default: --workload)")
    sw.add_argument("--ray", metavar="ADDRESS", help="run cells on a Ray cluster (needs the ray extra)")
    sw.set_defaults(func=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    page_sizes = list(dict.fromkeys(args.page_size))
    variants = backend_variants(args, page_sizes, default_all=True)
    check_model(args)
    check_calibration(args.device_calibration)
    given = knobs_given(args)
    names = list(dict.fromkeys(args.workloads or (["mooncake"] if args.trace else [args.workload])))
    template = cell_template(args, names[0], {}, page_sizes[0])
    plan = SweepPlan(
        template=template,
        variants=variants,
        shapes=cluster_shapes_of(args, template, variants),
        workloads=_knobs_per_workload(args, names, given),
        capacities=capacities_given(args),
        page_sizes=page_sizes,
        jobs=args.jobs,
        ray=args.ray,
        progress=not args.no_progress,
        with_bounds=not args.no_bounds,
        argv=args.argv,
        settings=_settings(args, names, given, variants),
        force_capacity=args.force_capacity,
    )
    return run_sweep(plan, Path(os.path.abspath(args.output_dir)))


def _settings(
    args: argparse.Namespace, names: list[str], given: dict[str, Any], variants: list[BackendVariant]
) -> dict[str, Any]:
    """The sweep's options for OUT/config.toml: its workloads and the knobs given (each
    workload adds the commands' defaults for it, as a rerun of the same file does)."""
    settings = resolved_settings(args, names[0], {}, variants)
    settings.update(workload=names[0], workloads=names, knobs=given)
    return settings


def _knobs_per_workload(args: argparse.Namespace, names: list[str], given: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The knobs of each workload of the grid: the commands' defaults for it
    (experiments/runs/defaults.py `COMMAND_KNOBS`), each given knob replacing one.

    Given knobs go to every workload of the grid that takes them, and one that none takes
    is an error."""
    per = {w: {**command_knobs(w), **_knobs_taken(w, given, len(names) == 1)} for w in names}
    unused = [k for k in given if not any(k in _knobs_taken(w, given, len(names) == 1) for w in names)]
    if unused:
        raise InputError(f"knob(s) {', '.join(unused)} taken by none of the workloads {', '.join(names)}")
    return per


def _knobs_taken(name: str, given: dict[str, Any], alone: bool) -> dict[str, Any]:
    """The knobs of `given` that workload `name` takes; all of them when it is the only one
    or unknown (building it then names the knob it does not take, or the unknown name)."""
    if alone or name not in WORKLOADS:
        return given
    accepted = knobs_of(name)
    return {k: v for k, v in given.items() if k in accepted}
