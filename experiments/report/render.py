"""Render a comparison from its results JSON: Markdown tables, figures (PNG and PDF), CSV.

Everything is drawn from `results.json` alone, so `python -m experiments report DIR`
regenerates every figure and table of a run without rerunning it. The figures are
experiments/report/figures.py's (matplotlib's object API: rendering never switches the caller's
plotting backend). Documents written before `schema_version` 2 still render: their
missing numbers show as "—", and their cache times are labelled wall time, as measured.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from experiments.report.labels import cell_label_of
from experiments.runs.cell_pool import Task, TaskBeside
from experiments.runs.router_options import router_label
from experiments.runs.run_config import dump_toml

#: a column's format: three significant figures (`sig3`), the precision the timing models'
#: calibration error supports, for latencies
SIG3 = "sig3"

#: the main table of each capacity: (column, getter, format). `{cache}` in a name reads
#: "cache CPU µs/req" or, in a document from before the CPU clock, "cache wall µs/req"
COLUMNS = [
    ("replay hit rate", lambda c: _get(c, "replay", "hit_rate"), "{:.2%}"),
    ("serving hit rate", lambda c: _get(c, "serving", "hit_rate"), "{:.2%}"),
    ("prefill tokens computed", lambda c: _get(c, "serving", "prefill_tokens_computed"), "{:,}"),
    ("evicted pages", lambda c: _get(c, "serving", "evicted_pages"), "{:,}"),
    ("peak pages", lambda c: _get(c, "serving", "peak_pages"), "{:,}"),
    ("metadata bytes", lambda c: _get(c, "serving", "metadata_bytes_end"), "{:,}"),
    ("{cache} (replay)", lambda c: _get(c, "replay", "us_per_request"), "{:.0f}"),
    ("{cache} (serving)", lambda c: _get(c, "serving", "cache_us_per_request"), "{:.0f}"),
    ("TTFT p50 (ms)", lambda c: _ms(_get(c, "serving", "ttft_p50")), SIG3),
    ("TTFT p99 (ms)", lambda c: _ms(_get(c, "serving", "ttft_p99")), SIG3),
    ("output token throughput (tok/s)", lambda c: _output_throughput(c), "{:,.0f}"),
    ("preemptions", lambda c: _get(c, "serving", "preemptions"), "{:,}"),
]

#: the configuration columns of results.csv; `label` is the cell as tables name it (the
#: backend with its non-default options, `radix[eviction_policy=lfu]`, and for a cluster its
#: size and router, `apc ×8 cache_aware`), `backend_options` / `router_options` those options
#: as JSON, `router` the router with its non-default options (empty for one replica); the
#: others are the cell's `config` keys (`step_ms` empty but for the fixed executor)
CSV_CONFIG = (
    "backend", "label", "backend_options", "workload", "capacity_tokens", "page_size", "executor", "device",
    "scheduler", "async_scheduling", "step_ms", "model", "token_budget", "max_running", "protocol", "seed",
)  # fmt: skip
#: the configuration columns a document with a cluster cell adds (one replica: 1, empty, {})
CLUSTER_CONFIG = ("replicas", "router", "router_options")
#: a document written before the settings existed: every serving cell then ran the scheduler
#: now called `legacy`, synchronously, on a cost model or the real model; and a one-replica
#: cell's config has no cluster keys (`CellConfig.as_dict`)
_BEFORE_SCHEDULERS = {"scheduler": "legacy", "async_scheduling": False, "step_ms": None}
_SINGLE_REPLICA = {"replicas": 1, "router": None, "router_options": {}}
#: a cluster cell's table (`cluster_markdown`): its cluster section's numbers
CLUSTER_COLUMNS = [
    ("hit rate", lambda c: c["hit_rate"], "{:.2%}"),
    ("TTFT mean (ms)", lambda c: c["ttft_ms"]["mean"], SIG3),
    ("TTFT p50 (ms)", lambda c: c["ttft_ms"]["p50"], SIG3),
    ("TTFT p90 (ms)", lambda c: c["ttft_ms"]["p90"], SIG3),
    ("TTFT p99 (ms)", lambda c: c["ttft_ms"]["p99"], SIG3),
    ("TPOT p50 (ms)", lambda c: c["tpot_ms"]["p50"], SIG3),
    ("TPOT p99 (ms)", lambda c: c["tpot_ms"]["p99"], SIG3),
    ("load imbalance", lambda c: c["load_imbalance"], "{:.2f}"),
    ("preemptions", lambda c: c["preemptions"], "{:,}"),
    ("router µs/decision", lambda c: c["router_us_per_decision"], "{:.1f}"),
]
CSV_FIELDS = [
    (
        "replay",
        [
            "hit_rate",
            "hit_tokens",
            "prompt_tokens",
            "evicted_pages",
            "unschedulable",
            "truncated",
            "us_per_request",
            "cache_seconds",
        ],
    ),
    (
        "serving",
        [
            "hit_rate",
            "hit_tokens",
            "prompt_tokens",
            "prefill_tokens_computed",
            "generated_tokens",
            "evicted_pages",
            "copied_pages",
            "peak_pages",
            "metadata_bytes_end",
            "cache_us_per_request",
            "ttft_p50",
            "ttft_p99",
            "tpot_p50",
            "request_throughput",
            "output_throughput",
            "total_token_throughput",
            "makespan_s",
            "preemptions",
            "aborted",
            "steps",
        ],
    ),
]
#: the bounds at a cell's capacity (replay protocol, page-granular), when the document has them
BOUNDS_CSV = ("bounds.infinite.hit_rate", "bounds.belady.hit_rate")
#: a cluster cell's pooled cache (`bounds.pooled`): its backend's replay hit rate and Belady's
POOLED_CSV = ("bounds.pooled.replay.hit_rate", "bounds.pooled.belady.hit_rate")
#: what a document with a tiered cell (`replay.memory_tiers` beyond the GPU) adds: replay
#: tokens reused per tier, the tokens of all its tiers and Belady at that total
#: (`bounds.tiered`); empty for a cell with the GPU only
TIERED_CSV = (
    "replay.hit_tokens_by_tier.gpu",
    "replay.hit_tokens_by_tier.host",
    "replay.hit_tokens_by_tier.storage",
    "bounds.tiered.capacity_tokens",
    "bounds.tiered.belady.hit_rate",
)
#: the metric columns a document with a cluster cell adds (its `cluster` section)
CLUSTER_CSV = [("cluster", ["hit_rate", "load_imbalance", "preemptions", "router_decisions", "router_us_per_decision"])]
#: latencies (`serving.latency`, metrics.latency_section) and their statistics
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
STATS = ("mean", "p50", "p90", "p99")
#: the columns a document with the added sections has (results.ADDED_SECTIONS): the added
#: settings (empty where not set), the KV capacity in GB and how it was given, every
#: latency statistic, and goodput
ADDED_CONFIG = ("capacity_gb", "gpu_memory_utilization", "time_scale", "request_rate", "slo_ttft_ms", "slo_tpot_ms")
ADDED_CSV = (
    ["kv_capacity.given", "kv_capacity.pages", "kv_capacity.gb", "kv_capacity.kv_bytes_per_token"]
    + [f"serving.latency.{m}.{s}" for m in LATENCIES for s in STATS]
    + ["serving.latency.goodput.good_requests", "serving.latency.goodput.requests_per_s"]
)
#: the columns a document with a tiered serving cell adds (`metrics.tier_section`)
TIER_CSV = tuple(
    f"serving.tiers.{k}"
    for k in (
        "gpu_hit_tokens", "host_hit_tokens", "storage_hit_tokens", "host_to_gpu_bytes", "gpu_to_host_bytes",
        "load_stall_s", "load_wait_s", "backup_blocked_s",
    )
)  # fmt: skip
#: the latency table (`latency_markdown`): one row per cell and latency, the four statistics
LATENCY_ROWS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
#: the throughput table (`latency_markdown`): (column, key of `serving`, format), as `vllm
#: bench serve` names them; goodput (`serving.latency.goodput`) follows when SLOs were set
THROUGHPUT_COLUMNS = [
    ("request throughput (req/s)", "request_throughput", "{:,.2f}"),
    ("output token throughput (tok/s)", "output_throughput", "{:,.0f}"),
    ("total token throughput (tok/s)", "total_token_throughput", "{:,.0f}"),
    ("duration (s)", "makespan_s", "{:,.1f}"),
]
GOODPUT_COLUMN = "request goodput (req/s)"
#: each figure's caption in report.md (experiments/report/figures.py draws them)
CAPTIONS = {
    "hit_rate_vs_capacity": "Replay hit rate of each backend against the KV capacity (log axis, a tick at each "
    "capacity run), with the infinite-capacity bound (dashed) and Belady's offline optimum (dotted, stars).",
    "ttft_cdf": "CDF of TTFT (queueing included) per capacity, on one log axis in ms shared by every panel.",
    "pages_in_use": "Pages pinned by running requests over time, as a share of the capacity (the dashed "
    "ceiling): a row per capacity, a column per backend; thin line every sampled step, thick a moving mean.",
}


def label(cell: dict[str, Any]) -> str:
    """The cell as tables, plots and the CSV name it: its backend's name and non-default
    options (`radix[eviction_policy=lfu]`), and for a cluster its size and router
    (`apc ×8 cache_aware`); the entry of the document's `backends`."""
    return cell_label_of(cell["config"])


