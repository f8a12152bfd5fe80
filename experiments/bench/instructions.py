"""Instructions executed inside cache calls per request: the speed rows in a unit the machine cannot move.

    python -m experiments.bench.instructions [--rows apc16 radix1 radix16 apc1] [--limit N]
        [--baseline DIR] [--output bench-results/instructions.json]

Why: the speed rows (`speed_targets`) read the thread's CPU time, and on the development
machine the same code's figures moved by up to 4x between sessions (the issue's baseline
commit `f3ed196` read 36 us on the radix page-16 row when the issue was filed, 152.6 us on
2026-12-01 at 22:40), and by +-30% between runs of one session. Instruction counts do not
move: the same code on the same requests counts the same instructions to within a few in
a million.

How: each row's replay (the one `speed_targets` times: the same requests, prompts built
before any region, the checkout's own `CacheClient` and `replay`) runs in a child process
under `valgrind --tool=callgrind --collect-atstart=no`, with a clock whose every read
toggles collection (`CALLGRIND_TOGGLE_COLLECT`, from a five-line C library built with gcc
at first use, in a temporary folder). So what is counted is exactly what `speed_targets`
times: the instructions inside the timed regions, each with its share of the clock call's
own path, which a run of empty regions measures (`clock_instructions_per_request`, as
`speed_targets` reports its clock's share). The run is deterministic: OpenBLAS's idle
threads would spin inside the regions (`OPENBLAS_NUM_THREADS=1`), string hashes are fixed
(`PYTHONHASHSEED=0`) and address-space randomisation is off (`setarch -R`, where present).

What an instruction count is not: a time. Under valgrind a `rep movsb` copy counts one
instruction per byte, a numpy call a few hundred; the ratio between two commits on one row
is the figure to read (`--baseline DIR`: another checkout, e.g. `git worktree add /tmp/base
f3ed196`, counted the same way right after, with `speedup` its count over this one's).

Needs valgrind and gcc with valgrind's headers (`valgrind/callgrind.h`); refused before any
work without them. A row's full replay takes one to a few minutes under valgrind (the
issue's code on the apc page-1 row about ten): `--limit` counts only its first N requests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from experiments.bench import RESULTS, HelpFormatter, write_output
from experiments.bench.speed_targets import ROOT, ROWS, TRACE, Row, check_baseline, checkout_commit, report_header

#: the clock of the child: every call toggles callgrind's collection, `region_reads` counts them
TOGGLE_C = r"""#include <valgrind/callgrind.h>
static double reads = 0;
double region_clock(void) { CALLGRIND_TOGGLE_COLLECT; reads += 1; return reads; }
double region_reads(void) { return reads; }
"""

#: what runs under valgrind, in the measured checkout (its own code first on the path): the
#: row's replay on that checkout's CacheClient with the toggling clock ("row"), or as many
#: empty regions as CacheClient times them ("empty"); prints the requests and clock reads
CHILD = """
import ctypes, json, sys
sys.path.insert(0, ".")
mode, lib_path, backend, page_size, limit, capacity, trace, empty = json.loads(sys.argv[1])
lib = ctypes.CDLL(lib_path)
clock, reads = lib.region_clock, lib.region_reads
clock.restype = reads.restype = ctypes.c_double
clock.argtypes = reads.argtypes = []
if mode == "empty":
    seconds = 0.0
    for _ in range(empty):
        t0 = clock()
        seconds += clock() - t0
    requests = 0
