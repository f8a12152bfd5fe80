"""Render a comparison from its results JSON: Markdown tables, PNG plots, CSV.

Everything is drawn from `results.json` alone, so `python -m experiments report DIR`
regenerates every figure and table of a run without rerunning it.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from experiments.labels import cell_label_of
from experiments.routers.registry import router_label
from experiments.run_config import dump_toml

COLUMNS = [
    ("replay hit rate", lambda c: _get(c, "replay", "hit_rate"), "{:.2%}"),
    ("serving hit rate", lambda c: _get(c, "serving", "hit_rate"), "{:.2%}"),
    ("prefill tokens computed", lambda c: _get(c, "serving", "prefill_tokens_computed"), "{:,}"),
    ("evicted pages", lambda c: _get(c, "serving", "evicted_pages"), "{:,}"),
    ("peak pages", lambda c: _get(c, "serving", "peak_pages"), "{:,}"),
    ("metadata bytes", lambda c: _get(c, "serving", "metadata_bytes_end"), "{:,}"),
    ("cache µs/req (replay)", lambda c: _get(c, "replay", "us_per_request"), "{:.0f}"),
    ("TTFT p50 (s)", lambda c: _get(c, "serving", "ttft_p50"), "{:.3f}"),
    ("TTFT p99 (s)", lambda c: _get(c, "serving", "ttft_p99"), "{:.3f}"),
    ("throughput (tok/s)", lambda c: _get(c, "serving", "throughput_tokens_per_s"), "{:,.0f}"),
    ("preemptions", lambda c: _get(c, "serving", "preemptions"), "{:,}"),
]

#: the configuration columns of results.csv; `label` is the cell as tables name it (the
#: backend with its non-default options, `radix[eviction_policy=lfu]`, and for a cluster its
#: size and router, `apc ×8 cache_aware`), `backend_options` / `router_options` those options
#: as JSON, `router` the router with its non-default options (empty for one replica); the
#: others are the cell's `config` keys (`step_ms` empty but for the fixed executor)
CSV_CONFIG = (
    "backend", "label", "backend_options", "workload", "capacity_tokens", "page_size", "executor", "device", "ordering",
    "scheduler", "async_scheduling", "step_ms",
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
    ("TTFT mean (ms)", lambda c: c["ttft_ms"]["mean"], "{:,.0f}"),
    ("TTFT p50 (ms)", lambda c: c["ttft_ms"]["p50"], "{:,.0f}"),
    ("TTFT p90 (ms)", lambda c: c["ttft_ms"]["p90"], "{:,.0f}"),
    ("TTFT p99 (ms)", lambda c: c["ttft_ms"]["p99"], "{:,.0f}"),
    ("TPOT p50 (ms)", lambda c: c["tpot_ms"]["p50"], "{:.1f}"),
    ("TPOT p99 (ms)", lambda c: c["tpot_ms"]["p99"], "{:.1f}"),
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
            "throughput_tokens_per_s",
            "makespan_s",
            "preemptions",
            "aborted",
            "steps",
        ],
    ),
]
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
    ["kv_capacity.given", "kv_capacity.gb"]
    + [f"serving.latency.{m}.{s}" for m in LATENCIES for s in STATS]
    + ["serving.latency.goodput.good_requests", "serving.latency.goodput.requests_per_s"]
)
#: the latency table (`latency_markdown`): (column, path under `serving.latency`, format)
LATENCY_COLUMNS = [
    ("TTFT mean (ms)", ("ttft_ms", "mean"), "{:,.0f}"),
    ("TTFT p50 (ms)", ("ttft_ms", "p50"), "{:,.0f}"),
    ("TTFT p90 (ms)", ("ttft_ms", "p90"), "{:,.0f}"),
    ("TTFT p99 (ms)", ("ttft_ms", "p99"), "{:,.0f}"),
    ("TPOT p50 (ms)", ("tpot_ms", "p50"), "{:.1f}"),
    ("TPOT p99 (ms)", ("tpot_ms", "p99"), "{:.1f}"),
    ("ITL p50 (ms)", ("itl_ms", "p50"), "{:.1f}"),
    ("ITL p90 (ms)", ("itl_ms", "p90"), "{:.1f}"),
    ("ITL p99 (ms)", ("itl_ms", "p99"), "{:.1f}"),
    ("E2E p50 (ms)", ("e2e_ms", "p50"), "{:,.0f}"),
    ("E2E p99 (ms)", ("e2e_ms", "p99"), "{:,.0f}"),
]
GOODPUT_COLUMN = ("goodput (req/s)", ("goodput", "requests_per_s"), "{:.2f}")


#: backends often coincide (none and paged without declared prefixes): vary the dash too
_STYLES = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]


def _style(results: dict[str, Any], backend: str) -> dict[str, Any]:
    i = results["backends"].index(backend) if backend in results["backends"] else 0
    return {"linestyle": _STYLES[i % len(_STYLES)], "color": f"C{i % 10}"}


def label(cell: dict[str, Any]) -> str:
    """The cell as tables, plots and the CSV name it: its backend's name and non-default
    options (`radix[eviction_policy=lfu]`), and for a cluster its size and router
    (`apc ×8 cache_aware`); the entry of the document's `backends`."""
    return cell_label_of(cell["config"])