def _get(cell: dict, section: str, key: str) -> Any:
    return cell.get(section, {}).get(key)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _output_throughput(cell: dict[str, Any]) -> float | None:
    """Tokens generated per second; a document before vLLM's names called it `throughput_tokens_per_s`."""
    serving = cell.get("serving", {})
    return serving.get("output_throughput", serving.get("throughput_tokens_per_s"))


def _cache_clock(results: dict[str, Any]) -> str:
    """How a document's cache times read in a column name: CPU time since `clocks` exist."""
    return "cache CPU µs/req" if "clocks" in results else "cache wall µs/req"


def _path(tree: Any, dotted: str | tuple[str, ...]) -> Any:
    """`tree[a][b]...` along a dotted path (or a tuple of keys); None where a key is missing."""
    for key in dotted.split(".") if isinstance(dotted, str) else dotted:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def sig3(value: float) -> str:
    """Three significant figures, without an exponent: 501851.4 -> 502,000; 118.23 -> 118;
    0.12345 -> 0.123 (the precision a timing model's calibration error supports)."""
    x = float(f"{value:.3g}")
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "—"
    if spec == SIG3:
        return sig3(value)
    try:
        return spec.format(value)
    except (ValueError, TypeError):
        return str(value)


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"no results JSON at {path}")
    return json.loads(path.read_text())