else:
    import numpy as np
    from cachelib import create_cache
    from experiments.engine import replay
    from experiments.engine.cache_client import CacheClient
    from experiments.workloads.mooncake import load_mooncake
    from experiments.workloads.spec import RequestSpec
    specs = [RequestSpec(s.request_id, np.ascontiguousarray(s.prompt), s.output_len, s.arrival)
             for s in load_mooncake(trace, limit)]
    cache = create_cache(backend, num_pages=capacity // page_size, page_size=page_size)
    replay(CacheClient(cache, clock=clock), specs)
    requests = len(specs)
print(json.dumps({"requests": requests, "clock_reads": int(reads())}))
"""

#: regions of the empty run (its count per region is steady well before this)
EMPTY_REGIONS = 2000


class Callgrind:
    """Runs `CHILD` under callgrind with the toggling clock, built once into a temporary folder."""

    def __init__(self, folder: Path) -> None:
        missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
        if missing:
            raise RuntimeError(f"instruction counts need {' and '.join(missing)} (not found on PATH)")
        self.folder = folder
        source = folder / "toggle.c"
        source.write_text(TOGGLE_C)
        self.lib = folder / "libtoggle.so"
        built = subprocess.run(
            ["gcc", "-shared", "-fPIC", "-O2", "-o", str(self.lib), str(source)], capture_output=True, text=True
        )
        if built.returncode != 0:
            raise RuntimeError(f"could not build the callgrind clock (valgrind's headers missing?):\n{built.stderr}")
        self.prefix = ["setarch", "-R"] if shutil.which("setarch") else []

    def count(self, checkout: Path, mode: str, row: Row, limit: int) -> dict:
        """Instructions collected inside the regions of one child run in `checkout`."""
        out_file = self.folder / f"callgrind.{mode}.out"
        args = json.dumps([mode, str(self.lib), row.backend, row.page_size, limit, row.capacity_tokens, str(TRACE),
                           EMPTY_REGIONS])  # fmt: skip
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONHASHSEED="0")
        done = subprocess.run(
            [*self.prefix, "valgrind", "--tool=callgrind", "--collect-atstart=no",
             f"--callgrind-out-file={out_file}", sys.executable, "-c", CHILD, args],
            cwd=checkout, env=env, capture_output=True, text=True,
        )  # fmt: skip
        collected = re.findall(r"Collected\s*:\s*(\d+)", done.stderr)
        if done.returncode != 0 or not collected:
            raise RuntimeError(f"the {mode} run in {checkout} failed under valgrind:\n{done.stderr[-2000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        return {**result, "instructions": int(collected[-1])}


def count_row(grind: Callgrind, checkout: Path, row: Row, limit: int) -> dict:
    """`row`'s replay of its first `limit` requests in `checkout`: instructions per request
    inside the cache calls, and the clock's share of them (regions per request x an empty
    region's count)."""
    run = grind.count(checkout, "row", row, limit)
    empty = grind.count(checkout, "empty", row, limit)
    per_region = empty["instructions"] / (empty["clock_reads"] / 2)
    regions = run["clock_reads"] / 2 / run["requests"]
    return {
        "checkout": str(checkout),
        "commit": checkout_commit(checkout),
        "requests": run["requests"],
        "instructions": run["instructions"],
        "instructions_per_request": round(run["instructions"] / run["requests"]),
        "timed_regions_per_request": round(regions, 3),
        "empty_region_instructions": round(per_region),
        "clock_instructions_per_request": round(regions * per_region),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m experiments.bench.instructions",
        description=__doc__.splitlines()[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS), help="speed rows to count")
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help="count only each row's first N requests, at most the row's own count (default: that count, as speed_targets "
        "replays; the JSON gives each row's limit)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help="another checkout counted the same way right after each row, with the speedup (default: none)",
    )
    p.add_argument("--output", type=Path, default=RESULTS / "instructions.json", help="JSON file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be >= 1")
    check_baseline(p, args.baseline)
    out = {
        **report_header("instructions", argv),
        "unit": "instructions inside cache calls per request (valgrind callgrind, deterministic)",
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        try:
            grind = Callgrind(Path(tmp))
        except RuntimeError as exc:
            p.error(str(exc))
        for name in args.rows:
            row = ROWS[name]
            limit = min(args.limit or row.limit, row.limit)
            r = {"row": name, "backend": row.backend, "page_size": row.page_size, "limit": limit,
                 "capacity_tokens": row.capacity_tokens, **count_row(grind, ROOT, row, limit)}  # fmt: skip
            print(f"{name}: {r['instructions_per_request']:,} instructions/request ({r['requests']} requests; "
                  f"the clock's share ~{r['clock_instructions_per_request']:,})")  # fmt: skip
            if args.baseline is not None:
                b = r["baseline"] = count_row(grind, args.baseline.resolve(), row, limit)
                r["speedup"] = round(b["instructions_per_request"] / r["instructions_per_request"], 3)
                print(f"  baseline {b['commit']}: {b['instructions_per_request']:,} instructions/request, "
                      f"speedup {r['speedup']}x")  # fmt: skip
            out["rows"].append(r)
    write_output(args.output, json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
