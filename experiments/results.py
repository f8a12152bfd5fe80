"""The results document of a comparison: what `compare` and `sweep` write and `report` reads."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from experiments.engine.request import TIER_RECORD_KEYS
from experiments.provenance import DISTRIBUTION, code_version, git_commit, package_version
from experiments.report import render
from experiments.runner import PER_REQUEST, CellConfig
from experiments.workloads.generators import Workload

#: CellConfig fields shared by every cell of a document, shown in the report's header
SETTINGS = (
    "page_size", "executor", "step_ms", "device", "model", "token_budget", "max_running", "scheduler",
    "async_scheduling", "ordering", "protocol", "seed",
)  # fmt: skip
#: the per-request results of a run's serving cells, one JSON object a line (`write_per_request`)
PER_REQUEST_FILE = "per_request.jsonl"
#: what a run puts in a report folder (glob patterns): replaced as a whole by the next run
REPORT_ENTRIES = ("results.json", "report.md", "results.csv", "*.png", "*.pdf", PER_REQUEST_FILE)
#: the layout of results.json, raised when a key changes meaning or goes (not when one is
#: added). 1: documents without the key (before issue 15); 2: `schema_version`, `package`,
#: `clocks`, every cell with `kv_capacity` and `serving.latency`, vLLM's throughput names
SCHEMA_VERSION = 2
#: what the timing numbers of a document measured (experiments/engine/cache_client.py CPU_CLOCK)
CLOCKS = {
    "cache": "CPU time of the running thread inside cache calls (time.thread_time)",
    "router": "CPU time of the running thread inside route and KV-event handling (time.thread_time)",
    "wall_seconds": "wall time of the whole cell (time.perf_counter)",
}
#: settings added with clusters, shared by every cell of a document: in `settings` when given
ADDED_SETTINGS = ("time_scale", "request_rate", "slo_ttft_ms", "slo_tpot_ms")
#: the engine's per-request times (seconds, on the run's clock), as per_request.jsonl names them
TIME_KEYS = {"arrival": "arrival_s", "first_token_at": "first_token_at_s", "finished_at": "finished_at_s",
             "ttft": "ttft_s", "tpot": "tpot_s"}  # fmt: skip


__all__ = [
    "PER_REQUEST_FILE",
    "REPORT_ENTRIES",
    "code_version",
    "command_line",
    "document",
    "git_commit",
    "per_request_rows",
    "write",
    "write_per_request",
]  # git_commit: bench scripts import it here


def command_line(argv: Sequence[str] | None) -> str:
    return "python -m experiments " + " ".join(sys.argv[1:] if argv is None else argv)


def document(
    argv: Sequence[str] | None,
    workload: Workload,
    cells: list[CellConfig],
    results: list[dict[str, Any]],
    backends: list[str],
    capacities: list[int],
    bounds: dict[str, Any] | None,
) -> dict[str, Any]:
    """Every number of a comparison plus the configuration that produced it.

    `backends` are the variants' labels (`radix`, `radix[eviction_policy=lfu]`), in the
    order of the cells; report.py draws one line per label. The cells' per-request records
    (`runner.PER_REQUEST`) are left out: they go to per_request.jsonl (`write_per_request`).
    `schema_version` names the layout (`SCHEMA_VERSION`), `package` the distribution and its
    version, `commit` the package's own checkout (not the current directory's; "unknown"
    outside a git checkout), `clocks` what the timing numbers measured."""
    settings = {k: getattr(cells[0], k) for k in SETTINGS}
    settings.update({k: v for k in ADDED_SETTINGS if (v := getattr(cells[0], k)) is not None})
    return {
        "schema_version": SCHEMA_VERSION,
        "command": command_line(argv),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "package": {"name": DISTRIBUTION, "version": package_version()},
        "commit": git_commit(),  # of the package's own checkout, not the current directory's
        "code_version": code_version(),
        "clocks": CLOCKS,
        "workload": {"name": workload.name, "config": workload.config, "requests": len(workload)},
        "settings": settings,
        "backends": backends,
        "capacities": capacities,
        "bounds": bounds,
        "cells": [{k: v for k, v in r.items() if k != PER_REQUEST} for r in results],
    }


def write(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """`results.json` plus the rendered report (Markdown, CSV, plots) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    return [out / "results.json", *render(doc, out)]


def per_request_rows(cells: list[CellConfig], results: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every request of every serving cell, by cell then `request_index` (its line in the
    trace, its position in the workload's requests; a parallel sample shares its parent's
    and follows it), every row with the same keys, so the file loads as one table (README
    *Per-request results*): the cell (`backend` label, `capacity_tokens`, `page_size`,
    `replicas`, `router`: null for one replica), then every key of the engine's per-request
    record, times renamed with their unit (`TIME_KEYS`) and `e2e_s` (arrival to last token)
    after `finished_at_s`, and last the `replica` that served it (0 for one replica)."""
    # a cell with memory tiers adds keys to its records (`request.TIER_RECORD_KEYS`): every
    # row carries them then, None in the other cells' rows
    tiered = any(TIER_RECORD_KEYS[0] in rec for res in results for rec in res.get(PER_REQUEST) or ())
    for cfg, res in zip(cells, results, strict=True):
        records = res.get(PER_REQUEST)
        if records is None:
            continue  # replay only
        head = {
            "backend": cfg.backend_label,
            "capacity_tokens": cfg.capacity_tokens,
            "page_size": cfg.page_size,
            "replicas": cfg.replicas,
            "router": cfg.router_label,
        }
        for rec in sorted(records, key=lambda r: (r["request_index"], r.get("sample_of") is not None)):
            row = dict(head)
            for k, v in rec.items():
                if k == "replica":
                    continue  # last, below
                row[TIME_KEYS.get(k, k)] = v
                if k == "finished_at":
                    row["e2e_s"] = None if v is None else v - rec["arrival"]
            if tiered:
                for k in TIER_RECORD_KEYS:
                    row.setdefault(k, None)
            row["replica"] = rec.get("replica", 0)
            yield row


def write_per_request(cells: list[CellConfig], results: list[dict[str, Any]], out_dir: str | Path) -> Path | None:
    """`per_request.jsonl` in `out_dir` (a run's staging folder: it is published with the
    report), or None when no cell ran the serving protocol."""
    if not any(PER_REQUEST in r for r in results):
        return None
    path = Path(out_dir) / PER_REQUEST_FILE
    with path.open("w") as fh:
        for row in per_request_rows(cells, results):
            fh.write(json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n")
    return path
