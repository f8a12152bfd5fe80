"""Loader for our own JSONL trace of token ids.

One JSON object per line; blank lines are skipped. A *request* line:

    {"prompt": [1, 2, 3], "output_len": 16, "arrival": 0.5, "cache_salt": "a",
     "lora_id": 2, "prefix_id": 1, "id": "r7"}

- `prompt` (required): non-empty list of token ids, ints in [0, 1_999_999_999] (ids from
  2_000_000_000 up are the engine's generated tokens, which no prompt may match).
- `output_len` (required): tokens to generate, int in 0..147,483,647 (so the generated ids
  stay in int32).
- `arrival` (optional, default 0.0): arrival time in seconds, a finite number >= 0 (no
  `NaN`, `Infinity` or `1e400`, which Python's json would otherwise accept).
- `cache_salt` (optional): string; isolates the request's KV (per tenant).
- `lora_id` (optional): int in 0..2**63 - 1; the adapter, part of every block's key.
- `prefix_id` (optional): int >= 0 naming a declared prefix the prompt starts with.
- `id` (optional, default "jsonl-<index>"): the request id, a unique string.

A *prefix* line declares a shared prefix that requests name by `prefix_id`:

    {"prefix_id": 1, "prefix": [1, 2], "cache_salt": "a", "lora_id": 2}

(`cache_salt`/`lora_id` optional: the keys its KV is computed under; requests naming it must
carry the same.) A prefix may be declared after the requests that use it. Any other field
is an error (a typo should not be silently ignored). The file must be UTF-8. Requests keep
file order. Errors raise `TraceFormatError` naming `path:line`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from cachelib.types import ExtraKeys
from experiments.workloads.generators import Workload
from experiments.workloads.spec import RequestSpec, TraceFormatError
from experiments.workloads.tracefile import (
    MAX_PROMPT_TOKEN,
    finite_nonneg,
    is_int,
    output_length,
    read_json_lines,
    show,
)

MAX_LORA_ID = 2**63 - 1
REQUEST_FIELDS = ("prompt", "output_len", "arrival", "cache_salt", "lora_id", "prefix_id", "id")
PREFIX_FIELDS = ("prefix_id", "prefix", "cache_salt", "lora_id")


def read_objects(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`path:line`, object) for every non-blank line; raises on bytes that are not UTF-8,
    bad or non-strict JSON (NaN, Infinity) or a non-object (see `tracefile`)."""
    return read_json_lines(path)


def check_fields(obj: dict[str, Any], where: str, allowed: tuple[str, ...], required: tuple[str, ...]) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise TraceFormatError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    missing = [f for f in required if f not in obj]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")


def token_ids(value: object, where: str, field: str) -> np.ndarray:
    """A non-empty JSON list of ids in [0, MAX_PROMPT_TOKEN] as int32."""
    if not isinstance(value, list) or not value or not all(is_int(t) and 0 <= t <= MAX_PROMPT_TOKEN for t in value):
        raise TraceFormatError(
            f"{where}: {field} must be a non-empty list of token ids (ints in 0..{MAX_PROMPT_TOKEN:_}; "
            "larger ids are the engine's generated tokens)"
        )
    return np.asarray(value, dtype=np.int32)


def extra_keys(obj: dict[str, Any], where: str) -> ExtraKeys:
    salt, lora = obj.get("cache_salt"), obj.get("lora_id")
    if salt is not None and not isinstance(salt, str):
        raise TraceFormatError(f"{where}: cache_salt must be a string, got {salt!r}")
    if lora is not None and not (is_int(lora) and 0 <= lora <= MAX_LORA_ID):  # hashed as 8 bytes
        raise TraceFormatError(f"{where}: lora_id must be an int in 0..2**63-1, got {show(lora)}")
    return ExtraKeys(cache_salt=salt, lora_id=lora)


def prefix_id_of(obj: dict[str, Any], where: str) -> int | None:
    pid = obj.get("prefix_id")
    if pid is not None and not (is_int(pid) and pid >= 0):
        raise TraceFormatError(f"{where}: prefix_id must be a non-negative int, got {show(pid)}")
    return pid


