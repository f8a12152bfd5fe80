"""The results document of a comparison: what `compare` and `sweep` write and `report` reads."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.engine.request import TIER_RECORD_KEYS
from experiments.report.render import render
from experiments.runs.provenance import DISTRIBUTION, code_version, git_commit, package_version
from experiments.runs.runner import PER_REQUEST, CellConfig
from experiments.workloads.generators import Workload

#: CellConfig fields shared by every cell of a document, shown in the report's header
SETTINGS = (
    "page_size", "executor", "step_ms", "device", "model", "token_budget", "max_running", "scheduler",
    "async_scheduling", "protocol", "seed",
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
#: settings added with clusters (and tensor parallelism, profiles), shared by every cell of a
#: document: in `settings` when given
ADDED_SETTINGS = ("time_scale", "request_rate", "slo_ttft_ms", "slo_tpot_ms", "tp", "profile")
#: the engine's per-request times (seconds, on the run's clock), as per_request.jsonl names them
TIME_KEYS = {"arrival": "arrival_s", "first_token_at": "first_token_at_s", "finished_at": "finished_at_s",
             "ttft": "ttft_s", "tpot": "tpot_s"}  # fmt: skip


__all__ = [
    "PER_REQUEST_FILE",
    "EncodedRows",
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


def write(doc: dict[str, Any], out_dir: str | Path, jobs: int = 1) -> list[Path]:
    """`results.json` plus the rendered report (Markdown, CSV, plots) in `out_dir`; `jobs`
    > 1 draws some figures in a child process (`report.render`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(document_text(doc))
    return [out / "results.json", *render(doc, out, jobs)]


def document_text(doc: Any) -> str:
    """`doc` as `results.json` holds it: objects one key a line (indent 1), and every array
    of numbers, strings or such arrays on one line (a timeline, per-request hits): the same
    JSON as `json.dumps(doc, indent=1)`, without a line per number."""
    return _text(doc, 0) + "\n"


def _text(x: Any, depth: int) -> str:
    if isinstance(x, dict):
        if not x:
            return "{}"
        pad = " " * (depth + 1)
        items = [f"{pad}{json.dumps(str(k))}: {_text(v, depth + 1)}" for k, v in x.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    if isinstance(x, list | tuple) and not _flat(x):
        if not x:
            return "[]"
        pad = " " * (depth + 1)
        return "[\n" + ",\n".join(pad + _text(v, depth + 1) for v in x) + "\n" + " " * depth + "]"
    return json.dumps(x)


def _flat(x: list | tuple) -> bool:
    """Scalars, or arrays of scalars: written on one line."""
    return all(not isinstance(v, dict | list | tuple) or (isinstance(v, list | tuple) and _scalars(v)) for v in x)


def _scalars(x: list | tuple) -> bool:
    return all(not isinstance(v, dict | list | tuple) for v in x)


#: encodes each row as `json.dumps(row, separators=(",", ":"), allow_nan=False)` does, one
#: encoder for every row (json.dumps builds a new one per call)
_ROW_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
#: a row's last key as it is encoded, and the tier keys an untiered row gets before it in a
#: document with a tiered cell (`per_request_rows`)
_REPLICA_KEY = "," + _ROW_ENCODER.encode({"replica": 0})[1:-2]
_NULL_TIER_KEYS = "," + _ROW_ENCODER.encode(dict.fromkeys(TIER_RECORD_KEYS))[1:-1]


def per_request_rows(cfg: CellConfig, records: list[dict[str, Any]], tiered: bool) -> Iterator[dict[str, Any]]:
    """The rows of one serving cell's `records` in per_request.jsonl, by `request_index`
    (its line in the trace, its position in the workload's requests; a parallel sample
    shares its parent's and follows it). Every row of a file has the same keys, so the file
    loads as one table (README *Per-request results*): the cell (`backend` label,
    `capacity_tokens`, `page_size`, `replicas`, `router`: null for one replica), then every
    key of the engine's per-request record, times renamed with their unit (`TIME_KEYS`) and
    `e2e_s` (arrival to last token) after `finished_at_s`, and last the `replica` that
    served it (0 for one replica). `tiered`: some cell of the file has memory tiers; its
    records add keys (`request.TIER_RECORD_KEYS`), and every row carries them then, None in
    the other cells' rows."""
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


def _has_tiers(records: list[dict[str, Any]]) -> bool:
    """Whether a cell's records carry the tier keys (its cache had memory tiers: every
    record has all of them, `scheduler.finish`, or none)."""
    return any(TIER_RECORD_KEYS[0] in rec for rec in records)


@dataclass(frozen=True)
class EncodedRows:
    """One serving cell's lines of per_request.jsonl, encoded where the cell ran.

    A cell run in a child process (experiments/runs/cell_runs.py) sends these back instead of
    its records: the encoding (0.1 s per 12k requests) then runs beside the other cells,
    not in the parent after the last, and the records are not pickled to the parent. The
    lines are encoded as if the file had no tiered cell unless this one is (`tiered`);
    `text_in` adds the null tier keys an untiered cell's rows carry in a file with one."""

    text: str  # the lines, each ending in a newline
    tiered: bool  # the cell's records carry the tier keys

    @classmethod
    def of(cls, cfg: CellConfig, records: list[dict[str, Any]]) -> EncodedRows:
        tiered = _has_tiers(records)
        return cls("".join(_ROW_ENCODER.encode(row) + "\n" for row in per_request_rows(cfg, records, tiered)), tiered)

    def text_in(self, tiered_file: bool) -> str:
        """The lines as a file with (`tiered_file`) or without a tiered cell holds them.

        An untiered row in a tiered file has the tier keys, null, just before `replica`,
        its last key (`per_request_rows`). Inserting them there in the text is exact: JSON
        escapes every quote inside a string and a row is flat, so `,"replica":` occurs in a
        line only as that key; each line is checked to have it once."""
        if self.tiered or not tiered_file:
            return self.text
        if self.text.count(_REPLICA_KEY) != self.text.count("\n"):
            raise RuntimeError("per-request rows without exactly one replica key each: cannot add the tier keys")
        return self.text.replace(_REPLICA_KEY, _NULL_TIER_KEYS + _REPLICA_KEY)


def write_per_request(cells: list[CellConfig], results: list[dict[str, Any]], out_dir: str | Path) -> Path | None:
    """`per_request.jsonl` in `out_dir` (a run's staging folder: it is published with the
    report): every request of every serving cell, by cell then request (`per_request_rows`),
    or None when no cell ran the serving protocol. A cell's `PER_REQUEST` holds its records,
    or its rows already encoded (`EncodedRows`, from a child process)."""
    if not any(PER_REQUEST in r for r in results):
        return None
    kept = [r.get(PER_REQUEST) for r in results]
    tiered = any(rows.tiered if isinstance(rows, EncodedRows) else _has_tiers(rows) for rows in kept if rows)
    path = Path(out_dir) / PER_REQUEST_FILE
    with path.open("w") as fh:
        for cfg, rows in zip(cells, kept, strict=True):
            if rows is None:
                continue  # replay only
            if isinstance(rows, EncodedRows):
                fh.write(rows.text_in(tiered))
            else:
                for row in per_request_rows(cfg, rows, tiered):
                    fh.write(_ROW_ENCODER.encode(row) + "\n")
    return path