def write_csv(results: dict[str, Any], path: Path) -> None:
    """One row per cell: its configuration (backend options and every workload knob
    included, `workload.<knob>`), every scalar metric, and the bounds at its capacity
    (`BOUNDS_CSV`). The cluster columns (`CLUSTER_CSV`) are there only when a cell is a
    cluster; the `ADDED_CSV` ones when the cells have those sections, the `TIER_CSV` ones when
    a serving cell had memory tiers."""
    clusters = any("cluster" in cell for cell in results["cells"])
    extended = any("kv_capacity" in cell for cell in results["cells"])
    added = list(ADDED_CSV) if extended else []
    if any("tiers" in cell.get("serving", {}) for cell in results["cells"]):
        added += TIER_CSV
    config = list(CSV_CONFIG) + (list(CLUSTER_CONFIG) if clusters else []) + (list(ADDED_CONFIG) if extended else [])
    knobs = list(dict.fromkeys(k for cell in results["cells"] for k in cell.get("workload_config") or {}))
    fields = CSV_FIELDS + (CLUSTER_CSV if clusters else [])
    bounds = list(BOUNDS_CSV) + (list(POOLED_CSV) if clusters else []) if results.get("bounds") else []
    tiered = list(TIERED_CSV) if any(_tiers(cell) for cell in results["cells"]) else []
    header = (
        config
        + [f"workload.{k}" for k in knobs]
        + [f"{section}.{k}" for section, keys in fields for k in keys]
        + added
        + bounds
        + tiered
    )
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for cell in results["cells"]:
            cfg = {**_BEFORE_SCHEDULERS, **_SINGLE_REPLICA, **cell["config"]}
            given = {
                "label": label(cell),
                "backend_options": json.dumps(cfg.get("backend_options") or {}),
                "router": "" if cfg["router"] is None else router_label(cfg["router"], cfg["router_options"]),
                "router_options": json.dumps(cfg["router_options"]),
            }
            row = [given[k] if k in given else cfg.get(k) for k in config]
            workload = cell.get("workload_config") or {}
            row += [_csv_value(workload.get(k)) for k in knobs]
            for section, keys in fields:
                row += [_get(cell, section, k) for k in keys]
            if "serving" in cell and "output_throughput" not in cell["serving"]:  # before vLLM's names
                row[header.index("serving.output_throughput")] = _output_throughput(cell)
            row += [_path(cell, k) for k in added]
            row += [_bound(results["bounds"], cell, k) for k in bounds]
            w.writerow(row + [_tiered(results, cell, k) for k in tiered])