def request_meta(obj: dict[str, Any], where: str, index: int) -> dict[str, Any]:
    """The RequestSpec fields of a request line other than its prompt."""
    rid = obj.get("id", f"jsonl-{index}")
    n_out = output_length(obj.get("output_len"), where, "output_len")
    arrival = finite_nonneg(obj.get("arrival", 0.0), where, "arrival", " of seconds")
    if not isinstance(rid, str) or not rid:
        raise TraceFormatError(f"{where}: id must be a non-empty string, got {rid!r}")
    return {
        "request_id": rid,
        "output_len": n_out,
        "arrival": arrival,
        "extra": extra_keys(obj, where),
        "prefix_id": prefix_id_of(obj, where),
    }


class TraceBuilder:
    """Collects requests and declared prefixes, checking what spans lines (ids, prefixes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.requests: list[RequestSpec] = []
        self.where: dict[str, str] = {}
        self.prefixes: dict[int, np.ndarray] = {}
        self.prefix_extra: dict[int, ExtraKeys] = {}

    def add_request(self, prompt: np.ndarray, meta: dict[str, Any], where: str) -> None:
        rid = meta["request_id"]
        if rid in self.where:
            raise TraceFormatError(f"{where}: duplicate id {rid!r} (first at {self.where[rid]})")
        self.where[rid] = where
        self.requests.append(RequestSpec(prompt_source=prompt, **meta))

    def add_prefix(self, pid: int, tokens: np.ndarray, extra: ExtraKeys, where: str) -> None:
        if pid in self.prefixes:
            raise TraceFormatError(f"{where}: prefix_id {pid} declared twice")
        self.prefixes[pid] = tokens
        self.prefix_extra[pid] = extra

    def build(self, name: str, config: dict[str, Any]) -> Workload:
        if not self.requests:
            raise TraceFormatError(f"{self.path}: no requests in the trace")
        for spec in self.requests:
            pid, where = spec.prefix_id, self.where[spec.request_id]
            if pid is None:
                continue
            if pid not in self.prefixes:
                raise TraceFormatError(f"{where}: prefix_id {pid} is not declared in the file")
            pre, prompt = self.prefixes[pid], spec.prompt
            if prompt.size < pre.size or not np.array_equal(prompt[: pre.size], pre):
                raise TraceFormatError(f"{where}: prompt does not start with declared prefix {pid}")
            if spec.extra != self.prefix_extra[pid]:
                raise TraceFormatError(f"{where}: cache_salt/lora_id differ from those of prefix {pid}")
        return Workload(name, self.requests, self.prefixes, config, self.prefix_extra)


def open_trace(path: str | Path, limit: int | None) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    if limit is not None and (not is_int(limit) or limit <= 0):
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    return path


def load_jsonl(path: str | Path, limit: int | None = None) -> Workload:
    """The first `limit` requests (all if None) of a token-id JSONL trace, in file order.

    Prefix lines are read in the whole file, whatever `limit` is.
    """
    path = open_trace(path, limit)
    trace = TraceBuilder(path)
    for where, obj in read_objects(path):
        if "prefix" in obj:
            check_fields(obj, where, PREFIX_FIELDS, ("prefix_id", "prefix"))
            pid = prefix_id_of(obj, where)
            trace.add_prefix(pid, token_ids(obj["prefix"], where, "prefix"), extra_keys(obj, where), where)
        elif limit is None or len(trace.requests) < limit:
            check_fields(obj, where, REQUEST_FIELDS, ("prompt", "output_len"))
            meta = request_meta(obj, where, len(trace.requests))
            trace.add_request(token_ids(obj["prompt"], where, "prompt"), meta, where)
    return trace.build("jsonl", {"path": str(path), "limit": limit})


def dump_jsonl(workload: Workload, path: str | Path) -> None:
    """Write `workload` in this format (prefixes first), so a generated workload can be saved."""
    with Path(path).open("w") as fh:
        for pid, tokens in workload.declared_prefixes.items():
            extra = workload.extra_of_prefix(pid)
            obj: dict[str, Any] = {"prefix_id": pid, "prefix": tokens.tolist()}
            obj.update(_extra_fields(extra))
            fh.write(json.dumps(obj) + "\n")
        for spec in workload.requests:
            obj = {
                "id": spec.request_id,
                "prompt": spec.prompt.tolist(),
                "output_len": spec.output_len,
                "arrival": spec.arrival,
            }
            obj.update(_extra_fields(spec.extra))
            if spec.prefix_id is not None:
                obj["prefix_id"] = spec.prefix_id
            fh.write(json.dumps(obj) + "\n")


def _extra_fields(extra: ExtraKeys) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if extra.cache_salt is not None:
        out["cache_salt"] = extra.cache_salt
    if extra.lora_id is not None:
        out["lora_id"] = extra.lora_id
    return out
