"""Arguments the commands share: sizes, backends and their options, workloads and knobs.

Every default comes from experiments/runs/defaults.py; every backend option goes through
experiments/runs/backend_options.py (`--backend-opt`, its aliases, `NAME[KEY=VALUE,...]`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from attention.config import PRESETS
from cachelib import default_backends
from experiments.engine.executors import DEVICE_PROFILES, device_profile
from experiments.engine.request import SCHEDULERS
from experiments.engine.routers.registry import ROUTERS
from experiments.errors import InputError, UsageError
from experiments.runs import defaults
from experiments.runs.backend_options import (
    BackendVariant,
    OptionGiven,
    parse_backend_opt,
    resolve_variants,
    split_backend_list,
)
from experiments.runs.cluster_grid import ClusterShape, check_shapes, cluster_shapes
from experiments.runs.runner import EXECUTORS, CellConfig
from experiments.runs.sizing import CapacityGiven
from experiments.timing.zoo import MODELS, ZooError, resolve_model
from experiments.workloads.registry import REQUIRED, coerce_knob, knobs_of

PAGE_SIZE_HELP = "tokens per KV page (vLLM's block size, SGLang's page size)"
#: named flags that are aliases of `--backend-opt KEY=VALUE` (every selected backend)
OPTION_ALIASES = {
    "--eviction-policy": ("eviction_policy", "radix: lru | lfu | fifo | mru | filo"),
    "--hash-algorithm": (
        "hash_algorithm",
        "apc: auto (default: poly128 up to page 8, else xxh3_128) | poly128 | xxh3_128 | sha256",
    ),
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive and finite, got {text}")
    return value


def device_name(text: str) -> str:
    """A device as the zoo names it, from any spelling it accepts (`A100-80GB`: `a100`); an
    unknown name is bad input (exit 3), listing the known ones."""
    try:
        return device_profile(text).name
    except ZooError as exc:
        raise InputError(str(exc)) from None


def model_name(text: str) -> str:
    """A model as the zoo names it (a Hugging Face id is an alias), or a preset (`tiny`)."""
    if text in PRESETS:
        return text
    try:
        return resolve_model(text).name
    except ZooError:
        raise InputError(
            f"unknown model {text!r}; choose one of: {', '.join(sorted({*MODELS, *PRESETS}))} (or a zoo model's Hugging Face id)"
        ) from None


def fraction(text: str) -> float:
    """A share in (0, 1], as vLLM's --gpu-memory-utilization takes it."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be at most 1 (a share), got {text}")
    return value


def rate(text: str) -> float:
    """A positive number of requests/s, or `inf` (all at once)."""
    if text.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    return positive_float(text)


def add_config_option(p: argparse.ArgumentParser) -> None:
    """`--config FILE` (experiments/runs/run_config.py): the options of a TOML file, flags given beside it winning."""
    p.add_argument(
        "--config",
        metavar="TOML",
        help="read options from a TOML file (keys: option names with _, a [knobs] table); flags given here win. "
        "Every run writes the config it resolved to OUT/config.toml",
    )


def resolved_settings(
    args: argparse.Namespace, workload: str, knobs: dict[str, Any], variants: list[BackendVariant]
) -> dict[str, Any]:
    """Every option of the run as it ran, for `config.toml` (experiments/runs/run_config.py): the
    workload and all its knobs (the commands' defaults included), the backends with their
    options folded into their labels, the capacities given (the default ones written out),
    every other option at its value. `--config` with it repeats the run."""
    out: dict[str, Any] = {"command": args.command}
    skip = {"help", "func", "command", "argv", "config"}
    out.update({k: v for k, v in vars(args).items() if k not in skip})
    accepted = knobs_of(workload)  # typed, so the file reads `rate = 20.0`, not `rate = "20.0"`
    typed = {k: coerce_knob(workload, k, v, accepted.get(k, REQUIRED)) for k, v in knobs.items()}
    out.update(workload=workload, trace=None, knob=None, knobs=typed)
    out.update(backend=[v.label for v in variants], backend_opt=[], verify_tokens=False)
    out.update({key: None for key, _ in OPTION_ALIASES.values()})
    if "capacity_tokens" in out and not any(
        out.get(k) for k in ("capacity_tokens", "capacity_gb", "gpu_memory_utilization", "capacity_fraction")
    ):
        out["capacity_tokens"] = list(defaults.CAPACITIES)
    return {k: v for k, v in out.items() if v is not None}  # TOML has no null: an unset option is left out


