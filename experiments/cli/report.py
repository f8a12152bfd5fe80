"""`report`: re-render Markdown, plots and CSV from a results JSON (the per_request.jsonl
beside it goes along unchanged)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from experiments.errors import InputError
from experiments.report.render import load
from experiments.report.results import PER_REQUEST_FILE, REPORT_ENTRIES, write
from experiments.runs.output_dir import OutputLock, StagedDir, check_replaceable, check_writable_dir, link_or_copy


def add_parser(sub: argparse._SubParsersAction) -> None:
    rep = sub.add_parser("report", help="re-render Markdown, plots and CSV from a results JSON")
    rep.add_argument("results", help="results.json or the folder holding it")
    rep.add_argument("--output-dir", help="where to write the report (default: the folder of the results)")
    rep.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    results = _load(Path(args.results))
    source = Path(args.results)
    out_dir = Path(args.output_dir) if args.output_dir else (source if source.is_dir() else source.parent)
    check_writable_dir(out_dir)
    check_replaceable(out_dir, "results.json")
    # rendered in place or elsewhere, the folder is swapped in whole like compare's, and
    # holds the results it was drawn from, with their per-request file (never another run's)
    with OutputLock(out_dir), StagedDir(out_dir, owned=REPORT_ENTRIES) as stage:
        names = [p.name for p in write(results, stage.path)]
        rows = (source if source.is_dir() else source.parent) / PER_REQUEST_FILE
        if (source.is_dir() or source.name == "results.json") and rows.is_file():
            link_or_copy(rows, stage.path / PER_REQUEST_FILE)
            names.append(PER_REQUEST_FILE)
        stage.publish()
    print("wrote " + ", ".join(str(out_dir / n) for n in names))
    return 0


def _load(path: Path) -> dict[str, Any]:
    try:
        return load(path)
    except FileNotFoundError as exc:
        raise InputError(str(exc)) from None
    except ValueError as exc:  # not JSON
        raise InputError(f"{path}: not a results JSON ({exc})") from None
