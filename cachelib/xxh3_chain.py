"""The `xxh3_128` byte chain of a call's blocks in one compiled loop (numba).

`BlockHasher` (cachelib/hashing.py) chains `H_i = xxh3_128(H_{i-1} || tokens_i || suffix)`,
one call of the `xxhash` package per block: at page 16 about 90 ns a block, ~80 µs for a
13k-token prompt, the largest single cost of apc's prompt path. This module computes the
same digests for all of a call's blocks in one numba-compiled loop (~19 ns a block), with
XXH3-128 written out for the input lengths a block has: 17 to 240 bytes (every page size up
to 56 with no extra keys), a multiple of 4 bytes (the tokens are int32, the parent 16
bytes; a suffix of other lengths, e.g. a `lora_id` key, takes the package). The `xxhash`
package stays the reference: `tests/test_xxh3_chain.py` compares the two digest for digest
over every page size and suffix length the kernel takes, and apc's decisions with and
without it.

numba is the `fast` extra (`make setup` installs it): a wheel from the package registry, no
compiler. Without it `BlockHasher` uses the package alone (`kernel="auto"`); importing this
module imports numba, so only `BlockHasher` does, and only when it chooses this kernel.

The algorithm is XXH3's 128-bit variant with the default secret and seed 0, as specified by
xxHash 0.8 (`XXH3_len_17to128_128b`, `XXH3_len_129to240_128b`); the digest is its
canonical form (the high half, then the low half, each big-endian), as
`xxhash.xxh3_128_digest` returns it.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types, uint32, uint64

from cachelib.errors import InvalidRequestError

#: the first 144 bytes of XXH3's default secret (`kSecret`, a constant of the algorithm):
#: inputs of up to 240 bytes read no further than byte 135
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1c"
    "ded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea3"
    "71644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d"
    "8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb"
)
#: the secret as little-endian 64-bit words at every byte offset (the 129..240 path reads
#: it at offsets that are not multiples of 8)
_SECRET_WORDS = np.array(
    [int.from_bytes(_SECRET[o : o + 8], "little") for o in range(len(_SECRET) - 7)], dtype=np.uint64
)

_P1 = uint64(0x9E3779B185EBCA87)
_P2 = uint64(0xC2B2AE3D27D4EB4F)
_P4 = uint64(0x85EBCA77C2B2AE63)
_MX = uint64(0x165667919E3779F9)
_LOW32 = uint64(0xFFFFFFFF)

#: the block lengths the kernel computes, in bytes (parent, tokens and suffix)
MIN_INPUT, MAX_INPUT = 17, 240


@njit(cache=True, inline="always")
def _fold(a, b):
    """The 128-bit product of `a` and `b`, its halves xor-ed (`XXH3_mul128_fold64`), from
    32-bit halves: numba has no 128-bit integer."""
    a_lo = a & _LOW32
    a_hi = a >> uint64(32)
    b_lo = b & _LOW32
    b_hi = b >> uint64(32)
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    cross = (lo_lo >> uint64(32)) + (hi_lo & _LOW32) + lo_hi
    upper = (hi_lo >> uint64(32)) + (cross >> uint64(32)) + a_hi * b_hi
    lower = (cross << uint64(32)) | (lo_lo & _LOW32)
    return lower ^ upper


@njit(cache=True, inline="always")
def _avalanche(h):
    h ^= h >> uint64(37)
    h *= _MX
    return h ^ (h >> uint64(32))


@njit(cache=True, inline="always")
def _read64(words, offset):
    """The little-endian 64-bit word at byte `offset` (a multiple of 4) of `words` (uint32)."""
    q = offset >> 2
    return uint64(words[q]) | (uint64(words[q + 1]) << uint64(32))


@njit(cache=True, inline="always")
def _mix32(lo, hi, words, at1, at2, secret, s):
    """XXH3's `XXH128_mix32B`: 16 input bytes at `at1` and 16 at `at2` into the accumulator."""
    a1 = _read64(words, at1)
    b1 = _read64(words, at1 + 8)
    a2 = _read64(words, at2)
    b2 = _read64(words, at2 + 8)
    lo += _fold(a1 ^ secret[s], b1 ^ secret[s + 8])
    lo ^= a2 + b2
    hi += _fold(a2 ^ secret[s + 16], b2 ^ secret[s + 24])
    hi ^= a1 + b1
    return lo, hi


