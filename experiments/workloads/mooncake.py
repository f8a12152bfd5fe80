"""Loader for Mooncake JSONL traces (FAST'25 release format).

Each line: `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`;
`hash_ids` holds one id per 512-token prompt block, equal ids at equal positions meaning a
shared prefix. Expansion to token ids (shared with other tools replaying this trace): block
number k with id h becomes `(h * 512 + j) % 2_000_000_000` for j in 0..n_k-1, where
n_k = 512 except for the last block, which gets `input_length - 512 * (len - 1)` tokens
clipped to 1..512.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from experiments.workloads.spec import RequestSpec, TraceFormatError

MOONCAKE_BLOCK = 512
TOKEN_MODULUS = 2_000_000_000
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class MooncakePrompt:
    """Builds a request's token ids from its hash ids on demand (a few µs, no storage)."""

    __slots__ = ("hash_ids", "input_length")

    def __init__(self, hash_ids: tuple[int, ...], input_length: int) -> None:
        self.hash_ids = hash_ids
        self.input_length = input_length

    def __call__(self) -> np.ndarray:
        ids = np.asarray(self.hash_ids, dtype=np.int64)
        last = min(max(self.input_length - MOONCAKE_BLOCK * (len(ids) - 1), 1), MOONCAKE_BLOCK)
        blocks = (ids[:, None] * MOONCAKE_BLOCK + np.arange(MOONCAKE_BLOCK, dtype=np.int64)) % TOKEN_MODULUS
        tokens = blocks.reshape(-1)[: MOONCAKE_BLOCK * (len(ids) - 1) + last]
        return tokens.astype(np.int32)

    def __len__(self) -> int:
        last = min(max(self.input_length - MOONCAKE_BLOCK * (len(self.hash_ids) - 1), 1), MOONCAKE_BLOCK)
        return MOONCAKE_BLOCK * (len(self.hash_ids) - 1) + last


def _nonneg_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_mooncake_line(line: str, where: str) -> tuple[float, MooncakePrompt, int]:
    """(arrival seconds, prompt builder, output length) of one trace line; `where` names it in errors."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    ts, n_in, n_out, hash_ids = (obj[f] for f in _FIELDS)
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
        raise TraceFormatError(f"{where}: timestamp must be a non-negative number, got {ts!r}")
    if not _nonneg_int(n_in) or n_in == 0:
        raise TraceFormatError(f"{where}: input_length must be a positive int, got {n_in!r}")
    if not _nonneg_int(n_out):
        raise TraceFormatError(f"{where}: output_length must be a non-negative int, got {n_out!r}")
    if not isinstance(hash_ids, list) or not hash_ids or not all(_nonneg_int(h) for h in hash_ids):
        raise TraceFormatError(f"{where}: hash_ids must be a non-empty list of non-negative ints")
    return ts / 1000.0, MooncakePrompt(tuple(hash_ids), n_in), n_out


def load_mooncake(path: str | Path, limit: int | None = None) -> list[RequestSpec]:
    """The first `limit` requests (all if None) of a Mooncake JSONL trace, in trace order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    specs: list[RequestSpec] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(specs) >= limit:
                break
            if not line.strip():
                continue
            arrival, prompt, n_out = parse_mooncake_line(line, f"{path}:{lineno}")
            specs.append(RequestSpec(f"mc-{len(specs)}", prompt, n_out, arrival))
    if not specs:
        raise TraceFormatError(f"{path}: no requests in the trace")
    return specs
