"""Whether two runs of `compare` decided the same: every number of two results.json documents,
timing and provenance aside.

    python -m experiments.bench.same_results OLD_RESULTS_JSON NEW_RESULTS_JSON [--show 40]
        [--output bench-results/same_results.json]

A speed change must leave a report's outputs as they were (issue 12: "the same outputs"):
hit rates, bounds, every serving metric on the virtual clock, every per-request series. What
legitimately differs between two runs of the same code is left out: the fields that measure
this machine's time (`TIMING_FIELDS`: cache time per request, wall seconds) and those that
say which run it was (`RUN_FIELDS`: when, by which command and commit, where the trace lay).
Floats compare exactly unless both are NaN (a document's numbers are computed, not
measured, so a change in the last digit is a change). Prints each difference with its path
in the document, writes them all as JSON to `--output`, and exits 1 if there is any, 0 if
none.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from experiments.bench import RESULTS, HelpFormatter, write_output

#: fields that measure this machine's time (they differ run to run)
TIMING_FIELDS = frozenset(
    {"cache_seconds", "us_per_request", "cache_us_per_request", "router_us_per_request", "wall_seconds"}
)
#: fields that say which run a document is (when, by what, from where)
RUN_FIELDS = frozenset({"created", "command", "commit", "code_version", "provenance", "package", "run_config", "path"})


def differences(old: Any, new: Any, path: str = "") -> list[str]:
    """Every difference between `old` and `new` outside `TIMING_FIELDS` and `RUN_FIELDS`,
    as `path: old != new` lines (a dict key missing on one side is a difference)."""
    out: list[str] = []
    _walk(old, new, path, out)
    return out


def _walk(a: Any, b: Any, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key in TIMING_FIELDS or key in RUN_FIELDS:
                continue
            if key not in a or key not in b:
                out.append(f"{path}.{key}: only in the {'new' if key not in a else 'old'} document")
                continue
            _walk(a[key], b[key], f"{path}.{key}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items != {len(b)}")
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _walk(x, y, f"{path}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    elif a != b or type(a) is not type(b):
        out.append(f"{path}: {a!r} != {b!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.same_results",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "old", type=Path, help="a results.json (e.g. `git show HEAD:reports/mooncake/results.json > old.json`)"
    )
    p.add_argument("new", type=Path, help="the results.json of the run to check")
    p.add_argument("--show", type=int, default=40, help="differences printed at most")
    p.add_argument("--output", type=Path, default=RESULTS / "same_results.json", help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    docs = []
    for f in (args.old, args.new):
        if not f.is_file():
            print(f"no results document at {f}", file=sys.stderr)
            return 2
        docs.append(json.loads(f.read_text()))
    found = differences(*docs)
    for line in found[: args.show]:
        print(line)
    print(f"{len(found)} difference(s) outside timing and run fields")
    doc = {"old": str(args.old), "new": str(args.new), "same": not found, "differences": found}
    write_output(args.output, json.dumps(doc, indent=1) + "\n")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
