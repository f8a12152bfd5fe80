"""`replay`: the sequential replay protocol alone, on a Mooncake JSONL trace.

Its flags and the fields of its JSON are a public interface (scripts read them;
tests/test_cli.py pins them): add fields, never rename or drop one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cachelib import create_cache
from experiments.cli.args import PAGE_SIZE_HELP, add_backend_options, add_config_option, options_given, positive_int
from experiments.engine import replay, unlimited_pages
from experiments.errors import InputError, UsageError
from experiments.runs import defaults
from experiments.runs.backend_options import BackendVariant, resolve_variants, split_backend_list
from experiments.runs.output_dir import check_writable_file, write_file_atomically
from experiments.workloads.mooncake import MOONCAKE_BLOCK, load_mooncake
from experiments.workloads.spec import RequestSpec


def add_parser(sub: argparse._SubParsersAction) -> None:
    rp = sub.add_parser("replay", help="sequential replay of a Mooncake JSONL trace (docs/design.md, protocols)")
    add_config_option(rp)
    rp.add_argument("--backend", required=True, help="a registered name (apc, radix, ...) or NAME[KEY=VALUE,...]")
    rp.add_argument("--trace", required=True, type=Path, help="Mooncake JSONL trace (.jsonl or .jsonl.gz)")
    rp.add_argument("--limit", type=positive_int, help="replay only the first N requests")
    rp.add_argument(
        "--mooncake-block-size",
        type=positive_int,
        default=MOONCAKE_BLOCK,
        metavar="TOKENS",
        help="tokens per hash id of the trace (the FAST'25 traces: 512)",
    )
    rp.add_argument("--page-size", type=positive_int, default=defaults.PAGE_SIZE, help=PAGE_SIZE_HELP)
    cap = rp.add_mutually_exclusive_group()
    cap.add_argument("--capacity-tokens", type=positive_int, help="KV capacity in tokens (default: unlimited)")
    cap.add_argument("--num-pages", type=positive_int, help="KV capacity in pages")
    rp.add_argument("--concurrency", type=positive_int, default=defaults.CONCURRENCY, help="requests in flight at most")
    add_backend_options(rp)
    rp.add_argument("--output", help="write the result JSON here")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    rp.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    variant = _variant(args)  # an unknown backend or option fails before the trace loads
    if args.output:
        check_writable_file(Path(args.output))  # before the replay, not after it
    requests = _load(args.trace, args.limit, args.mooncake_block_size)
    num_pages = _num_pages(args, requests)
    cache = create_cache(variant.name, num_pages=num_pages, page_size=args.page_size, **variant.options_dict())
    result = replay(cache, requests, concurrency=args.concurrency, progress=not args.no_progress)
    if result["unschedulable"] == len(requests):
        raise InputError(
            f"nothing was schedulable: every request needs more than {num_pages} pages of {args.page_size} tokens"
        )
    result["trace"] = str(args.trace)
    result["capacity"] = (
        "unlimited" if args.num_pages is None and args.capacity_tokens is None else num_pages * args.page_size
    )
    result["backend_options"] = variant.options_dict()
    _print_summary(result)
    if args.output:
        out = Path(args.output)
        write_file_atomically(out, json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


def _variant(args: argparse.Namespace) -> BackendVariant:
    specs = split_backend_list(args.backend)
    if len(specs) != 1:
        raise UsageError(f"replay takes one --backend, got {args.backend!r}")
    return resolve_variants(specs, options_given(args), [args.page_size])[0]


def _load(trace: Path, limit: int | None, block_size: int) -> list[RequestSpec]:
    try:
        return load_mooncake(trace, limit, block_size)
    except InputError:
        raise
    except (ValueError, FileNotFoundError) as exc:  # the loader's refusals: a missing or malformed trace
        raise InputError(str(exc)) from exc


def _num_pages(args: argparse.Namespace, requests: list[RequestSpec]) -> int:
    if args.num_pages is not None:
        return args.num_pages
    if args.capacity_tokens is None:
        return unlimited_pages(requests, args.page_size)
    num_pages = args.capacity_tokens // args.page_size
    if num_pages == 0:
        raise InputError(f"--capacity-tokens {args.capacity_tokens} is less than one page of {args.page_size}")
    return num_pages


def _print_summary(result: dict[str, Any]) -> None:
    print(
        f"{result['backend']}: {result['requests']} requests, page size {result['page_size']}, "
        f"{result['num_pages']} pages; hit rate {result['hit_rate']:.2%} "
        f"({result['hit_tokens']}/{result['prompt_tokens']} prompt tokens), "
        f"{result['evicted_pages']} pages evicted, {result['unschedulable']} unschedulable, "
        f"{result['us_per_request']:.0f} us/request of CPU time in cache calls"
    )
    if "hit_tokens_by_tier" in result:  # a cache with tiers below its GPU pages
        by_tier = ", ".join(f"{tier} {tokens}" for tier, tokens in result["hit_tokens_by_tier"].items())
        print(f"  hit tokens by tier: {by_tier}")