def add_backend_options(p: argparse.ArgumentParser) -> None:
    """`--backend-opt` and its named aliases."""
    p.add_argument(
        "--backend-opt",
        action="append",
        default=[],
        metavar="[BACKEND.]KEY=VALUE",
        help="a backend constructor option (repeatable); unqualified, every selected backend must take it",
    )
    for flag, (_, text) in OPTION_ALIASES.items():
        p.add_argument(flag, help=f"{text} (alias of --backend-opt {OPTION_ALIASES[flag][0]}=...)")
    p.add_argument("--verify-tokens", action="store_true", help="apc: compare tokens on a hit")


def options_given(args: argparse.Namespace) -> list[OptionGiven]:
    """The backend options of the command line, aliases first."""
    given = [
        OptionGiven(key, vars(args)[key], flag)
        for flag, (key, _) in OPTION_ALIASES.items()
        if vars(args)[key] is not None
    ]
    if args.verify_tokens:
        given.append(OptionGiven("verify_tokens", True, "--verify-tokens"))
    return given + [parse_backend_opt(item) for item in args.backend_opt]


def backend_variants(args: argparse.Namespace, page_sizes: list[int], default_all: bool) -> list[BackendVariant]:
    """The `--backend` list (default: every backend compared by default) with its options, checked."""
    specs = [s for item in (args.backend or []) for s in split_backend_list(item)]
    if not specs and default_all:
        specs = default_backends()
    if not specs:
        raise UsageError("name a backend with --backend")
    return resolve_variants(specs, options_given(args), page_sizes)


def add_run_arguments(p: argparse.ArgumentParser, many_backends: bool) -> None:
    """The options of `run`, `compare` and `sweep` (all but `--page-size`)."""
    p.add_argument(
        "--backend",
        action="append",
        help="backend name(s) or variants NAME[KEY=VALUE,...]; repeat or comma-separate"
        + (" (default: all but tiered designs, which must be named)" if many_backends else ""),
    )
    p.add_argument("--workload", default=defaults.WORKLOAD, help="workload name (`workloads` lists them)")
    p.add_argument(
        "--knob",
        action="append",
        metavar="NAME=VALUE",
        help="set one workload knob, the others keep the defaults `workloads` prints (repeatable)",
    )
    p.add_argument(
        "--trace", help="a Mooncake JSONL trace, .jsonl or .jsonl.gz (shortcut for --workload mooncake --knob path=...)"
    )
    p.add_argument("--seed", type=int, default=defaults.SEED, help="seeds the workload generator and every random draw")
    add_capacity_options(p)
    add_execution_options(p)
    add_backend_options(p)
    add_cluster_options(p)
    add_timing_options(p)
    p.add_argument("--jobs", type=positive_int, default=defaults.JOBS, help="cells run in this many local processes")
    p.add_argument(
        "--output-dir",
        default=str(defaults.OUTPUT_DIR),
        help="the report's folder, replaced whole when the run ends (results.json, report.md, config.toml, ...)",
    )
    p.add_argument("--no-bounds", action="store_true", help="skip the infinite and Belady bounds")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output (the bars are already quiet when stderr is not a terminal)",
    )