def _get(cell: dict, section: str, key: str) -> Any:
    return cell.get(section, {}).get(key)


def _path(tree: Any, dotted: str | tuple[str, ...]) -> Any:
    """`tree[a][b]...` along a dotted path (or a tuple of keys); None where a key is missing."""
    for key in dotted.split(".") if isinstance(dotted, str) else dotted:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "—"
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
    """One row per cell: its configuration and every scalar metric. The cluster columns
    (`CLUSTER_CSV`) are there only when a cell is a cluster, so a document of one-replica
    cells writes the same file as before clusters existed."""
    clusters = any("cluster" in cell for cell in results["cells"])
    extended = any("kv_capacity" in cell for cell in results["cells"])
    added = list(ADDED_CSV) if extended else []
    config = list(CSV_CONFIG) + (list(CLUSTER_CONFIG) if clusters else []) + (list(ADDED_CONFIG) if extended else [])
    fields = CSV_FIELDS + (CLUSTER_CSV if clusters else [])
    header = config + [f"{section}.{k}" for section, keys in fields for k in keys] + added
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
            for section, keys in fields:
                row += [_get(cell, section, k) for k in keys]
            w.writerow(row + [_path(cell, k) for k in added])


def _executor(cfg: dict[str, Any]) -> str:
    if cfg["executor"] == "fixed":
        return f"executor fixed ({cfg['step_ms']:g} ms per step)"
    return f"executor {cfg['executor']} ({cfg['model']} on {cfg['device']})"


def _scheduler(cfg: dict[str, Any]) -> str:
    return f"scheduler {cfg['scheduler']}" + (" with async scheduling" if cfg["async_scheduling"] else "")


def markdown(results: dict[str, Any], figures: list[str]) -> str:
    cfg = {**_BEFORE_SCHEDULERS, **results["settings"]}
    lines = [
        f"# Prefix-cache comparison: {results['workload']['name']}",
        "",
        f"Command: `{results['command']}`  ",
        f"Created {results['created']} at commit `{results['commit']}`; page size {cfg['page_size']}, "
        f"{_executor(cfg)}, {_scheduler(cfg)}, token budget {cfg['token_budget']}, "
        f"ordering {cfg['ordering']}; workload knobs `{json.dumps(results['workload']['config'])}`.",
        "",
        "Replay hit rates come from the sequential replay protocol, the one the bounds are defined for;",
        "everything else comes from the serving protocol (continuous batching on a virtual clock).",
        "",
    ]
    lines += _timing_lines(results["settings"])
    bounds = results.get("bounds")
    for cap in results["capacities"]:
        cells = [c for c in results["cells"] if c["config"]["capacity_tokens"] == cap]
        lines += [f"## Capacity {_capacity(cells, cap)}", ""]
        lines.append("| backend | " + " | ".join(name for name, _, _ in COLUMNS) + " |")
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
    lines += latency_markdown(results)
    for fig in figures:
        lines += [f"![{fig}]({fig})", ""]
    if results.get("run_config"):  # the options the run resolved (experiments/run_config.py), repeatable
        lines += ["## Configuration", "", "```toml", dump_toml(results["run_config"]).rstrip(), "```", ""]
    lines += [
        "How to read: *hit rate* is the share of prompt tokens whose KV was reused; *prefill tokens",
        "computed* counts recomputation after preemption too; *peak pages* is the most pages pinned at",
        "once; *cache µs/req* is CPU time inside cache calls per request (replay protocol). TTFT is",
        "arrival to first token on the virtual clock, so it includes queueing.",
        "",
    ]
    return "\n".join(lines)


def _capacity(cells: list[dict[str, Any]], cap: int) -> str:
    """A capacity as a heading names it: tokens, and where the cells say (`kv_capacity`) its
    GB and how it was given."""
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
    return f"{cap:,} tokens ({kv['gb']:.2f} GB of KV{how})"


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