@njit(cache=True)
def _xxh3_128(words, n, secret):
    """XXH3-128 (seed 0) of the first `n` bytes of `words`, 17 <= n <= 240: (low, high)."""
    lo = uint64(n) * _P1
    hi = uint64(0)
    if n <= 128:
        i = (n - 1) // 32
        while i >= 0:
            lo, hi = _mix32(lo, hi, words, 16 * i, n - 16 * (i + 1), secret, 32 * i)
            i -= 1
    else:
        for i in range(4):
            lo, hi = _mix32(lo, hi, words, 32 * i, 32 * i + 16, secret, 32 * i)
        lo = _avalanche(lo)
        hi = _avalanche(hi)
        for i in range(4, n // 32):
            lo, hi = _mix32(lo, hi, words, 32 * i, 32 * i + 16, secret, 3 + 32 * (i - 4))
        # the last 32 bytes, the halves swapped (and the seed negated: 0 here), secret at
        # 136 - 17 - 16 (`XXH3_SECRET_SIZE_MIN - XXH3_MIDSIZE_LASTOFFSET - 16`)
        lo, hi = _mix32(lo, hi, words, n - 16, n - 32, secret, 103)
    return _avalanche(lo + hi), uint64(0) - _avalanche(lo * _P1 + hi * _P4 + uint64(n) * _P2)


@njit(cache=True, inline="always")
def _byteswap(x):
    r = uint64(0)
    for k in range(8):
        r = (r << uint64(8)) | ((x >> uint64(8 * k)) & uint64(0xFF))
    return r


def _read_only(dtype, ndim: int = 1):
    return types.Array(dtype, ndim, "C", readonly=True)


# one explicit signature, read-only inputs (a writable array converts to it): compiled, or
# loaded from numba's cache, when the module is imported, never inside a timed cache call,
# and never again for another mix of writable and read-only arguments
@njit(
    types.void(
        _read_only(types.int32),
        types.int64,
        types.int64,
        types.int64,
        _read_only(types.uint32),
        _read_only(types.uint32),
        _read_only(types.uint64),
        types.Array(types.uint64, 1, "C"),
    ),
    cache=True,
)
def _chain(tokens, first, count, page_size, parent, suffix, secret, out):
    """Digests of `count` blocks of `tokens` (int32) from token `first`, chained from
    `parent` (4 uint32 words: the 16 digest bytes), each block's input followed by `suffix`
    (uint32 words), into `out` (2 x count uint64: each pair the digest's 16 bytes)."""
    num_words = 4 + page_size + suffix.size
    words = np.empty(num_words, dtype=np.uint32)
    words[:4] = parent
    words[4 + page_size :] = suffix
    n = 4 * num_words
    # indices from 0 within a slice: numba then knows them non-negative and reads without
    # its negative-index check (with `first + i * page_size` the loop took ~60% longer)
    blocks = tokens[first : first + count * page_size]
    for i in range(count):
        base = i * page_size
        for k in range(page_size):
            words[4 + k] = uint32(blocks[base + k])
        lo, hi = _xxh3_128(words, n, secret)
        # the canonical digest: the high half big-endian, then the low half; as words read
        # little-endian (the next block's parent and the output row), byte-swapped
        a = _byteswap(hi)
        b = _byteswap(lo)
        out[2 * i] = a
        out[2 * i + 1] = b
        words[0] = uint32(a & _LOW32)
        words[1] = uint32(a >> uint64(32))
        words[2] = uint32(b & _LOW32)
        words[3] = uint32(b >> uint64(32))


_DIGEST = np.dtype((np.void, 16))  # one item per digest, as `as_keys` makes them
_NO_SUFFIX = np.zeros(0, dtype=np.uint32)
_ROOT_WORDS = np.zeros(4, dtype=np.uint32)
# read-only, as a parent's or a suffix's `np.frombuffer` of bytes is: one mix of argument
# types fewer for numba to match at a first call (see `Xxh3Chain.__init__`)
_NO_SUFFIX.flags.writeable = False
_ROOT_WORDS.flags.writeable = False


class Xxh3Chain:
    """The chain for one page size: `digests(tokens, start, stop, parent, suffix)` equals
    `[xxh3_128_digest(H + block + suffix) ...]` chained from `parent`, as one void array."""

    def __init__(self, page_size: int) -> None:
        if not self.takes(page_size, 0):
            raise InvalidRequestError(
                f"the compiled xxh3_128 chain takes blocks of {MIN_INPUT}..{MAX_INPUT} bytes "
                f"(16 + 4 x page size): page size {page_size} is outside it"
            )
        self.page_size = page_size
        # numba's first call with each mix of writable and read-only arrays costs ~8 ms
        # (matching them to the signature): paid here, when a cache is made, not inside the
        # first timed cache calls. Parent and suffix words are always read-only; tokens
        # come both ways (Sequence.tokens is read-only, a workload's prompt array is not).
        tokens = np.zeros(page_size, dtype=np.int32)
        self.digests(tokens, 0, 1, None, b"")
        tokens.flags.writeable = False
        self.digests(tokens, 0, 1, bytes(16), b"")

    @staticmethod
    def takes(page_size: int, suffix_len: int) -> bool:
        """Whether a block of `page_size` tokens followed by `suffix_len` bytes is an input
        the kernel computes."""
        n = 16 + 4 * page_size + suffix_len
        return MIN_INPUT <= n <= MAX_INPUT and suffix_len % 4 == 0

    def digests(self, tokens: np.ndarray, start: int, stop: int, parent: bytes | None, suffix: bytes) -> np.ndarray:
        """The digests of full blocks `start .. stop-1` of `tokens` (int32, one-dimensional)
        chained from `parent` (None: the root, 16 zero bytes), `suffix` after each block's
        tokens (a multiple of 4 bytes), as a void array of 16-byte items. Checked before the
        loop runs: the compiled code reads without bounds checks."""
        count = stop - start
        if count <= 0:
            return np.empty(0, dtype=_DIGEST)
        if tokens.dtype != np.int32 or tokens.ndim != 1 or start < 0 or stop * self.page_size > tokens.size:
            raise InvalidRequestError(
                f"blocks {start}..{stop - 1} of {self.page_size} tokens are not in a 1-d int32 array of "
                f"{tokens.size} ({tokens.dtype}, {tokens.ndim}-d)"
            )
        if (parent is not None and len(parent) != 16) or not self.takes(self.page_size, len(suffix)):
            raise InvalidRequestError(
                f"a parent digest of 16 bytes and a suffix of a multiple of 4 bytes (with the block, at most "
                f"{MAX_INPUT}) are what the compiled chain takes, got {None if parent is None else len(parent)} "
                f"and {len(suffix)}"
            )
        out = np.empty(2 * count, dtype=np.uint64)
        parent_words = _ROOT_WORDS if parent is None else np.frombuffer(parent, dtype=np.uint32)
        suffix_words = np.frombuffer(suffix, dtype=np.uint32) if suffix else _NO_SUFFIX
        if not tokens.flags.c_contiguous:
            tokens = np.ascontiguousarray(tokens)
        _chain(tokens, start * self.page_size, count, self.page_size, parent_words, suffix_words, _SECRET_WORDS, out)
        return out.view(_DIGEST)