def add_execution_options(p: argparse.ArgumentParser) -> None:
    """How a cell runs: the protocol, what times its steps (`add_step_timing_options`), the
    serving policy and its budget."""
    p.add_argument(
        "--protocol",
        default=defaults.PROTOCOL,
        choices=["replay", "serving", "both"],
        help="replay = requests in trace order, one at a time (the bounds' protocol); serving = continuous "
        "batching on a virtual clock; both",
    )
    add_step_timing_options(p)
    p.add_argument(
        "--token-budget",
        type=positive_int,
        default=defaults.TOKEN_BUDGET,
        help="serving: tokens scheduled per step at most (vLLM's max_num_batched_tokens)",
    )
    p.add_argument(
        "--max-running",
        type=positive_int,
        default=defaults.MAX_RUNNING,
        help="serving: requests running at once at most (vLLM's max_num_seqs)",
    )
    p.add_argument(
        "--scheduler",
        default=defaults.SCHEDULER,
        choices=SCHEDULERS,
        help="serving's scheduling policy: vllm = vLLM 0.33 V1 scheduler's decisions (the default)",
    )
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vLLM's async scheduling: two batches in flight, admissions slip a step",
    )


def add_step_timing_options(p: argparse.ArgumentParser) -> None:
    """What times a serving step: the executor, its model and device, tensor parallelism,
    a profile table, the capacity check against the device's memory (docs/timing.md)."""
    p.add_argument(
        "--executor",
        default=defaults.EXECUTOR,
        choices=EXECUTORS,
        help="serving's step times: cost = roofline cost model, profile = measured operator times "
        "(--profile FILE, or the table shipped for --model and --device), model = the real model (measured), "
        "fixed = a constant --step-ms per non-empty step",
    )
    p.add_argument(
        "--profile",
        metavar="CSV",
        help="--executor profile: a measured step profile (the format: docs/timing.md); default: the shipped one",
    )
    p.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="GPUs per replica in one tensor-parallel group (cost and profile executors): the work and the KV "
        "split over them, two all-reduces per layer added; its heads must divide",
    )
    p.add_argument(
        "--force-capacity",
        action="store_true",
        help="run a KV capacity that does not fit the device's memory beside the model's weights (refused otherwise)",
    )
    p.add_argument(
        "--step-ms",
        type=positive_float,
        metavar="MS",
        help="--executor fixed: milliseconds per non-empty step (required with it, refused with another executor)",
    )
    p.add_argument(
        "--device",
        default=defaults.DEVICE,
        help=f"the GPU the steps are timed on: {', '.join(DEVICE_PROFILES)} (aliases such as a100-80gb, nvidia-h100)",
    )
    p.add_argument(
        "--model",
        default=defaults.MODEL,
        help=f"the model: {', '.join(MODELS)} (or its Hugging Face id), or tiny (the model executor's CPU model)",
    )
    p.add_argument(
        "--attention",
        default=defaults.ATTENTION,
        choices=["auto", "torch", "flashinfer"],
        help="model executor's kernel (auto: flashinfer when CUDA and flashinfer are present)",
    )
    p.add_argument("--device-calibration", metavar="JSON", help="calibrate the cost model from a GPU benchmark JSON")


def add_capacity_options(p: argparse.ArgumentParser) -> None:
    """The KV capacity per replica, given one way (experiments/runs/sizing.py)."""
    p.add_argument(
        "--capacity-tokens",
        type=positive_int,
        nargs="+",
        help="KV capacities in tokens (default, when no other way is given: "
        + " ".join(str(c) for c in defaults.CAPACITIES)
        + ")",
    )
    p.add_argument(
        "--capacity-gb",
        type=positive_float,
        nargs="+",
        metavar="GB",
        help="KV capacities in GB (10**9 bytes) of KV per replica, in whole pages of the --model's KV",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        nargs="+",
        metavar="U",
        help="KV capacity as vLLM sizes it: U x the --device's memory minus the --model's weights, in whole "
        "pages (vLLM's default U is 0.9; activations and CUDA graphs are not subtracted)",
    )
    p.add_argument(
        "--capacity-fraction",
        type=fraction,
        nargs="+",
        metavar="F",
        help="KV capacities as a share F of the workload's working set (its distinct pages at the page size), "
        "as libCacheSim sizes caches: floor(F x pages) whole pages, resolved before any work",
    )