def _tiers(cell: dict[str, Any]) -> bool:
    """Whether `cell`'s cache keeps KV on more than the GPU (its replay says which tiers)."""
    return len(cell.get("replay", {}).get("memory_tiers", ())) > 1


def tiered_bound(results: dict[str, Any], cell: dict[str, Any]) -> dict[str, Any] | None:
    """The `bounds.tiered` entry of `cell` (Belady at its tiers' total capacity): the one
    listing the cell's label with its GPU capacity; None without one."""
    tiered = (results.get("bounds") or {}).get("tiered") or {}
    name, gpu = label(cell), cell.get("num_pages", 0) * cell["config"]["page_size"]
    for entry in tiered.values():
        caps = entry["cells"].get(name)
        if caps is not None and caps["gpu"] == gpu:
            return entry
    return None


def _tiered(results: dict[str, Any], cell: dict[str, Any], column: str) -> Any:
    """A `TIERED_CSV` column for `cell` (None for a cell with the GPU only)."""
    if not _tiers(cell):
        return None
    if column.startswith("replay."):
        return _path(cell, column)
    entry = tiered_bound(results, cell)
    if entry is None:
        return None
    return entry["capacity_tokens"] if column == "bounds.tiered.capacity_tokens" else entry["belady"]["hit_rate"]


def _csv_value(value: Any) -> Any:
    """A knob as a CSV cell: scalars as they are, lists and dicts as JSON."""
    return json.dumps(value) if isinstance(value, list | dict) else value