def latency_markdown(results: dict[str, Any]) -> list[str]:
    """Per capacity, the latencies of every cell that has them (`serving.latency`: ms, as
    `vllm bench serve` reports them), goodput when SLOs were set; none: no lines."""
    lines: list[str] = []
    for cap in results["capacities"]:
        cells = [
            c for c in results["cells"] if c["config"]["capacity_tokens"] == cap and "latency" in c.get("serving", {})
        ]
        if not cells:
            continue
        columns = LATENCY_COLUMNS + (
            [GOODPUT_COLUMN] if any("goodput" in c["serving"]["latency"] for c in cells) else []
        )
        lines += [f"## Latency at {cap:,} tokens per replica", ""]
        lines.append("| cell | " + " | ".join(name for name, _, _ in columns) + " |")
        lines.append("|---" * (len(columns) + 1) + "|")
        for c in cells:
            row = " | ".join(_fmt(_path(c["serving"]["latency"], path), spec) for _, path, spec in columns)
            lines.append(f"| {label(c)} | {row} |")
        lines.append("")
    if lines:
        lines += [
            "Latencies are on the virtual clock, over the requests that finished: TTFT from arrival (queueing",
            "included) to the first token, TPOT per request after the first token, ITL every gap between two",
            "consecutive tokens of a request (a stall behind another request's prefill is in it), E2E arrival to",
            "last token; goodput is the requests/s that met every SLO given (`vllm bench serve --goodput`).",
            "",
        ]
    return lines


def plots(results: dict[str, Any], out_dir: Path) -> list[str]:
    """Hit rate vs capacity with the bounds; TTFT CDF; pages in use over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _plot_hit_rate(plt, results, out_dir / "hit_rate_vs_capacity.png")
    names = ["hit_rate_vs_capacity.png"]
    for fname, draw, xlabel, ylabel in (
        ("ttft_cdf.png", _draw_ttft, "TTFT (s, virtual clock)", "fraction of requests"),
        ("pages_in_use.png", _draw_pages, "time (s, virtual clock)", "pages pinned"),
    ):
        if _plot_per_capacity(plt, results, out_dir / fname, draw, (xlabel, ylabel)):
            names.append(fname)
    return names


def _plot_hit_rate(plt: Any, results: dict[str, Any], path: Path) -> None:
    """Each backend's replay hit rate against capacity, with the bounds."""
    caps = results["capacities"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for b in results["backends"]:
        ys = [
            next(
                (
                    _get(c, "replay", "hit_rate")
                    for c in results["cells"]
                    if label(c) == b and c["config"]["capacity_tokens"] == cap
                ),
                None,
            )
            for cap in caps
        ]
        ax.plot(caps, [y if y is not None else float("nan") for y in ys], marker="o", label=b, **_style(results, b))
    if results.get("bounds"):
        bd = results["bounds"]
        ax.plot(caps, [bd["belady"][str(c)]["hit_rate"] for c in caps], "k:", marker="s", label="Belady (offline)")
        ax.axhline(bd["infinite"]["hit_rate"], color="k", linestyle="--", linewidth=1, label="infinite capacity")
    ax.set_xscale("log")
    ax.set_xlabel("KV capacity (tokens)")
    ax.set_ylabel("prompt-token hit rate (replay)")
    ax.set_title(f"{results['workload']['name']}: hit rate vs capacity")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_per_capacity(
    plt: Any, results: dict[str, Any], path: Path, draw: Callable[..., bool], labels: tuple[str, str]
) -> bool:
    """One panel per capacity, each serving cell drawn by `draw`; False (no file) when none drew."""
    caps = results["capacities"]
    fig, axes = plt.subplots(1, len(caps), figsize=(4.2 * len(caps), 3.6), squeeze=False)
    drew = False
    for ax, cap in zip(axes[0], caps, strict=True):
        for c in results["cells"]:
            if c["config"]["capacity_tokens"] == cap and "serving" in c:
                drew |= draw(ax, c, _style(results, label(c)))
        ax.set_title(f"{cap:,} tokens")
        ax.set_xlabel(labels[0])
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(labels[1])
    if drew:
        axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    if drew:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drew


def _draw_ttft(ax, cell, style) -> bool:
    q = cell["serving"]["ttft_quantiles"]
    if not q:
        return False
    ax.plot(q, [i / (len(q) - 1) if len(q) > 1 else 1.0 for i in range(len(q))], label=label(cell), **style)
    return True


def _draw_pages(ax, cell, style) -> bool:
    tl = cell["serving"]["pages_timeline"]
    if not tl:
        return False
    ax.step([t for t, _ in tl], [p for _, p in tl], where="post", label=label(cell), linewidth=1, **style)
    return True


def render(results: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write report.md, results.csv and the PNG plots into `out_dir`; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = plots(results, out)
    (out / "report.md").write_text(markdown(results, figures))
    write_csv(results, out / "results.csv")
    return [out / "report.md", out / "results.csv", *(out / f for f in figures)]