def add_timing_options(p: argparse.ArgumentParser) -> None:
    """Serving's arrivals re-timed (experiments/runs/retiming.py) and goodput's SLOs."""
    p.add_argument(
        "--time-scale",
        type=positive_float,
        metavar="X",
        help="multiply every arrival and think time by X (2: the trace at half speed)",
    )
    p.add_argument(
        "--request-rate",
        type=rate,
        metavar="R",
        help="new arrival times: a Poisson process at R requests/s seeded by --seed, as vllm bench serve "
        "(inf: all at time 0); not with --time-scale",
    )
    p.add_argument("--slo-ttft-ms", type=positive_float, metavar="MS", help="goodput's TTFT objective (ms)")
    p.add_argument("--slo-tpot-ms", type=positive_float, metavar="MS", help="goodput's TPOT objective (ms)")


def capacities_given(args: argparse.Namespace) -> CapacityGiven:
    """How the command line gives the KV capacity per replica (default: the default tokens);
    two ways at once is an `InputError` before any work."""
    return CapacityGiven.of(
        args.capacity_tokens,
        args.capacity_gb,
        args.gpu_memory_utilization,
        default=defaults.CAPACITIES,
        fraction=args.capacity_fraction,
    )


def add_cluster_options(p: argparse.ArgumentParser) -> None:
    """`--replicas`, `--router` and `--router-opt` (experiments/runs/cluster_grid.py)."""
    p.add_argument(
        "--replicas",
        type=positive_int,
        nargs="+",
        default=[defaults.REPLICAS],
        metavar="N",
        help="serving replicas behind a router, each with its own cache of --capacity-tokens (several: one cell "
        "each; default 1, single-replica serving)",
    )
    p.add_argument(
        "--router",
        action="append",
        default=[],
        help="router(s) of a cluster (--replicas N > 1), NAME or NAME[KEY=VALUE,...]; repeat or comma-separate "
        f"(default: all: {', '.join(ROUTERS)})",
    )
    p.add_argument(
        "--router-opt",
        action="append",
        default=[],
        metavar="[ROUTER.]KEY=VALUE",
        help="a router constructor option (repeatable); unqualified, every selected router must take it",
    )


def cluster_shapes_of(
    args: argparse.Namespace, template: CellConfig, variants: list[BackendVariant]
) -> list[ClusterShape]:
    """The cluster shapes of the command line, checked with the template's settings and
    the backends they pair with."""
    shapes = cluster_shapes(args.replicas, args.router, args.router_opt)
    check_shapes(template, shapes, variants)
    return shapes


def knobs_given(args: argparse.Namespace) -> dict[str, Any]:
    """The `--knob` values as given (the workload types them), and `--trace` as `path`."""
    out: dict[str, Any] = {}
    for item in args.knob or []:
        if "=" not in item:
            raise UsageError(f"--knob expects NAME=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    if args.trace:
        if not Path(args.trace).is_file():
            raise InputError(f"trace file not found: {args.trace}")
        out["path"] = str(args.trace)
    return out


def command_knobs(workload: str) -> dict[str, Any]:
    """The knobs the commands set for `workload` over its generator's defaults (a copy)."""
    return dict(defaults.COMMAND_KNOBS.get(workload, {}))


def knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The workload's knobs: the commands' defaults for it, each `--knob` replacing one."""
    workload = "mooncake" if args.trace else args.workload
    return {**command_knobs(workload), **knobs_given(args)}


def check_model(args: argparse.Namespace) -> None:
    """An unknown --model or --device fails before any work, not as a bare KeyError inside a
    cell; an alias (a Hugging Face id, `a100-80gb`) becomes the zoo's name."""
    args.model = model_name(args.model)
    args.device = device_name(args.device)


def check_calibration(path: str | None) -> None:
    if path is not None and not Path(path).is_file():
        raise InputError(f"GPU benchmark JSON not found: {path}")


def cell_template(args: argparse.Namespace, workload: str, knobs: dict[str, Any], page_size: int) -> CellConfig:
    """A cell with every setting of the command line; the grid fills in backend and capacity."""
    return CellConfig(
        backend="",
        workload=workload,
        capacity_tokens=0,
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
        scheduler=args.scheduler,
        async_scheduling=args.async_scheduling,
        step_ms=args.step_ms,
        time_scale=args.time_scale,
        request_rate=args.request_rate,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        tp=None if args.tp == 1 else args.tp,
        profile=args.profile,
    )