def _bound(bounds: dict[str, Any], cell: dict[str, Any], column: str) -> float | None:
    """A `BOUNDS_CSV` / `POOLED_CSV` column's hit rate for `cell` (None where it has none)."""
    cfg = cell["config"]
    cap = cfg["capacity_tokens"]
    if column == "bounds.infinite.hit_rate":
        return bounds["infinite"]["hit_rate"]
    if column == "bounds.belady.hit_rate":
        return _path(bounds, ("belady", str(cap), "hit_rate"))
    replicas = cfg.get("replicas", 1)
    if replicas == 1:
        return None
    page = bounds.get("page_size", 1)
    entry = _path(bounds, ("pooled", str(replicas * (cap // page) * page)))
    if entry is None:
        return None
    if column == "bounds.pooled.belady.hit_rate":
        return entry["belady"]["hit_rate"]
    backend = cell_label_of({**cfg, "replicas": 1})
    return _path(entry, ("replay", backend, "hit_rate"))


def _executor(cfg: dict[str, Any]) -> str:
    if cfg["executor"] == "fixed":
        return f"executor fixed ({cfg['step_ms']:g} ms per step)"
    tp = cfg.get("tp") or 1
    gpus = f"{tp} x {cfg['device']}" if tp > 1 else cfg["device"]
    return f"executor {cfg['executor']} ({cfg['model']} on {gpus})"


def uncertainty_lines(results: dict[str, Any]) -> list[str]:
    """The timing model and how far it is from measurements (experiments/timing/
    calibration.py); a line when capacities were forced past the device's memory; one
    warning naming the serving cells whose offered load exceeded what they served
    (`metrics.saturation`), with the worst one's numbers."""
    cfg = results["settings"]
    if "executor" not in cfg or cfg.get("protocol") == "replay":
        return []
    lines = [
        "Timing: "
        + timing_statement(cfg["executor"], cfg.get("profile"))
        + " Latencies are given to three significant figures.",
        "",
    ]
    if (results.get("run_config") or {}).get("force_capacity"):
        lines += [
            f"Capacities beyond what one replica's GPUs hold beside the weights were run anyway (`--force-capacity`): "
            f"they model a KV cache larger than {cfg.get('device', 'the device')} memory (a host tier, or a thought experiment).",
            "",
        ]
    saturated = [c for c in results["cells"] if _path(c, ("serving", "saturation", "saturated"))]
    if saturated:
        worst = max(saturated, key=lambda c: c["serving"]["saturation"]["last_tenth_ttft_s"])
        sat = worst["serving"]["saturation"]
        if len(saturated) == len(results["cells"]):
            where = f"every cell ({len(saturated)})"
        else:
            names = ", ".join(f"{label(c)} at {c['config']['capacity_tokens']:,}" for c in saturated)
            where = f"{len(saturated)} of {len(results['cells'])} cells ({names})"
        lines += [
            f"**Saturated**: the offered load exceeds what the replicas serve in {where}: the median TTFT "
            "of the last tenth of arrivals is "
            f"{sig3(sat['last_tenth_ttft_s'])} s against {sig3(sat['first_tenth_ttft_s'])} s for the first tenth "
            f"({label(worst)}). Queueing dominates there: the comparison is of queues, not caches "
            "(`--time-scale`, `--request-rate` or more `--replicas` lower the load).",
            "",
        ]
    return lines


def timing_statement(executor: str, profile: str | None = None) -> str:
    """What the executor's step times rest on, with its calibration error where one is known
    (a user's own profile table has none known here: the interpolation's error on the
    shipped tables is said instead)."""
    if executor == "profile" and profile is not None:
        from experiments.timing.calibration import interpolation_error

        return (
            f"your measured profile table `{Path(profile).name}`, interpolated (no calibration of it is known here; "
            f"on the shipped tables the interpolation is within {interpolation_error():.2g}% median of held-out points)."
        )
    if executor == "fixed":
        return "a constant step time (no model of the batch: no calibration applies)."
    if executor == "model":
        return "the real model's forward pass, measured on this machine."
    from experiments.timing.calibration import headline  # (reads the shipped profiles: only when asked)

    return headline(executor)


def _scheduler(cfg: dict[str, Any]) -> str:
    return f"scheduler {cfg['scheduler']}" + (" with async scheduling" if cfg["async_scheduling"] else "")


def _ordering(cfg: dict[str, Any]) -> str:
    """A document made by the retired legacy scheduler names its waiting-queue order."""
    return f", ordering {cfg['ordering']}" if "ordering" in cfg else ""


def markdown(results: dict[str, Any], figures: list[str]) -> str:
    cfg = {**_BEFORE_SCHEDULERS, **results["settings"]}
    lines = [
        f"# Prefix-cache comparison: {results['workload']['name']}",
        "",
        f"Command: `{results['command']}`  ",
        f"Created {results['created']} at commit `{results['commit']}`{_package(results)}; page size {cfg['page_size']}, "
        f"{_executor(cfg)}, {_scheduler(cfg)}, token budget {cfg['token_budget']}"
        f"{_ordering(cfg)}; workload knobs `{json.dumps(results['workload']['config'])}`.",
        "",
        "Replay hit rates come from the sequential replay protocol, the one the bounds are defined for;",
        "everything else comes from the serving protocol (continuous batching on a virtual clock).",
        "",
    ]
    lines += _timing_lines(results["settings"])
    lines += uncertainty_lines(results)
    bounds = results.get("bounds")
    names = [name.format(cache=_cache_clock(results)) for name, _, _ in COLUMNS]
    for cap in results["capacities"]:
        cells = [c for c in results["cells"] if c["config"]["capacity_tokens"] == cap]
        lines += [f"## Capacity {_capacity(cells, cap, cfg.get('model'), cfg.get('tp') or 1)}", ""]
        lines.append("| backend | " + " | ".join(names) + " |")
        lines.append("|---" * (len(COLUMNS) + 1) + "|")
        for c in cells:
            lines.append(f"| {label(c)} | " + " | ".join(_fmt(get(c), spec) for _, get, spec in COLUMNS) + " |")
        if bounds:
            dash = " | ".join("—" for _ in COLUMNS[1:])
            lines.append(f"| *infinite capacity* | {bounds['infinite']['hit_rate']:.2%} | {dash} |")
            lines.append(f"| *Belady (offline)* | {bounds['belady'][str(cap)]['hit_rate']:.2%} | {dash} |")
        lines.append("")
    if bounds:
        lines += [
            "Bounds are page-granular, under the replay protocol: no online policy of an automatic cache",
            "(apc, radix) can beat Belady at concurrency 1. `paged` shares only declared prefixes, at token",
            "granularity (a partial last page copy-on-write), so the bounds do not bind it.",
            "",
        ]
    lines += cluster_markdown(results)
    lines += tier_markdown(results)
    lines += latency_markdown(results)
    for fig in figures:
        caption = CAPTIONS.get(fig, "")
        lines += [f"![{fig}]({fig}.png)", "", f"*{fig}* ([PDF]({fig}.pdf)). {caption}".rstrip(), ""]
    clock = (
        "CPU time of the thread inside cache calls per request (`time.thread_time`, steadier than wall time on a "
        "busy machine)"
        if "clocks" in results
        else "wall time inside cache calls per request (this document predates the CPU clock)"
    )
    lines += [
        "How to read: *hit rate* is the share of prompt tokens whose KV was reused; *prefill tokens",
        "computed* counts recomputation after preemption too; *peak pages* is the most pages pinned at",
        f"once; *cache µs/req* is {clock}, under the replay and the serving",
        "protocol. TTFT is arrival to first token on the virtual clock, so it includes queueing.",
        "",
    ]
    if results.get("run_config"):  # the options the run resolved (experiments/runs/run_config.py), repeatable
        lines += ["## Configuration", "", "```toml", dump_toml(results["run_config"]).rstrip(), "```", ""]
    return "\n".join(lines)


def _package(results: dict[str, Any]) -> str:
    """` (prefix-cache-lab 0.1.0, results schema 2)`, where the document says."""
    package = results.get("package")
    if not package:
        return ""
    return f" ({package['name']} {package['version']}, results schema {results.get('schema_version', 1)})"


def _capacity(cells: list[dict[str, Any]], cap: int, model: str | None = None, tp: int = 1) -> str:
    """A capacity as a heading names it: tokens, and where the cells say (`kv_capacity`) its
    GB for `model` and how it was given (on each of `tp` GPUs: every GPU holds its heads'
    share of every token)."""
    kv = next((c["kv_capacity"] for c in cells if "kv_capacity" in c), None)
    if kv is None:
        return f"{cap:,} tokens"
    how = {
        "tokens": "",
        "capacity_gb": f", --capacity-gb {kv.get('capacity_gb', 0):g}",
        "gpu_memory_utilization": f", --gpu-memory-utilization {kv.get('gpu_memory_utilization', 0):g} of "
        f"{(kv.get('device_memory_bytes') or 0) / 1e9:g} GB less {(kv.get('weight_bytes') or 0) / 1e9:.2f} GB of weights",
        "capacity_fraction": f", --capacity-fraction {kv.get('capacity_fraction', 0):g} of a working set of "
        f"{kv.get('working_set_pages', 0):,} pages",
    }[kv["given"]]
    model_text = f" for {model}" if model else ""
    per_gpu = f" on each of {tp} GPUs" if tp > 1 else ""
    return f"{cap:,} tokens ({kv['gb']:.2f} GB of KV{model_text}{per_gpu}{how})"


def _timing_lines(settings: dict[str, Any]) -> list[str]:
    """What the settings say about arrivals and goodput, when they say anything."""
    parts = []
    if settings.get("time_scale") is not None:
        parts.append(f"arrival and think times × {settings['time_scale']:g} (`--time-scale`)")
    rate = settings.get("request_rate")
    if rate == float("inf"):
        parts.append("every request on its own arrives at time 0 (`--request-rate inf`)")
    elif rate is not None:
        parts.append(f"arrivals re-drawn as a Poisson process at {rate:g} requests/s (`--request-rate`)")
    slos = [
        f"{k} ≤ {settings[f'slo_{k.lower()}_ms']:g} ms" for k in ("TTFT", "TPOT") if settings.get(f"slo_{k.lower()}_ms")
    ]
    if slos:
        parts.append("goodput counts requests with " + " and ".join(slos))
    return ["Serving: " + "; ".join(parts) + ".", ""] if parts else []


def cluster_markdown(results: dict[str, Any]) -> list[str]:
    """Per capacity, a table of the cluster cells (none: no lines): the cluster's numbers
    from each cell's `cluster` section (each replica's are in results.json), and below them
    the bounds under the replay protocol: each pooled cache and the infinite one."""
    lines: list[str] = []
    bounds = results.get("bounds") or {}
    for cap in results["capacities"]:
        cells = [c for c in results["cells"] if c["config"]["capacity_tokens"] == cap and "cluster" in c]
        if not cells:
            continue
        lines += [f"## Clusters at {cap:,} tokens per replica", ""]
        lines.append("| cell | " + " | ".join(name for name, _, _ in CLUSTER_COLUMNS) + " |")
        lines.append("|---" * (len(CLUSTER_COLUMNS) + 1) + "|")
        for c in cells:
            row = " | ".join(_fmt(get(c["cluster"]), spec) for _, get, spec in CLUSTER_COLUMNS)
            lines.append(f"| {label(c)} | {row} |")
        lines += _cluster_bounds(cells, bounds, cap)
        lines.append("")
    if lines:
        lines += [
            "A cluster's replicas each have the capacity above; the tables above count the whole cluster",
            "(pages, evictions and steps summed over its replicas). *Load imbalance* is the busiest replica's",
            "tokens served (prompt + generated) over the mean; router µs/decision is CPU time in `route`.",
            "The *pooled* rows are one cache with the whole cluster's pages (replicas × the pages of one: the",
            "ideal of a KV store the replicas share), replayed with the cell's backend and with Belady; they",
            "and the infinite cache are replay hit rates, the ceiling a router's serving hit rate is read against.",
            "",
        ]
    return lines


def _cluster_bounds(cells: list[dict[str, Any]], bounds: dict[str, Any], cap: int) -> list[str]:
    """The pooled caches of `cells` (per replica `cap` tokens) and the infinite cache, as rows."""
    dash = " | ".join("—" for _ in CLUSTER_COLUMNS[1:])
    rows: list[str] = []
    pooled = bounds.get("pooled") or {}
    for n in dict.fromkeys(c["config"]["replicas"] for c in cells):
        total = str(n * (cap // bounds.get("page_size", 1)) * bounds.get("page_size", 1))
        entry = pooled.get(total)
        if entry is None:
            continue
        for backend, r in entry["replay"].items():
            rows.append(
                f"| *pooled {n} × {cap:,} = {int(total):,} tokens, {backend} (replay)* | {r['hit_rate']:.2%} | {dash} |"
            )
        rows.append(
            f"| *pooled {n} × {cap:,} = {int(total):,} tokens, Belady* | {entry['belady']['hit_rate']:.2%} | {dash} |"
        )
    if bounds.get("infinite"):
        rows.append(f"| *infinite capacity (replay)* | {bounds['infinite']['hit_rate']:.2%} | {dash} |")
    return rows


def tier_markdown(results: dict[str, Any]) -> list[str]:
    """Per capacity, a table of the tiered cells (none: no lines), under the replay
    protocol: each tier's size, the prompt tokens reused from each tier (host and storage:
    tokens loaded back), what moved, and Belady at the tiers' total capacity beside the
    cell's own hit rate."""
    lines: list[str] = []
    for cap in results["capacities"]:
        cells = [c for c in results["cells"] if c["config"]["capacity_tokens"] == cap and _tiers(c)]
        if not cells:
            continue
        lines += [
            f"## Memory tiers at {cap:,} GPU tokens (replay)",
            "",
            "| cell | tiers (tokens) | hit rate | reused from GPU | from host | from storage "
            "| GPU→host GB | host→GPU GB | Belady at all tiers |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in cells:
            r = c["replay"]
            by_tier = r["hit_tokens_by_tier"]
            moved = r.get("tier_traffic") or {}
            entry = tiered_bound(results, c)
            sizes = entry["cells"][label(c)].items() if entry else ()
            caps = " + ".join(f"{n} {f'{v:,}' if v else 'unbounded'}" for n, v in sizes) or "—"
            bound = f"{entry['belady']['hit_rate']:.2%}" if entry else "—"
            lines.append(
                f"| {label(c)} | {caps} | {r['hit_rate']:.2%} | {by_tier['gpu']:,} | {by_tier['host']:,} "
                f"| {by_tier['storage']:,} | {moved.get('gpu_to_host_bytes', 0) / 1e9:,.1f} "
                f"| {moved.get('host_to_gpu_bytes', 0) / 1e9:,.1f} | {bound} |"
            )
        lines.append("")
    if lines:
        lines += [
            "Reuse by tier counts prompt tokens not recomputed: from the GPU pages, or loaded back from the host",
            "or from storage. *Belady at all tiers* is one cache of the tiers' total size run by Belady (replay",
            "protocol): no policy that moves KV between the tiers reuses more.",
            "",
        ]
    return lines


def latency_markdown(results: dict[str, Any]) -> list[str]:
    """Per capacity, for every cell that has them (`serving.latency`): a table of its TTFT,
    TPOT, ITL and E2E latency in ms (mean, p50, p90, p99, as `vllm bench serve` reports
    them) and one of its throughput, as vLLM names it, with goodput when SLOs were set;
    none: no lines."""
    lines: list[str] = []
    for cap in results["capacities"]:
        cells = [
            c for c in results["cells"] if c["config"]["capacity_tokens"] == cap and "latency" in c.get("serving", {})
        ]
        if not cells:
            continue
        lines += [f"## Latency and throughput at {cap:,} tokens per replica", ""]
        lines.append("| cell | latency | " + " | ".join(f"{s} (ms)" for s in STATS) + " |")
        lines.append("|---" * (len(STATS) + 2) + "|")
        for c in cells:
            for i, (name, key) in enumerate(LATENCY_ROWS):
                stats = " | ".join(_fmt(_path(c["serving"]["latency"], (key, s)), SIG3) for s in STATS)
                lines.append(f"| {label(c) if i == 0 else ''} | {name} | {stats} |")
        lines.append("")
        goodput = any("goodput" in c["serving"]["latency"] for c in cells)
        names = [name for name, _, _ in THROUGHPUT_COLUMNS] + ([GOODPUT_COLUMN] if goodput else [])
        lines.append("| cell | " + " | ".join(names) + " |")
        lines.append("|---" * (len(names) + 1) + "|")
        for c in cells:
            row = [_fmt(c["serving"].get(key), spec) for _, key, spec in THROUGHPUT_COLUMNS]
            if goodput:
                row.append(_fmt(_path(c["serving"]["latency"], ("goodput", "requests_per_s")), "{:,.2f}"))
            lines.append(f"| {label(c)} | " + " | ".join(row) + " |")
        lines.append("")
    if lines:
        lines += [
            "Latencies are on the virtual clock, over the requests that finished: TTFT from arrival (queueing",
            "included) to the first token, TPOT per request after the first token, ITL every gap between two",
            "consecutive tokens of a request (a stall behind another request's prefill is in it), E2E arrival to",
            "last token. Throughputs are over the run's duration (first arrival at 0 to the last token), named",
            "as `vllm bench serve` names them: requests finished, tokens generated, and prompt plus generated",
            "tokens per second; goodput is the requests/s that met every SLO given (`vllm bench serve --goodput`).",
            "",
        ]
    return lines


def render(results: dict[str, Any], out_dir: str | Path, jobs: int = 1) -> list[Path]:
    """Write report.md, results.csv and the figures (PNG and PDF) into `out_dir`; returns the paths.

    `jobs` > 1 (the processes a run may use): the figures but the pages one are drawn in a
    child process (experiments/runs/cell_pool.py `TaskBeside`) while this one draws the pages
    figure, the largest, and writes the tables: drawing is most of a report's time (4 s
    for the Mooncake trace's 20 cells, against 0.3 s for the rest), and the figures are
    independent of each other, so the bytes are the same."""
    from experiments.report.figures import FORMATS, PAGES_IN_USE, STEMS, draw_all

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if jobs > 1:
        others = tuple(s for s in STEMS if s != PAGES_IN_USE)
        with TaskBeside(Task(f"figures {', '.join(others)}", draw_all, (results, out, others))) as beside:
            pages = draw_all(results, out, (PAGES_IN_USE,))
            write_csv(results, out / "results.csv")
            drawn = set(pages + beside.result())
        figures = [s for s in STEMS if s in drawn]
    else:
        figures = draw_all(results, out)
        write_csv(results, out / "results.csv")
    (out / "report.md").write_text(markdown(results, figures))
    return [out / "report.md", out / "results.csv", *(out / f"{f}.{fmt}" for f in figures for fmt in FORMATS)]
