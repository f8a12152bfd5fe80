"""`predict-step`: one step's predicted time for a batch, by the roofline or a measured profile.

    python -m experiments predict-step --model llama3-70b --device a100 --tp 4 \\
        --prefill-tokens 2048 --context 0 --decode-batch 64 --decode-context 2000 --executor profile --json

answers as vidur's and Dynamo's predictors do: the step's milliseconds, and its parts. The
batch is one prefill chunk of `--prefill-tokens` new tokens over `--context` cached ones,
beside `--decode-batch` decode requests with `--decode-context` tokens each.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from experiments.cli.args import device_name, model_name, positive_int
from experiments.engine.executors import CostModelExecutor, device_profile
from experiments.errors import UsageError
from experiments.report.render import sig3
from experiments.runs.sizing import model_shape
from experiments.timing.profile import load_profile, shipped_profile
from experiments.timing.profile_executor import PARTS, ProfileExecutor


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("predict-step", help="predict one step's time for a batch (roofline or measured profile)")
    p.add_argument("--model", required=True, help="a zoo model or its Hugging Face id")
    p.add_argument("--device", required=True, help="the GPU (h100, h200, a100, a100-40gb, ...)")
    p.add_argument("--tp", type=positive_int, default=1, help="GPUs in the tensor-parallel group")
    p.add_argument("--prefill-tokens", type=non_negative_int, default=0, help="new tokens of one prefill chunk")
    p.add_argument("--context", type=non_negative_int, default=0, help="tokens already cached before the chunk")
    p.add_argument("--decode-batch", type=non_negative_int, default=0, help="decode requests in the step")
    p.add_argument("--decode-context", type=non_negative_int, default=0, help="tokens each decode request has computed")
    p.add_argument(
        "--executor", choices=("cost", "profile"), default="cost", help="cost = roofline; profile = measured"
    )
    p.add_argument(
        "--profile", metavar="CSV", help="--executor profile: a table of your own (default: the shipped one)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_predict_step)


def batch_of(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """The step's items as (new tokens, start) arrays; an empty step is bad usage."""
    new, starts = [], []
    if args.prefill_tokens:
        new.append(args.prefill_tokens)
        starts.append(args.context)
    elif args.context:
        raise UsageError("--context is the prefill chunk's cached tokens: give --prefill-tokens too")
    if args.decode_batch:
        if not args.decode_context:
            raise UsageError("--decode-batch needs --decode-context (each request's computed tokens, at least 1)")
        new += [1] * args.decode_batch
        starts += [args.decode_context] * args.decode_batch
    elif args.decode_context:
        raise UsageError("--decode-context needs --decode-batch")
    if not new:
        raise UsageError("an empty step: give --prefill-tokens and/or --decode-batch")
    return np.array(new, dtype=np.int64), np.array(starts, dtype=np.int64)


def cmd_predict_step(args: argparse.Namespace) -> int:
    args.model, args.device = model_name(args.model), device_name(args.device)
    new, starts = batch_of(args)
    device = device_profile(args.device)
    if args.executor == "profile":
        table = load_profile(args.profile) if args.profile else shipped_profile(args.model, args.device)
        ex = ProfileExecutor(table, device, args.tp, model=args.model)
        parts = ex.parts(new, starts)
        source = ex.describe()
    else:
        if args.profile:
            raise UsageError("--profile is for --executor profile")
        cost = CostModelExecutor(model_shape(args.model, args.tp), device)
        total = cost.batch_seconds(new, starts)
        comm = cost.all_reduce_seconds(int(new.sum()))
        parts = {
            "compute_or_memory": total - comm - device.step_overhead_s,
            "all_reduce": comm,
            "overhead": device.step_overhead_s,
        }
        source = f"roofline on {device.name} (flops efficiency {device.flops_efficiency:g}, bandwidth efficiency {device.bandwidth_efficiency:g})"
    step_ms = 1e3 * sum(parts.values())
    out = {
        "model": args.model,
        "device": args.device,
        "tp": args.tp,
        "executor": args.executor,
        "batch": {
            "prefill_tokens": args.prefill_tokens,
            "context": args.context,
            "decode_batch": args.decode_batch,
            "decode_context": args.decode_context,
        },
        "step_ms": step_ms,
        "parts_ms": {k: 1e3 * v for k, v in parts.items()},
        "source": source,
    }
    if args.json:
        print(json.dumps(out))
    else:
        order = [p for p in PARTS if p in parts] + [p for p in parts if p not in PARTS]
        print(f"{args.model} on {args.tp} x {args.device}, {args.executor}: {sig3(step_ms)} ms")
        for name in order:
            print(f"  {name}: {sig3(1e3 * parts[name])} ms")
        print(f"  ({source})")
    return 0
