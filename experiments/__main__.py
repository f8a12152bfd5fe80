"""Command line: `python -m experiments replay|run|compare|sweep|report|workloads ...`.

Exit codes: 0 success; 1 a cell failed (its process was killed, e.g. out of memory, or it
raised an unexpected error; finished cells are kept for a rerun); 2 bad usage (a missing or
malformed option); 3 bad input (unknown backend, workload or knob, a trace that does not
exist or cannot be parsed, a capacity smaller than one request or that schedules nothing,
bad sizes or options, an output that cannot be written or is in use by another run);
130 interrupted (Ctrl-C or SIGTERM: outputs are left complete or unchanged).
"""

from __future__ import annotations

import argparse
import inspect
import json
import signal
import sys
from pathlib import Path
from typing import Any

from cachelib import create_cache, get_backend
from cachelib.errors import CacheError
from experiments.cell_pool import TasksFailed
from experiments.engine import replay, unlimited_pages
from experiments.output_dir import OutputError, check_writable_file, write_file_atomically
from experiments.workloads.mooncake import load_mooncake
from experiments.workloads.spec import TraceFormatError

EXIT_CELL_FAILED = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


class BadInput(Exception):
    """An input problem reported to the user as one line, exit code 3."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _backend_options(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Backend-specific flags that were given, checked against what the backend accepts."""
    given = {
        "eviction_policy": args.eviction_policy,
        "hash_algorithm": args.hash_algorithm,
        "verify_tokens": args.verify_tokens or None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    accepted = inspect.signature(get_backend(name).__init__).parameters
    for key in given:
        if key not in accepted:
            raise BadInput(f"backend {name!r} does not take --{key.replace('_', '-')}")
    return given


def cmd_replay(args: argparse.Namespace) -> int:
    options = _backend_options(args.backend, args)  # an unknown backend fails before the trace loads
    if args.output:
        check_writable_file(Path(args.output))  # before the replay, not after it
    requests = load_mooncake(args.trace, args.limit)
    if args.num_pages is not None:
        num_pages = args.num_pages
    elif args.capacity_tokens is not None:
        num_pages = args.capacity_tokens // args.page_size
        if num_pages == 0:
            raise BadInput(f"--capacity-tokens {args.capacity_tokens} is less than one page of {args.page_size}")
    else:
        num_pages = unlimited_pages(requests, args.page_size)
    cache = create_cache(args.backend, num_pages=num_pages, page_size=args.page_size, **options)
    result = replay(cache, requests, concurrency=args.concurrency, progress=not args.no_progress)
    if result["unschedulable"] == len(requests):
        raise BadInput(
            f"nothing was schedulable: every request needs more than {num_pages} pages of {args.page_size} tokens"
        )
    result["trace"] = str(args.trace)
    result["capacity"] = (
        "unlimited" if args.num_pages is None and args.capacity_tokens is None else num_pages * args.page_size
    )
    print(
        f"{result['backend']}: {result['requests']} requests, page size {result['page_size']}, "
        f"{result['num_pages']} pages; hit rate {result['hit_rate']:.2%} "
        f"({result['hit_tokens']}/{result['prompt_tokens']} prompt tokens), "
        f"{result['evicted_pages']} pages evicted, {result['unschedulable']} unschedulable, "
        f"{result['us_per_request']:.0f} us/request in cache calls"
    )
    if args.output:
        out = Path(args.output)
        write_file_atomically(out, json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from experiments.cli_compare import add_comparison_commands

    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_comparison_commands(sub, _positive_int)
    rp = sub.add_parser("replay", help="sequential replay of a Mooncake JSONL trace (DESIGN §6)")
    rp.add_argument("--backend", required=True, help="apc | radix | paged | none (any registered name)")
    rp.add_argument("--trace", required=True, type=Path, help="Mooncake JSONL trace")
    rp.add_argument("--limit", type=_positive_int, help="replay only the first N requests")
    rp.add_argument("--page-size", type=_positive_int, default=16)
    cap = rp.add_mutually_exclusive_group()
    cap.add_argument("--capacity-tokens", type=_positive_int, help="KV capacity in tokens (default: unlimited)")
    cap.add_argument("--num-pages", type=_positive_int, help="KV capacity in pages")
    rp.add_argument("--concurrency", type=_positive_int, default=1, help="requests in flight at most")
    rp.add_argument("--eviction-policy", help="radix: lru | lfu | fifo | mru | filo")
    rp.add_argument("--hash-algorithm", help="apc: xxh3_128 | sha256")
    rp.add_argument("--verify-tokens", action="store_true", help="apc: compare tokens on a hit")
    rp.add_argument("--output", help="write the result JSON here")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rp.set_defaults(func=cmd_replay)
    return parser


#: errors that mean the input was bad (exit 3), also when a cell raised them in a child
BAD_INPUT_ERRORS = (BadInput, CacheError, TraceFormatError, FileNotFoundError, ValueError, KeyError, OutputError)


def main(argv: list[str] | None = None) -> int:
    from experiments.cli_compare import UsageError

    args = build_parser().parse_args(argv)
    if hasattr(args, "argv"):
        args.argv = argv  # None: the report records sys.argv
    # SIGTERM ends a run the way Ctrl-C does: temporary outputs removed, children killed
    previous_term = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted: outputs were left complete or unchanged, never half-written", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as exc:
        print(f"usage error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TasksFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT if exc.raised_only(BAD_INPUT_ERRORS) else EXIT_CELL_FAILED
    except BAD_INPUT_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        signal.signal(signal.SIGTERM, previous_term)


if __name__ == "__main__":
    sys.exit(main())
