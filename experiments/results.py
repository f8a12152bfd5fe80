"""The results document of a comparison: what `compare` and `sweep` write and `report` reads."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from experiments.provenance import code_version, git_commit
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
REPORT_ENTRIES = ("results.json", "report.md", "results.csv", "*.png", PER_REQUEST_FILE)
#: settings added with clusters, shared by every cell of a document: in `settings` when given
ADDED_SETTINGS = ("time_scale", "request_rate", "slo_ttft_ms", "slo_tpot_ms")
#: what a cell's result holds beyond what it held before clusters (experiments/sizing.py,
#: metrics.latency_section): `kv_capacity` and `serving.latency`
ADDED_SECTIONS = ("kv_capacity", "serving.latency")
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

    A document whose cells are all plain (one replica, no sizing, re-timing or SLO setting:
    `CellConfig.plain`) leaves out `ADDED_SECTIONS` too, so it reads exactly as documents
    written before them (tests/test_behaviour_unchanged.py reproduces reports/example); a
    document with a cluster or such a setting has them in every cell, one replica included."""
    added = not all(c.plain for c in cells)
    settings = {k: getattr(cells[0], k) for k in SETTINGS}
    settings.update({k: v for k in ADDED_SETTINGS if (v := getattr(cells[0], k)) is not None})
    return {
        "command": command_line(argv),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": git_commit(),  # of the package's own checkout, not the current directory's
        "code_version": code_version(),
        "workload": {"name": workload.name, "config": workload.config, "requests": len(workload)},
        "settings": settings,
        "backends": backends,
        "capacities": capacities,
        "bounds": bounds,
        "cells": [_cell(r, added) for r in results],
    }


def _cell(result: dict[str, Any], added: bool) -> dict[str, Any]:
    """A cell's result as the document holds it: no per-request records, and without
    `ADDED_SECTIONS` unless `added` (see `document`)."""
    out = {k: v for k, v in result.items() if k != PER_REQUEST and (added or k != "kv_capacity")}
    if not added and "serving" in out:
        out["serving"] = {k: v for k, v in out["serving"].items() if k != "latency"}
    return out


def write(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """`results.json` plus the rendered report (Markdown, CSV, plots) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    return [out / "results.json", *render(doc, out)]


def per_request_rows(cells: list[CellConfig], results: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every request of every serving cell, by cell then `request_index` (its line in the
    trace, its position in the workload's requests; a parallel sample shares its parent's
    and follows it): the cell's `backend` label, `capacity_tokens` and `page_size`, then
    every key of the engine's per-request record, times renamed with their unit (`TIME_KEYS`).
    A cluster cell's rows also name its `replicas` and `router` after `page_size`, and end
    with the `replica` that served the request."""
    for cfg, res in zip(cells, results, strict=True):
        records = res.get(PER_REQUEST)
        if records is None:
            continue  # replay only
        head = {"backend": cfg.backend_label, "capacity_tokens": cfg.capacity_tokens, "page_size": cfg.page_size}
        if cfg.replicas > 1:  # a cluster cell: its shape, and each row its `replica`
            head.update(replicas=cfg.replicas, router=cfg.router_label)
        for rec in sorted(records, key=lambda r: (r["request_index"], r.get("sample_of") is not None)):
            yield {**head, **{TIME_KEYS.get(k, k): v for k, v in rec.items()}}


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
