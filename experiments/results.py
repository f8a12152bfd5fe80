"""The results document of a comparison: what `compare` and `sweep` write and `report` reads."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.provenance import code_version, git_commit
from experiments.report import render
from experiments.runner import CellConfig
from experiments.workloads.generators import Workload

#: CellConfig fields shared by every cell of a document, shown in the report's header
SETTINGS = ("page_size", "executor", "device", "model", "token_budget", "max_running", "ordering", "protocol", "seed")
#: what `write` puts in a report folder (glob patterns): replaced as a whole by the next run
REPORT_ENTRIES = ("results.json", "report.md", "results.csv", "*.png")


__all__ = [
    "REPORT_ENTRIES",
    "code_version",
    "command_line",
    "document",
    "git_commit",
    "write",
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
    order of the cells; report.py draws one line per label."""
    return {
        "command": command_line(argv),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "commit": git_commit(),  # of the package's own checkout, not the current directory's
        "code_version": code_version(),
        "workload": {"name": workload.name, "config": workload.config, "requests": len(workload)},
        "settings": {k: getattr(cells[0], k) for k in SETTINGS},
        "backends": backends,
        "capacities": capacities,
        "bounds": bounds,
        "cells": results,
    }


def write(doc: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """`results.json` plus the rendered report (Markdown, CSV, plots) in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    return [out / "results.json", *render(doc, out)]
