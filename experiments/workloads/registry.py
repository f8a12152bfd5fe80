"""Workloads by name: `make_workload(name, seed, **knobs)`, `describe_workloads()` for the CLI.

Every entry is a callable `(seed=0, *, knob=default, ...) -> Workload`; its keyword
parameters are its knobs and its docstring documents them. Loaders take the seed and
ignore it. Knob values given as strings (from a command line) are converted to the type
of the knob's default (`"inf"` is a float, `"65,65"` a tuple of ints, `"true"` a bool).
`make_workload` refuses, as a `WorkloadError`, a seed outside 0..2**63-1, a workload with no
requests and a request whose arrival or think time is not finite.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from experiments.workloads.chat import multi_turn_chat
from experiments.workloads.generators import Workload
from experiments.workloads.jsonl import load_jsonl
from experiments.workloads.kshot import kshot
from experiments.workloads.mooncake import MOONCAKE_BLOCK, load_mooncake
from experiments.workloads.nosharing import no_sharing
from experiments.workloads.shared_doc import shared_doc_qa
from experiments.workloads.sharegpt import BUILTIN, load_sharegpt, tokenizer_for
from experiments.workloads.tenants import multi_tenant
from experiments.workloads.text import load_text
from experiments.workloads.tracefile import show

DEFAULT_MOONCAKE_TRACE = str(Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_2000.jsonl")
REQUIRED = "<required>"


class WorkloadError(ValueError):
    """An unknown workload, an unknown or missing knob, or a knob value of the wrong type."""


def mooncake(
    seed: int = 0, *, path: str = DEFAULT_MOONCAKE_TRACE, limit: int | None = None, block_size: int = MOONCAKE_BLOCK
) -> Workload:
    """Mooncake JSONL trace (FAST'25 format): block hash ids expand to token ids.

    Knobs:
    - path (the shipped 2000-request conversation slice): the trace file (.jsonl or .jsonl.gz).
    - limit (None): read only the first limit requests.
    - block_size (512): tokens per hash id, 512 in the FAST'25 traces.
    """
    return Workload(
        "mooncake",
        load_mooncake(path, limit, block_size),
        config={"path": str(path), "limit": limit, "block_size": block_size},
    )


def jsonl(seed: int = 0, *, path: str, limit: int | None = None) -> Workload:
    """JSONL of token ids, with optional salts, LoRA ids and declared prefixes (see jsonl.py).

    Knobs:
    - path (required): the trace file.
    - limit (None): read only the first limit requests.
    """
    return load_jsonl(path, limit)


def text(seed: int = 0, *, path: str, tokenizer: str, limit: int | None = None) -> Workload:
    """JSONL of text prompts tokenized by a local tokenizer, never downloaded (see text.py).

    Knobs:
    - path (required): the text trace file (.jsonl or .jsonl.gz).
    - tokenizer (required): a tokenizer.json file, a local transformers tokenizer directory, or
      builtin (the built-in deterministic tokenizer, builtin_tokenizer.py).
    - limit (None): read only the first limit requests.
    """
    return load_text(path, tokenizer_for(tokenizer, None)[0] if tokenizer == BUILTIN else tokenizer, limit)


def sharegpt(
    seed: int = 0,
    *,
    path: str,
    tokenizer: str = BUILTIN,
    vocab_size: int | None = None,
    limit: int | None = None,
    rate: float = 1.0,
    think_time: float = 5.0,
) -> Workload:
    """ShareGPT-format conversations (a JSON list), every answer a request (see sharegpt.py).

    Knobs:
    - path (required): the file (.json, .json.gz; .jsonl or .jsonl.gz: one conversation per line).
    - tokenizer ("builtin"): a local tokenizer.json (needs the tokenizers extra) or transformers
      directory; builtin = the built-in deterministic tokenizer, which needs nothing.
    - vocab_size (None): the built-in tokenizer's vocabulary (None: 32000).
    - limit (None): read only the first limit conversations.
    - rate (1.0): Poisson rate of conversation starts, conversations/s (inf: all at 0).
    - think_time (5.0): mean seconds (exponential) between a turn and the next.
    """
    return load_sharegpt(
        path, tokenizer, seed=seed, limit=limit, rate=rate, think_time=think_time, vocab_size=vocab_size
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared_doc_qa": shared_doc_qa,
    "multi_turn_chat": multi_turn_chat,
    "kshot": kshot,
    "multi_tenant": multi_tenant,
    "no_sharing": no_sharing,
}
try:  # sampling.py (parallel sampling and beam search) is written separately
    from experiments.workloads.decoding import beam_search, parallel_sampling
except ModuleNotFoundError as exc:
    if exc.name != "experiments.workloads.sampling":
        raise
else:
    WORKLOADS.update(parallel_sampling=parallel_sampling, beam_search=beam_search)
WORKLOADS.update(mooncake=mooncake, jsonl=jsonl, text=text, sharegpt=sharegpt)


def knobs_of(name: str) -> dict[str, Any]:
    """Knob -> default (`REQUIRED` when it has none) of workload `name`."""
    params = inspect.signature(_get(name)).parameters
    return {
        k: (REQUIRED if p.default is inspect.Parameter.empty else p.default)
        for k, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def make_workload(name: str, seed: int = 0, **knobs: Any) -> Workload:
    """Workload `name` built with `seed` and `knobs` (the rest at their defaults)."""
    valid = knobs_of(name)
    unknown = sorted(set(knobs) - set(valid))
    if unknown:
        raise WorkloadError(f"workload {name!r} has no knob(s) {', '.join(unknown)}; its knobs: {', '.join(valid)}")
    missing = [k for k, d in valid.items() if d is REQUIRED and k not in knobs]
    if missing:
        raise WorkloadError(f"workload {name!r} needs knob(s) {', '.join(missing)}")
    check_seed(seed)
    typed = {k: coerce_knob(name, k, v, valid[k]) for k, v in knobs.items()}
    workload = WORKLOADS[name](seed, **typed)
    _check_requests(workload, knobs)
    return workload


MAX_SEED = 2**63 - 1


def check_seed(seed: Any) -> int:
    """`seed` if it is an int in 0..2**63-1; a `WorkloadError` saying so otherwise.

    numpy takes any non-negative int, but torch's `manual_seed` (the model executor) fails
    past 64 bits and a negative one means nothing to numpy: one range, checked before any
    work."""
    if not (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED):
        raise WorkloadError(f"seed must be an int in 0..2**63-1, got {show(seed)}")
    return int(seed)


def _check_requests(workload: Workload, knobs: dict[str, Any]) -> None:
    """No run starts on an empty workload (every metric would be 0/0) or on an arrival time
    that never comes (NaN or inf: the serving clock would wait for it forever)."""
    if not workload.requests:
        given = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "default knobs"
        raise WorkloadError(f"workload {workload.name!r} has no requests ({given}): nothing to measure")
    for spec in workload.requests:
        if not (math.isfinite(spec.arrival) and spec.arrival >= 0 and math.isfinite(spec.think_time)):
            raise WorkloadError(
                f"workload {workload.name!r}: request {spec.request_id!r} arrives at {spec.arrival!r} s "
                f"(think time {spec.think_time!r} s); times must be finite and non-negative"
            )


def describe_workloads() -> dict[str, dict[str, Any]]:
    """Name -> {"summary": docstring first line, "knobs": {knob: default}, "help": {knob: text}}."""
    out = {}
    for name, fn in WORKLOADS.items():
        doc = inspect.getdoc(fn) or ""
        out[name] = {"summary": doc.split("\n", 1)[0], "knobs": knobs_of(name), "help": _knob_help(doc)}
    return out


def _get(name: str) -> Callable[..., Workload]:
    try:
        return WORKLOADS[name]
    except (KeyError, TypeError):
        raise WorkloadError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}") from None


def _knob_help(doc: str) -> dict[str, str]:
    """Knob -> its text, from docstring bullets `- name (default)[, name (default)]: text`."""
    helps: dict[str, str] = {}
    names: list[str] = []
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.startswith("- "):
            head, _, body = stripped[2:].partition("): ")
            names = re.findall(r"(?:^|, )(\w+) \(", head + ")")
            for n in names:
                helps[n] = body
        elif names and line.startswith("  ") and stripped:
            for n in names:
                helps[n] += " " + stripped
        else:
            names = []
    return helps


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def coerce_knob(name: str, knob: str, value: Any, default: Any) -> Any:
    """A command-line string converted to the type of the knob's default; other values as given.
    `name` and `knob` only name what was wrong in the error. Backend options follow the same
    rules (experiments/runs/backend_options.py)."""
    if not isinstance(value, str) or default is REQUIRED or isinstance(default, str):
        return value
    try:
        if isinstance(default, bool):
            low = value.strip().lower()
            if low not in _TRUE | _FALSE:
                raise ValueError
            return low in _TRUE
        if isinstance(default, int) or default is None:  # None defaults are optional ints (limit)
            return None if value.strip().lower() == "none" else int(value)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, tuple):
            return tuple(int(x) for x in value.split(","))
    except ValueError:
        kind = "a comma-separated list of ints" if isinstance(default, tuple) else type(default).__name__
        raise WorkloadError(f"workload {name!r}: knob {knob} expects {kind}, got {value!r}") from None
    return value
