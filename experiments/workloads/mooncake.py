"""Loader for Mooncake JSONL traces (FAST'25 release format).

Each line: `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`;
`hash_ids` holds one id per 512-token prompt block (the FAST'25 traces' block size; another
trace may hash blocks of another size: `block_size`, 3..65,536, replaces 512 everywhere
below, and the constants scale with it), equal ids at equal positions meaning a
shared prefix. A line is rejected, naming `path:line`, unless: `timestamp` is a finite
number >= 0 (no NaN, no Infinity); `output_length` an int in 0..147,483,647 (beyond, the
engine's generated ids would leave int32); every hash id an int in 0..2**63 - 1 (int64);
`input_length` a positive int with exactly `ceil(input_length / 512)` hash ids. (The two
FAST'25 traces, conversation and synthetic, have no line failing the last rule: 12,031 and
3,993 lines checked.) Fields beyond these four are ignored.

Expansion to token ids: block k of a request, with id h, becomes the first n_k tokens of
`block_tokens(h)`, n_k = 512 except for the last block, which gets
`input_length - 512 * (len(hash_ids) - 1)` (1..512 by the rule above). For
h < `ALIAS_LIMIT` (3,906,250) that block is `h * 512 + j`, j = 0..511, the rule other tools
replaying this trace use (there written `(h * 512 + j) % 2_000_000_000`: below the limit the
modulus never acts). Above it that modulus would make h and h + 3,906,250 the same tokens, a
false hit, so larger ids get their own scheme; `block_tokens` states and proves what is
guaranteed.

A trace whose name ends in `.gz` is read through gzip (`tracefile.read_json_lines`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments.workloads.spec import RequestSpec, TraceFormatError
from experiments.workloads.tracefile import finite_nonneg, is_int, output_length, read_json_lines, show

MOONCAKE_BLOCK = 512
#: every token id of a block is below this, so never one of the engine's generated ids
TOKEN_MODULUS = 2_000_000_000
#: ids below this expand by `h * 512 + j`, unchanged from the published rule
ALIAS_LIMIT = TOKEN_MODULUS // MOONCAKE_BLOCK  # 3,906,250
#: first tokens a high id can take: the ids below TOKEN_MODULUS that are not multiples of 512
HIGH_FIRSTS = TOKEN_MODULUS - ALIAS_LIMIT  # 511 * 3,906,250 = 1,996,093,750
MAX_HASH_ID = 2**63 - 1
#: `block_size` values taken: the high-id scheme rewrites tokens 1 and 2 of a block, so a
#: block needs 3; the top keeps a block far below the token space
MIN_BLOCK, MAX_BLOCK = 3, 65_536
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def check_block_size(block_size: object) -> int:
    """`block_size` if it is an int in MIN_BLOCK..MAX_BLOCK; a ValueError saying so otherwise."""
    if not (is_int(block_size) and MIN_BLOCK <= block_size <= MAX_BLOCK):  # type: ignore[operator]
        raise ValueError(
            f"block_size must be an int in {MIN_BLOCK}..{MAX_BLOCK:,} tokens per hash id, got {show(block_size)}"
        )
    return int(block_size)  # type: ignore[arg-type]


def block_tokens(ids: np.ndarray, block_size: int = MOONCAKE_BLOCK) -> np.ndarray:
    """The 512 token ids of each block id: shape (k,) int64 -> (k, 512) int64, all in
    [0, 2_000_000_000).

    Another `block_size` B: read B for 512 below, `M // B` for ALIAS_LIMIT and
    `M - ceil(M / B)` (the non-multiples of B below M) for HIGH_FIRSTS; the guarantees hold
    as stated (the proof uses only that a first token is a multiple of B iff its id is low).
    For B = 512 the constants are the module's.

    Low ids, h < ALIAS_LIMIT: `block[j] = h * 512 + j`.
    High ids, h >= ALIAS_LIMIT: with `x = h - ALIAS_LIMIT`, `r, q = divmod(x, HIGH_FIRSTS)`,
    `f = 512 * (r // 511) + r % 511 + 1` (the r-th id below 2e9 not divisible by 512) and
    M = 2e9: `block[j] = (f + j) % M`, except `block[1] = (f + 1 + q % M) % M` and
    `block[2] = (f + 2 + q // M) % M`. (For h up to 2**63 - 1, q < 3 * M.)

    Guarantees, for ids in 0..2**63 - 1 (proof in brackets):
    1. Two different ids give different 512-token blocks; more precisely they differ within
       the first 3 tokens. [A block's first token is a multiple of 512 iff its id is low.
       Low: the first token 512h gives h. High: the first token f gives r (f -> r is the
       inverse of the enumeration of non-multiples of 512 below M, a bijection from
       [0, HIGH_FIRSTS)); then `block[1] - f - 1` and `block[2] - f - 2` mod M give
       q % M and q // M (the latter < 3 < M), hence q, hence x = q * HIGH_FIRSTS + r, hence h.
       So the first 3 tokens determine the id.]
    2. Two different ids below 2_000_000_000 = ALIAS_LIMIT + HIGH_FIRSTS differ in their
       first token, as low ids always did, so even a 1-token last block cannot be shared by
       mistake; a low id and any high id also always differ in their first token. Two high
       ids of 2e9 and more can share a first token (when x = x' mod HIGH_FIRSTS) and
       differ at token 1 or 2: only a request whose last block is 1 or 2 tokens long could
       then share 1 or 2 tokens it should not.
    3. Since every block but the last is complete, two prompts agree exactly on the blocks
       up to where their hash ids first differ (and on the shorter of two last blocks of the
       same id), then diverge within 3 tokens: no false hit beyond that.
    """
    ids = np.asarray(ids, dtype=np.int64)
    b = block_size
    alias_limit = TOKEN_MODULUS // b
    j = np.arange(b, dtype=np.int64)
    low = ids < alias_limit
    if low.all():  # the published traces: bit for bit the original rule
        return ids[:, None] * b + j
    out = np.empty((ids.size, b), dtype=np.int64)
    out[low] = ids[low, None] * b + j
    high_firsts = TOKEN_MODULUS - -(-TOKEN_MODULUS // b)  # non-multiples of b below M
    q, r = np.divmod(ids[~low] - alias_limit, high_firsts)
    first = b * (r // (b - 1)) + r % (b - 1) + 1
    high = (first[:, None] + j) % TOKEN_MODULUS
    high[:, 1] = (first + 1 + q % TOKEN_MODULUS) % TOKEN_MODULUS
    high[:, 2] = (first + 2 + q // TOKEN_MODULUS) % TOKEN_MODULUS
    out[~low] = high
    return out


class MooncakePrompt:
    """Builds a request's token ids from its hash ids on demand (a few µs, no storage)."""

    __slots__ = ("hash_ids", "input_length", "block_size")

    def __init__(self, hash_ids: tuple[int, ...], input_length: int, block_size: int = MOONCAKE_BLOCK) -> None:
        self.hash_ids = hash_ids
        self.input_length = input_length
        self.block_size = block_size

    def __call__(self) -> np.ndarray:
        ids = np.asarray(self.hash_ids, dtype=np.int64)
        b = self.block_size
        if int(ids.max()) < TOKEN_MODULUS // b:
            # low ids only (the published traces): `block_tokens`' rule `id * b + j`, every
            # token below 2e9 < 2**31, computed in int32 at once (a prompt is built per
            # request per cell; the int64 blocks and their cast cost twice as much)
            j = np.arange(b, dtype=np.int32)
            return (ids.astype(np.int32)[:, None] * np.int32(b) + j).reshape(-1)[: self.input_length]
        return block_tokens(ids, b).reshape(-1)[: self.input_length].astype(np.int32)

    def __len__(self) -> int:
        return self.input_length


def parse_mooncake_line(obj: dict, where: str, block_size: int = MOONCAKE_BLOCK) -> tuple[float, MooncakePrompt, int]:
    """(arrival seconds, prompt builder, output length) of one parsed trace line; `where`
    (`path:line`) names it in errors; `block_size` tokens per hash id."""
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    ts, n_in, n_out, hash_ids = (obj[f] for f in _FIELDS)
    seconds = finite_nonneg(ts, where, "timestamp", " of milliseconds") / 1000.0
    if not (is_int(n_in) and n_in > 0):
        raise TraceFormatError(f"{where}: input_length must be a positive int, got {show(n_in)}")
    n_out = output_length(n_out, where, "output_length")
    if not isinstance(hash_ids, list) or not hash_ids:
        raise TraceFormatError(f"{where}: hash_ids must be a non-empty list of ints in 0..2**63-1")
    for h in hash_ids:
        if not (is_int(h) and 0 <= h <= MAX_HASH_ID):
            raise TraceFormatError(f"{where}: hash_ids must be ints in 0..2**63-1 (int64), got {show(h)}")
    blocks = -(-n_in // block_size)
    if blocks != len(hash_ids):
        # a guessed expansion would invent or drop prompt tokens; the FAST'25 traces never do it
        raise TraceFormatError(
            f"{where}: input_length {n_in} needs {blocks} blocks of {block_size} tokens, "
            f"but hash_ids has {len(hash_ids)}"
            + ("" if block_size != MOONCAKE_BLOCK else " (a trace hashing blocks of another size: give its block_size)")
        )
    return seconds, MooncakePrompt(tuple(hash_ids), n_in, block_size), n_out


def load_mooncake(path: str | Path, limit: int | None = None, block_size: int = MOONCAKE_BLOCK) -> list[RequestSpec]:
    """The first `limit` requests (all if None) of a Mooncake JSONL trace (`.jsonl` or
    `.jsonl.gz`), in trace order, `block_size` tokens per hash id."""
    block_size = check_block_size(block_size)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    if limit is not None and (not is_int(limit) or limit <= 0):
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    specs: list[RequestSpec] = []
    for where, obj in read_json_lines(path):
        arrival, prompt, n_out = parse_mooncake_line(obj, where, block_size)
        specs.append(RequestSpec(f"mc-{len(specs)}", prompt, n_out, arrival))
        if limit is not None and len(specs) >= limit:
            break  # before reading on: lines past the limit are not checked
    if not specs:
        raise TraceFormatError(f"{path}: no requests in the trace")
    return specs
