"""A Mooncake trace made N times longer: the trace repeated, each copy with its own hash ids.

    python -m experiments.bench.repeat_trace TRACE --times 10 --output FILE

Copy c (0-based) of every line gets hash ids `h + c * (max id + 1)`, so no two copies share
a block (and no copy shares one with the original beyond copy 0, which is the original), and
timestamps `t + c * (last timestamp + 1000)`, so the copies follow one another in time and
replay order is the original order, copy after copy. Everything else is unchanged. Used to
measure memory on ten times the conversation trace (issue 12).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiments.bench import HelpFormatter


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def repeated_lines(path: str | Path, times: int) -> Iterator[dict[str, Any]]:
    """The trace's lines `times` times over, copy c with hash ids shifted by c * (max id + 1)
    and timestamps by c * (last timestamp + 1000). Reads the file once per copy (plus once
    to find the shifts), so nothing but one line is held at a time."""
    path = Path(path)
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    top = -1
    last = 0
    for obj in _lines(path):
        top = max(top, max(obj["hash_ids"]))
        last = max(last, obj["timestamp"])
    id_shift, time_shift = top + 1, last + 1000
    for c in range(times):
        for obj in _lines(path):
            yield {
                **obj,
                "timestamp": obj["timestamp"] + c * time_shift,
                "hash_ids": [h + c * id_shift for h in obj["hash_ids"]],
            }


def write_repeated(path: str | Path, times: int, output: str | Path) -> int:
    """Write `repeated_lines(path, times)` to `output` as JSONL; returns the line count."""
    n = 0
    with Path(output).open("w") as out:
        for obj in repeated_lines(path, times):
            out.write(json.dumps(obj) + "\n")
            n += 1
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.bench.repeat_trace",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument("trace", type=Path, help="Mooncake-format trace (JSONL) to repeat")
    ap.add_argument("--times", type=int, default=10, help="copies of the trace, one after another")
    ap.add_argument("--output", type=Path, required=True, help="JSONL trace file to write (required)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.times < 1:
        ap.error(f"--times must be >= 1, got {args.times}")
    n = write_repeated(args.trace, args.times, args.output)
    print(f"{args.output}: {n} lines ({args.times} copies of {args.trace})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
