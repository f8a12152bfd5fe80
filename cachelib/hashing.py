"""Chained block hashes: `H_i = hash(H_{i-1} || tokens of block i || extra keys of block i)`.

The parent hash makes equal tokens at different positions (or after different prefixes)
hash apart, so a table keyed by `H_i` identifies a whole prefix. Extra keys fold in what
else changes the KV: `cache_salt` on the first block, `lora_id` on every block, a
multimodal input's hash on every block it overlaps (docs/design.md §4 apc).

Tokens enter as their little-endian int32 bytes, a fixed width per block, and each extra
key is length-prefixed, so the byte string of a block is unambiguous.

The tables apc keeps cached blocks in, by hash, are here too: `RunIndex` (one entry per
run of commits, relying on the chaining above) and `DictIndex` (one entry per hash, for any hash
function). Both answer, per chain position, a hash's oldest cached block.

Algorithms (`BlockHasher(algorithm=...)`):

- `xxh3_128`, `sha256`: the byte chain above, one hash call per block (vLLM's
  construction; `sha256` is vLLM's default, xxh3-128 its fast option).
- `poly128` (apc's default at page sizes up to 8, `backends/apc.py`): the same kind of
  chain, computed for all of a call's blocks at once with numpy, so its cost is a few
  dozen numpy calls plus a few nanoseconds per token instead of a Python call per block. Per 64-bit lane, `H_i = P * H_{i-1} + c_i (mod 2**64)`
  with an odd multiplier `P`, where the block's content value `c_i` is the sum, over its
  words, of `fmix64(word ^ R_k)`: a word is a token pair at an even page size (one token
  otherwise, sign-extended), `R_k` a fixed random constant of its offset `k` in the block,
  `fmix64` MurmurHash3's bijective finaliser. A second lane uses another multiplier and
  `c'_i` from a second bijection of each mixed word, and a block with extra keys adds, per
  lane, 64 bits of the xxh3-128 of its extra-key bytes. The 16-byte hash is the two lanes
  (little-endian). Because `P` is invertible, the recurrence is a prefix sum,
  `H_i = P**i * (P * H_{-1} + sum_j c_j * P**-j)`: one `cumsum` per lane instead of a
  Python step per block, and still a chain (`hash_block` takes the parent alone).
  Collision argument: modelling the mixed words as independent uniform 64-bit values, two
  different prefixes differ in at least one block value `c_j` (or in length), whose term
  `(c_j - c'_j) * P**(i-j)` is uniform (P is odd, so multiplying by its power is a
  bijection) and independent of the rest: a lane collides with probability 2**-64, both
  lanes 2**-128, as for xxh3-128. A block that differs from another in one word never
  collides with it in a lane at all (`fmix64` is a bijection). Non-cryptographic: like
  xxh3, it is no defence against inputs crafted to collide (use `sha256`, or apc's
  `verify_tokens`, for that). Decisions equal the byte chains' except after a collision.
"""

from __future__ import annotations

import hashlib
import importlib.util
import operator
from collections.abc import Callable
from functools import partial
from itertools import takewhile
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import xxhash

from cachelib.errors import InvalidRequestError
from cachelib.types import ExtraKeys

if TYPE_CHECKING:  # (importing it imports numba: BlockHasher does so only when it chooses it)
    from cachelib.xxh3_chain import Xxh3Chain

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

#: `H_{-1}`: the parent of every first block. Fixed, so runs are reproducible.
ROOT_HASH: BlockHash = b"\x00" * 16


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


HASH_ALGORITHMS: dict[str, HashFn] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": _sha256,
}


_M64 = (1 << 64) - 1
_U = np.uint64


def _fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, in place (a bijection of uint64 with full avalanche)."""
    y = x >> _U(33)
    x ^= y
    x *= _U(0xFF51AFD7ED558CCD)
    np.right_shift(x, _U(33), out=y)
    x ^= y
    x *= _U(0xC4CEB9FE1A85EC53)
    np.right_shift(x, _U(33), out=y)
    x ^= y
    return x


def _inverse_mod_2_64(p: int) -> int:
    """The inverse of odd `p` modulo 2**64 (Newton's iteration doubles the correct bits)."""
    x = p
    for _ in range(6):
        x = (x * (2 - p * x)) & _M64
    return x


class Poly128:
    """The `poly128` block hashes (module docstring): two 64-bit lanes, each
    `H_i = P * H_{i-1} + c_i mod 2**64`, all of a call's blocks in a few numpy calls."""

    #: the lane multipliers (odd: invertible modulo 2**64)
    P = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pairs = page_size % 2 == 0  # a word is a token pair (else one token)
        self.words = page_size // 2 if self.pairs else page_size
        # R_k: a fixed random constant per word offset in a block (splitmix64 of k)
        k = np.arange(1, self.words + 1, dtype=np.uint64) * _U(0x9E3779B97F4A7C15)
        self.offsets = _fmix64(k)
        self._offsets = self.offsets.tolist()
        self._offsets_col = self.offsets[:, None]
        self._pinv = tuple(_inverse_mod_2_64(p) for p in self.P)
        self._pow = (np.ones(1, dtype=np.uint64),) * 2  # P**m, P**-m per lane, m < len
        self._ipow = (np.ones(1, dtype=np.uint64),) * 2

    def _powers(self, n: int) -> None:
        """Make the power tables hold exponents `0 .. n - 1` (doubling)."""
        have = self._pow[0].size
        if n <= have:
            return
        size = max(n, 2 * have)
        pows, ipows = [], []
        for p, q in zip(self.P, self._pinv, strict=True):
            for table, base in ((pows, p), (ipows, q)):
                factors = np.full(size, base, dtype=np.uint64)
                factors[0] = 1
                table.append(np.cumprod(factors))  # wraps modulo 2**64, as the recurrence does
        self._pow, self._ipow = tuple(pows), tuple(ipows)

    def values(self, span: np.ndarray, n: int) -> np.ndarray:
        """The content values of the `n` blocks of int32 tokens `span`: a (2, n) uint64
        array, lane by lane (`c_i` in row 0, `c'_i` in row 1)."""
        if self.pairs:
            w = np.ascontiguousarray(span, dtype="<i4").view("<u8").astype(np.uint64, copy=False)
        else:
            w = span.astype(np.int64).view(np.uint64)
        # word offset outermost: each offset's words of every block contiguous, so the sums
        # below are whole-row adds
        out = np.empty((2, self.words, n), dtype=np.uint64)
        x = np.bitwise_xor(w.reshape(n, self.words).T, self._offsets_col, out=out[0])
        _fmix64(x)
        y = np.right_shift(x, _U(29), out=out[1])  # the second lane's bijection of the mixed word
        y ^= x
        y *= _U(0xD6E8FEB86659FD93)
        # each block's sum over its words, by halving the rows (a few whole-array adds)
        width = self.words
        while width > 1:
            half = width // 2
            if width % 2:
                out[:, 0] += out[:, width - 1]
            out[:, :half] += out[:, half : 2 * half]
            width = half
        return np.ascontiguousarray(out[:, 0])

    def few_values(self, span: np.ndarray, n: int) -> list[list[int]]:
        """`values` in plain Python ints, for a few blocks (a decode step's): cheaper than
        numpy's per-call cost there. Same numbers (tests compare the two)."""
        if self.pairs:
            t = span.astype("<i4").view("<u8").tolist()
        else:
            t = span.astype(np.int64).view(np.uint64).tolist()
        offsets = self._offsets
        out = []
        for b in range(n):
            ca = cb = 0
            for w, r in zip(t[b * self.words : (b + 1) * self.words], offsets, strict=True):
                x = w ^ r
                x ^= x >> 33
                x = (x * 0xFF51AFD7ED558CCD) & _M64
                x ^= x >> 33
                x = (x * 0xC4CEB9FE1A85EC53) & _M64
                x ^= x >> 33
                ca += x
                cb += (((x >> 29) ^ x) * 0xD6E8FEB86659FD93) & _M64
            out.append([ca & _M64, cb & _M64])
        return out

    def few_chain(self, values: list[list[int]], parent: BlockHash | None) -> list[BlockHash]:
        """`chain` in plain Python ints (for `few_values`)."""
        (pa, pb) = self.P
        a = b = 0
        if parent is not None:
            a, b = int.from_bytes(parent[:8], "little"), int.from_bytes(parent[8:], "little")
        out = []
        for ca, cb in values:
            a = (pa * a + ca) & _M64
            b = (pb * b + cb) & _M64
            out.append(a.to_bytes(8, "little") + b.to_bytes(8, "little"))
        return out

    @staticmethod
    def extra_values(extra: bytes) -> tuple[int, int]:
        """What a block's extra-key bytes add to its two lane values."""
        d = xxhash.xxh3_128_intdigest(extra)
        return d & _M64, d >> 64

    def chain(self, values: np.ndarray, parent: BlockHash | None) -> np.ndarray:
        """The hashes of blocks with content `values` ((2, n) uint64, modified), chained
        from `parent`: a void array (`as_keys`), 16 bytes an item."""
        n = values.shape[1]
        self._powers(n)
        lanes = (
            (0, 0) if parent is None else (int.from_bytes(parent[:8], "little"), int.from_bytes(parent[8:], "little"))
        )
        for lane in (0, 1):
            row = values[lane]
            row *= self._ipow[lane][:n]
            np.cumsum(row, out=row)
            if lanes[lane]:
                row += _U((self.P[lane] * lanes[lane]) & _M64)
            row *= self._pow[lane][:n]
        keys = np.empty((n, 2), dtype="<u8")
        keys[:] = values.T
        return keys.view(np.dtype((np.void, 16))).ravel()

    def hash_block(self, parent: BlockHash | None, block_tokens: bytes, extra: bytes) -> BlockHash:
        values = self.values(np.frombuffer(block_tokens, dtype=np.int32), 1)
        if extra:
            values[:, 0] += np.array(self.extra_values(extra), dtype=np.uint64)
        return self.chain(values, parent)[0].tobytes()


#: up to this many words (a decode step's block or two), `poly128` computes in plain Python:
#: below it numpy's fixed cost per call exceeds the per-word work it saves
_FEW_WORDS = 16

#: algorithms computed for all of a call's blocks at once (not a bytes -> bytes function)
VECTOR_ALGORITHMS = ("poly128",)

#: how `BlockHasher` computes an `xxh3_128` chain of many blocks: `numba`, one compiled loop
#: (cachelib/xxh3_chain.py; numba is the `fast` extra); `python`, the `xxhash` package once
#: per block (the reference the compiled loop is tested against); `auto`, numba where it is
#: installed and takes the page size (up to 56 tokens), else python. The digests are equal
#: either way: only the time differs.
HASH_KERNELS = ("auto", "numba", "python")


def numba_installed() -> bool:
    """Whether the `fast` extra's numba can be imported (without importing it: ~0.25 s)."""
    return importlib.util.find_spec("numba") is not None


def _key(tag: bytes, payload: bytes) -> bytes:
    return tag + len(payload).to_bytes(4, "little") + payload


class BlockHasher:
    """Computes the chained hashes of a sequence's full blocks.

    `algorithm` is `xxh3_128` (default here, fast, non-cryptographic), `sha256`, or
    `poly128` (vectorised; module docstring); `hash_fn` overrides them all
    (tests use a deliberately colliding one). `kernel` (`HASH_KERNELS`) chooses how an
    `xxh3_128` chain of many blocks is computed; `self.kernel` says which one is used.
    """

    def __init__(
        self, page_size: int, algorithm: str = "xxh3_128", hash_fn: HashFn | None = None, kernel: str = "auto"
    ) -> None:
        if hash_fn is not None and not callable(hash_fn):
            raise InvalidRequestError(f"hash_fn must be a function bytes -> bytes, got {hash_fn!r}")
        if kernel not in HASH_KERNELS:
            raise InvalidRequestError(f"unknown hash kernel {kernel!r}; choose one of {list(HASH_KERNELS)}")
        self._poly: Poly128 | None = None
        if hash_fn is None and algorithm in VECTOR_ALGORITHMS:
            self._poly = Poly128(page_size)
        elif hash_fn is None:
            try:
                hash_fn = HASH_ALGORITHMS[algorithm]
            except KeyError:
                raise InvalidRequestError(
                    f"unknown hash algorithm {algorithm!r}; choose one of {sorted([*HASH_ALGORITHMS, *VECTOR_ALGORITHMS])}"
                ) from None
        self.page_size = page_size
        self._block_bytes = np.dtype((np.void, 4 * page_size))  # a block's int32 tokens as one item
        if self._poly is not None:
            self.algorithm = algorithm
        else:
            self.algorithm = algorithm if hash_fn is HASH_ALGORITHMS.get(algorithm) else "custom"
        self._fn = hash_fn
        #: the byte chains' function, `H_i = byte_fn(H_{i-1} + tokens + extra)` (None for
        #: poly128): what a caller hashing one block with plain bytes calls directly
        self.byte_fn: HashFn | None = hash_fn
        self._compiled = self._compiled_chain(kernel)
        #: `numba` where the compiled chain computes this hasher's chains of many blocks,
        #: else `python` (the `xxhash` package per block, hashlib, poly128's numpy, a hash_fn)
        self.kernel = "python" if self._compiled is None else "numba"

    def _compiled_chain(self, kernel: str) -> Xxh3Chain | None:
        """The compiled xxh3_128 chain for `kernel` (None: not used), or a clear error where
        `numba` was asked for and cannot be had."""
        if kernel == "python" or (kernel == "auto" and self.algorithm != "xxh3_128"):
            return None
        if self.algorithm != "xxh3_128":
            raise InvalidRequestError(f"hash kernel 'numba' computes xxh3_128 only, not {self.algorithm!r}")
        if not numba_installed():
            if kernel == "auto":
                return None
            raise InvalidRequestError("hash kernel 'numba' needs numba: pip install 'prefix-cache-lab[fast]'")
        from cachelib.xxh3_chain import Xxh3Chain  # (imports numba: only here, only when chosen)

        if kernel == "auto" and not Xxh3Chain.takes(self.page_size, 0):
            return None
        return Xxh3Chain(self.page_size)  # (`numba` at a page size it does not take: a clear error)

    def extra_bytes(self, extra: ExtraKeys, block: int) -> bytes:
        """The extra-key bytes of block number `block`."""
        parts = []
        if block == 0 and extra.cache_salt is not None:
            parts.append(_key(b"s", extra.cache_salt.encode()))
        if extra.lora_id is not None:
            parts.append(_key(b"l", extra.lora_id.to_bytes(8, "little")))
        if extra.mm:
            lo, hi = block * self.page_size, (block + 1) * self.page_size
            for span in extra.mm:
                if span.offset < hi and span.offset + span.length > lo:
                    parts.append(_key(b"m", span.mm_hash.encode()))
        return b"".join(parts)

    def hash_block(self, parent: BlockHash | None, block_tokens: bytes, extra: bytes) -> BlockHash:
        """The hash of one block from its parent's hash (None: the first block), its tokens'
        int32 bytes and its extra-key bytes (`extra_bytes`): what `hash_blocks` chains."""
        if self._poly is not None:
            return self._poly.hash_block(parent, block_tokens, extra)
        return self._fn((ROOT_HASH if parent is None else parent) + block_tokens + extra)

    def hash_blocks(
        self, tokens: np.ndarray, extra: ExtraKeys, start: int, stop: int, parent: BlockHash | None
    ) -> list[BlockHash]:
        """Hashes of full blocks `start .. stop-1` of `tokens`, chained from `parent`
        (the hash of block `start - 1`, or None for the root)."""
        size = self.page_size
        self._check_full(tokens, stop)
        if self._poly is not None:
            keys = self._poly_blocks(tokens, extra, start, stop, parent)
            return keys if keys.__class__ is list else keys.tolist()
        if self._compiled is not None:
            keys = self._compiled_blocks(tokens, extra, start, stop, parent)
            if keys is not None:
                return keys.tolist()
        fn = self._fn
        h = ROOT_HASH if parent is None else parent
        span = np.ascontiguousarray(tokens[start * size : stop * size])
        # one C call turns the span into a list of per-block byte strings (a void view per
        # block): cheaper than slicing a bytes buffer block by block in the loop
        chunks = span.view(self._block_bytes).tolist()
        if extra.lora_id is None and not extra.mm and (start or extra.cache_salt is None):
            # no extra key (the common case): the plain chain, no `extra_bytes` call
            return [h := fn(h + chunk) for chunk in chunks]
        if extra.mm:
            # Multimodal spans vary the extra keys block by block: the slow path.
            return [h := fn(h + chunk + self.extra_bytes(extra, start + i)) for i, chunk in enumerate(chunks)]
        head: list[BlockHash] = []
        if start == 0 and stop > 0 and extra.cache_salt is not None:
            h = fn(h + chunks[0] + self.extra_bytes(extra, 0))
            head.append(h)
            chunks = chunks[1:]
        suffix = self.extra_bytes(extra, 1)  # the same for every later block
        # one comprehension, the chain carried in `h`: no method call per block
        if suffix:
            rest = [h := fn(h + chunk + suffix) for chunk in chunks]
        else:
            rest = [h := fn(h + chunk) for chunk in chunks]
        return head + rest if head else rest

    def hash_keys(
        self, tokens: np.ndarray, extra: ExtraKeys, start: int, stop: int, parent: BlockHash | None
    ) -> np.ndarray:
        """`hash_blocks` as one void array (`as_keys`): with poly128, no Python object per block."""
        if self._poly is not None:
            return as_keys(self._poly_blocks(tokens, extra, start, stop, parent))
        if self._compiled is not None:
            self._check_full(tokens, stop)
            keys = self._compiled_blocks(tokens, extra, start, stop, parent)
            if keys is not None:
                return keys
        return as_keys(self.hash_blocks(tokens, extra, start, stop, parent))

    def hash_blocks_and_keys(
        self, tokens: np.ndarray, extra: ExtraKeys, start: int, stop: int, parent: BlockHash | None
    ) -> tuple[list[BlockHash], np.ndarray | None]:
        """`hash_blocks`, and the same hashes as a void array where they were computed as
        one (the compiled chain: a caller keeping both forms then joins nothing), else None."""
        if self._compiled is not None:
            self._check_full(tokens, stop)
            keys = self._compiled_blocks(tokens, extra, start, stop, parent)
            if keys is not None:
                return keys.tolist(), keys
        return self.hash_blocks(tokens, extra, start, stop, parent), None

    def _check_full(self, tokens: np.ndarray, stop: int) -> None:
        if stop * self.page_size > tokens.size:
            raise InvalidRequestError(f"block {stop - 1} is not full ({tokens.size} tokens)")

    def _compiled_blocks(
        self, tokens: np.ndarray, extra: ExtraKeys, start: int, stop: int, parent: BlockHash | None
    ) -> np.ndarray | None:
        """`hash_keys` by the compiled chain (`_check_full` by the caller), or None where
        its input is not one it takes: multimodal spans (they vary block by block), a
        suffix that is not a multiple of 4 bytes (e.g. a `lora_id` key), tokens that are
        not int32 (the package path hashes their bytes as they are)."""
        if extra.mm or tokens.dtype != np.int32:
            return None
        chain = self._compiled
        suffix = b"" if extra.lora_id is None else self.extra_bytes(extra, 1)  # every block after the first
        if not chain.takes(self.page_size, len(suffix)):
            return None
        if start == 0 and stop > 0 and extra.cache_salt is not None:
            # the salt enters block 0 alone: that block by the package, the rest chained from it
            size = self.page_size
            first = self.hash_block(None, tokens[:size].tobytes(), self.extra_bytes(extra, 0))
            rest = chain.digests(tokens, 1, stop, first, suffix)
            return np.concatenate([as_keys([first]), rest])
        return chain.digests(tokens, start, stop, parent, suffix)

    def _poly_blocks(
        self, tokens: np.ndarray, extra: ExtraKeys, start: int, stop: int, parent: BlockHash | None
    ) -> list[BlockHash] | np.ndarray:
        """`hash_blocks` for `poly128`: every block's values at once, extra keys added per
        block; a list from the plain-Python path (a few blocks), else a void array."""
        self._check_full(tokens, stop)
        n = stop - start
        if n <= 0:
            return []
        poly = self._poly
        span = tokens[start * self.page_size : stop * self.page_size]
        few = n * poly.words <= _FEW_WORDS
        values = poly.few_values(span, n) if few else poly.values(span, n)
        if extra.cache_salt is not None or extra.lora_id is not None or extra.mm:
            if extra.mm:  # multimodal spans vary the extra keys block by block
                keys = [self.extra_bytes(extra, b) for b in range(start, stop)]
            else:  # the same for every block after the first
                later = self.extra_bytes(extra, 1)
                keys = [self.extra_bytes(extra, 0) if start == 0 else later] + [later] * (n - 1)
            memo: dict[bytes, tuple[int, int]] = {}
            add = np.zeros((n, 2), dtype=np.uint64)  # per block, its two lanes' additions
            for i, key in enumerate(keys):
                if key:
                    v = memo.get(key)
                    if v is None:
                        v = memo[key] = poly.extra_values(key)
                    if few:
                        values[i] = [(values[i][0] + v[0]) & _M64, (values[i][1] + v[1]) & _M64]
                    else:
                        add[i] = v
            if not few:
                values += add.T
        return poly.few_chain(values, parent) if few else poly.chain(values, parent)


_is_not_none = partial(operator.is_not, None)


class DictIndex:
    """The cached blocks by hash, one dict entry per hash (hash -> its oldest block, the
    younger ones listed apart): one dict operation per block published or evicted. Exact
    for any hash function; `RunIndex` does the same with no per-block table operation for
    hashes that chain (the built-in algorithms)."""

    #: False: it does not know a block's chain position (`RunIndex.position`)
    knows_positions: ClassVar[bool] = False
    #: False: it takes hashes as lists of bytes (any hash function's, any length)
    takes_arrays: ClassVar[bool] = False

    __slots__ = ("cached", "digest", "_first", "_dups")

    def __init__(self) -> None:
        self.cached = np.zeros(0, dtype=bool)
        self.digest = np.empty(0, dtype=object)
        self._first: dict[BlockHash, int] = {}
        self._dups: dict[BlockHash, list[int]] = {}

    def cover(self, num_blocks: int) -> None:
        """Make the per-block arrays hold ids `0 .. num_blocks - 1`."""
        more = num_blocks - self.cached.size
        if more > 0:
            self.cached = np.concatenate([self.cached, np.zeros(more, dtype=bool)])
            self.digest = np.concatenate([self.digest, np.full(more, None, dtype=object)])

    def __len__(self) -> int:
        return len(self._first) + sum(map(len, self._dups.values()))

    def cached_among(self, blocks: np.ndarray) -> np.ndarray:
        """Per block of `blocks` (ids covered), whether it is cached."""
        return self.cached[blocks]

    def is_cached(self, block: int) -> bool:
        return bool(self.cached.item(block))

    def remove_cached(self, blocks: np.ndarray) -> np.ndarray:
        """Uncache those of `blocks` that are cached, and return them in order."""
        victims = blocks[self.cached[blocks]]
        if victims.size:
            self.remove(victims)
        return victims

    def lookup(self, hashes: list[BlockHash]) -> np.ndarray:
        get = self._first.get
        return np.fromiter((get(h, -1) for h in hashes), dtype=np.int64, count=len(hashes))

    def first_run(self, hashes: list[BlockHash], listed: object = None) -> list[int]:
        return list(takewhile(_is_not_none, map(self._first.get, hashes)))

    def members(self, h: BlockHash) -> list[int]:
        first = self._first.get(h)
        return [] if first is None else [first, *self._dups.get(h, ())]

    def items(self) -> list[tuple[BlockHash, list[int]]]:
        return [(h, [b, *self._dups.get(h, ())]) for h, b in self._first.items()]

    def digests(self, blocks) -> list[BlockHash | None]:
        return self.digest[np.asarray(blocks, dtype=np.int64)].tolist()

    def holds(self, blocks: np.ndarray, hashes: list[BlockHash]) -> bool:
        """Whether each of `blocks` is cached under the hash at its place in `hashes`."""
        return self.digests(blocks) == hashes

    def candidates(self, hashes: list[BlockHash]) -> list[list[int]]:
        out = []
        for h in hashes:
            members = self.members(h)
            if not members:
                break
            out.append(members)
        return out

    def add(self, blocks: np.ndarray, hashes: list[BlockHash], start: int = 0, after: object = None) -> None:
        """Cache `blocks[i]` under `hashes[i]` (`start` and `after`, `RunIndex`'s, mean nothing here)."""
        self.cached[blocks] = True
        self.digest[blocks] = np.fromiter(hashes, dtype=object, count=len(hashes))  # (a list converts slower)
        ids = blocks.tolist()
        firsts = list(map(self._first.setdefault, hashes, ids))
        if firsts != ids:  # an equal block is cached already: this one is its duplicate
            for h, block, first in zip(hashes, ids, firsts, strict=True):
                if first != block:
                    self._dups.setdefault(h, []).append(block)

    def remove(self, blocks: np.ndarray) -> None:
        hashes = self.digest[blocks].tolist()
        if self._dups:
            for block, h in zip(blocks.tolist(), hashes, strict=True):
                self._remove_one(block, h)
        else:  # every hash has one block: its entry goes
            first = self._first
            for h in hashes:
                del first[h]
        self.digest[blocks] = None
        self.cached[blocks] = False

    def remove_one(self, block: int) -> None:
        """`remove` of one block given as an int."""
        self.remove(np.array([block], dtype=np.int64))

    def _remove_one(self, block: int, h: BlockHash) -> None:
        others = self._dups.get(h)
        if self._first[h] == block:
            if others:
                self._first[h] = others.pop(0)
            else:
                del self._first[h]
        elif others is not None:
            others.remove(block)
        if others is not None and not others:
            del self._dups[h]

    def reindex(self, block: int, h: BlockHash | None) -> None:
        """Cache `block` under `h` instead (None: uncache it), as the youngest of `h`'s
        blocks. For tests that corrupt a cache on purpose; not used by apc's own calls."""
        self.cover(block + 1)
        ids = np.array([block], dtype=np.int64)
        if self.cached[block]:
            self.remove(ids)
        if h is not None:
            self.add(ids, [h])

    def make_oldest(self, h: BlockHash, block: int) -> None:
        """Make `block` (cached under `h`) the oldest of `h`'s blocks (tests)."""
        members = self.members(h)
        if block not in members:
            raise KeyError(f"block {block} is not cached under that hash")
        if members[0] != block:
            others = [b for b in members if b != block]
            self._first[h] = block
            self._dups[h] = others

    def check(self, fail) -> None:
        has_digest = np.fromiter((d is not None for d in self.digest.tolist()), dtype=bool, count=self.cached.size)
        if not np.array_equal(has_digest, self.cached):
            b = int((has_digest != self.cached).nonzero()[0][0])
            fail(f"block {b} cached={bool(self.cached[b])} but its hash is {self.digest[b]!r:.20}")
        seen: set[int] = set()
        for h, dups in self._dups.items():
            if h not in self._first or not dups:
                fail("a duplicate list that is empty or whose hash has no oldest block")
        for h, members in self.items():
            for b in members:
                if b.__class__ is not int or not 0 <= b < self.cached.size or self.digest[b] != h or b in seen:
                    fail(f"block {b} is not cached under its hash once")
                seen.add(b)
        if seen != set(self.cached.nonzero()[0].tolist()):
            fail("the indexed blocks are not exactly the cached ones")


def as_keys(hashes: list[BlockHash] | np.ndarray) -> np.ndarray:
    """Hashes as one numpy void array, an item per hash (`RunIndex` keeps and compares them
    so: a run's hashes are one buffer, not a Python object per block). An array passes
    through; a list of equally long hashes (the built-in algorithms') is joined."""
    if isinstance(hashes, np.ndarray):
        return hashes
    if not hashes:
        return np.empty(0, dtype="V16")
    width = len(hashes[0])
    joined = b"".join(hashes)
    if len(joined) != width * len(hashes):
        raise InvalidRequestError("RunIndex needs hashes of one length (a custom hash_fn takes DictIndex)")
    return np.frombuffer(joined, dtype=f"V{width}")


#: a new run's buffers hold at least this many blocks more than its first commit's (`_Run`)
_RUN_ROOM = 64


class _Run:
    """Blocks at consecutive chain positions `start ..`: those one commit published, then
    those of the commits that continued it from its last block (`RunIndex.add`'s `after`).
    Their hashes and block ids are the first `size` items of buffers that grow
    geometrically, so continuing a run by a decode step's block copies nothing (`keys` and
    `blocks` are views made when read: a decode appends far more often than lookups read)."""

    __slots__ = ("id", "start", "first", "live", "size", "tail", "last", "_key_buf", "_block_buf")

    def __init__(self, run_id: int, start: int, keys: np.ndarray, blocks: np.ndarray) -> None:
        self.id = run_id
        self.start = start
        n = blocks.size
        # buffers with room past the commit's blocks: the sequence's decode (a few dozen
        # blocks at page 16, a few hundred at page 1) most often continues the run, and
        # then writes into them instead of copying both buffers to grow them
        size = n + max(_RUN_ROOM, n // 8)
        self._key_buf = np.empty(size, dtype=keys.dtype)  # a void array, one item per hash (see `as_keys`)
        self._key_buf[:n] = keys
        self._block_buf = np.empty(size, dtype=np.int64)  # (its own: the buffer grows in place)
        self._block_buf[:n] = blocks
        self.size = n
        self.live = n  # of its blocks, how many are still cached
        # (bytes of one-item slices: a void scalar costs more to make than the slice)
        self.first = keys[:1].tobytes()  # what `RunIndex._starts` files the run under
        # what `RunIndex._continued` asks, as plain Python objects: no numpy scalar per test
        self.tail = blocks.item(-1)
        self.last = keys[-1:].tobytes()

    @property
    def keys(self) -> np.ndarray:
        return self._key_buf[: self.size]

    @property
    def blocks(self) -> np.ndarray:
        return self._block_buf[: self.size]

    def extend(self, keys: np.ndarray, blocks: np.ndarray) -> None:
        """Append blocks (with their hashes) at the next chain positions."""
        n = self.size
        need = n + blocks.size
        self._room(need)
        self._key_buf[n:need] = keys
        self._block_buf[n:need] = blocks
        self._grown(need, blocks.item(-1), keys[-1:].tobytes())

    def append(self, block: int, key: BlockHash) -> None:
        """`extend` by one block, given as an int and its hash's bytes (a decode step's:
        `_grown` inlined)."""
        n = self.size
        if n == self._block_buf.size:
            self._room(n + 1)
        self._key_buf[n] = key
        self._block_buf[n] = block
        self.size = n + 1
        self.live += 1
        self.tail = block
        self.last = key

    def _room(self, need: int) -> None:
        if need > self._block_buf.size:
            n = self.size
            size = max(need, 2 * n)
            key_buf = np.empty(size, dtype=self._key_buf.dtype)
            key_buf[:n] = self._key_buf[:n]
            block_buf = np.empty(size, dtype=np.int64)
            block_buf[:n] = self._block_buf[:n]
            self._key_buf, self._block_buf = key_buf, block_buf

    def _grown(self, size: int, tail: int, last: BlockHash) -> None:
        self.live += size - self.size
        self.size = size
        self.tail = tail
        self.last = last


_NEVER = np.iinfo(np.int64).max


class RunIndex:
    """The cached blocks by *chained* hash, kept per run: a run is the blocks one commit
    published, at chain positions `start, start + 1, ...`, with their hashes, and those of
    the commits that continued it from its last block (a sequence's next prefill chunks and
    decode steps, `add`).
    Publishing a run is one dict operation (`_starts`: its first hash -> its id) and a few array writes
    (its hashes are one void array, `as_keys`, compared as machine words);
    evicting a block sets its run id to -1, its cached flag (a run goes when its last block does). No
    operation per block on a hash table.

    A lookup walks the chain: at each position the runs that start there are found by the
    position's hash (chained hashes: equal hashes mean equal prefixes, so a run holding a
    query's hash at position i starts at a position whose hash the query shares too), each
    run agrees with the query up to its first different hash, and the answer at a position
    is the oldest cached block (smallest commit order `seq`) of the runs covering it, as a
    hash table that keeps a hash's oldest block would answer. Exact for the built-in
    algorithms (a collision of xxh3-128 or sha256 aside, which misleads any hash table);
    a hash function that does not chain (tests' colliding ones) needs `DictIndex`.
    """

    #: True: `position(block)` is the chain position a cached block is indexed at
    knows_positions: ClassVar[bool] = True
    #: True: it keeps hashes as void arrays (`as_keys`) and takes them so (lists are joined)
    takes_arrays: ClassVar[bool] = True

    __slots__ = ("_run", "_off", "_seq", "_runs", "_starts", "_next_run", "_next_seq")

    def __init__(self) -> None:
        # per block: its run while cached, -1 while not (the cached flag itself: `cached`)
        self._run = np.zeros(0, dtype=np.int64)
        self._off = np.zeros(0, dtype=np.int64)  # per block: its place in its run
        self._seq = np.zeros(0, dtype=np.int64)  # per block: commit order (older = smaller)
        self._runs: dict[int, _Run] = {}
        self._starts: dict[BlockHash, list[int]] = {}  # first hash of a run -> run ids
        self._next_run = 0
        self._next_seq = 0

    def cover(self, num_blocks: int) -> None:
        """Make the per-block arrays hold ids `0 .. num_blocks - 1`."""
        more = num_blocks - self._run.size
        if more > 0:
            self._run = np.concatenate([self._run, np.full(more, -1, dtype=np.int64)])
            self._off = np.concatenate([self._off, np.zeros(more, dtype=np.int64)])
            self._seq = np.concatenate([self._seq, np.zeros(more, dtype=np.int64)])

    @property
    def cached(self) -> np.ndarray:
        """Per block id covered, whether it is cached (a new bool array, for reading: a
        block's run id is its flag, -1 uncached, so publishing and evicting write one array)."""
        return self._run >= 0

    def cached_among(self, blocks: np.ndarray) -> np.ndarray:
        """Per block of `blocks` (ids covered), whether it is cached."""
        return self._run[blocks] >= 0

    def is_cached(self, block: int) -> bool:
        return self._run.item(block) >= 0

    def __len__(self) -> int:
        return int(np.count_nonzero(self._run >= 0))

    # -- publishing and evicting ---------------------------------------------------------

    def add(
        self,
        blocks: np.ndarray,
        hashes: list[BlockHash] | np.ndarray,
        start: int = 0,
        after: tuple[int, BlockHash] | None = None,
    ) -> None:
        """Cache `blocks[i]` under `hashes[i]`, at chain positions `start + i`, as one run.
        `after` is the committing sequence's block at position `start - 1` and its hash (the
        parent of `hashes[0]`): when that block ends a run all of whose blocks are still
        cached, the blocks continue that run instead, so a sequence's prefill chunks and
        decode steps make one run, not one per commit (a lookup then walks one run where it
        walked one per chunk; the buffers grow geometrically, so continuing costs about what
        a new run's copy does). Exact: chained hashes make a
        query that agrees with the new blocks agree with the run's blocks before them, so
        each position is offered the same blocks; and a run whose blocks are all cached
        holds no block id twice (`_fold`'s ownership test)."""
        n = blocks.size
        if not n:
            return
        run = self._continued(after, start) if after is not None else None
        if run is None:
            r = self._next_run
            self._next_run += 1
            run = self._runs[r] = _Run(r, start, as_keys(hashes), blocks)
            self._starts.setdefault(run.first, []).append(r)
            off = 0
        else:
            r = run.id
            off = run.size
            if n == 1 and hashes.__class__ is list:  # a decode step's block: no array made
                run.append(int(blocks[0]), hashes[0])
            else:
                run.extend(as_keys(hashes), blocks)
        seq = self._next_seq
        self._next_seq = seq + n
        if n == 1:  # a decode step's block: scalar writes, cheaper than four fancy-indexed ones
            b = int(blocks[0])
            self._run[b] = r
            self._off[b] = off
            self._seq[b] = seq
            return
        self._run[blocks] = r
        self._off[blocks] = np.arange(off, off + n)
        self._seq[blocks] = np.arange(seq, seq + n)

    def add_one(self, block: int, h: BlockHash, start: int, prev: int, parent: BlockHash) -> None:
        """`add(blocks=[block], hashes=[h], start, after=(prev, parent))` for a decode step's
        block, given as plain ints and bytes: when it continues the run `prev` ends (the
        common case), scalar steps only; else `add` decides."""
        r = self._run.item(prev)
        run = self._runs.get(r)  # (r = -1, prev not cached: none)
        if (
            run is None
            or run.tail != prev
            or run.start + run.size != start
            or run.live != run.size
            or run.last != parent
        ):  # (`_continued`'s tests)
            self.add(np.array([block], dtype=np.int64), [h], start, (prev, parent))
            return
        off = run.size
        run.append(block, h)
        seq = self._next_seq
        self._next_seq = seq + 1
        self._run[block] = r
        self._off[block] = off
        self._seq[block] = seq

    def remove_one(self, block: int) -> None:
        """`remove([block])` for one cached block given as an int (a decode step's new
        block evicting its old content): scalar steps."""
        r = self._run.item(block)
        self._run[block] = -1
        run = self._runs[r]
        run.live -= 1
        if not run.live:
            self._forget(r, run)

    def _continued(self, after: tuple[int, BlockHash], start: int) -> _Run | None:
        """The run that blocks from chain position `start` on, after block `after[0]` cached
        under `after[1]`, continue (`add`), or None."""
        block, parent = after
        r = int(self._run[block])
        if r < 0:
            return None
        run = self._runs[r]
        if (
            run.tail != block
            or run.start + run.size != start
            or run.live != run.size  # an evicted block's id may come back as a new one
            or run.last != parent
        ):
            return None
        return run

    def remove(self, blocks: np.ndarray) -> None:
        """Uncache `blocks` (each cached, each once)."""
        if not blocks.size:
            return
        if blocks.size == 1:  # (a decode step's new block evicting one): scalar steps
            b = int(blocks[0])
            gone = {int(self._run[b]): 1}
            self._run[b] = -1
            self._drop(gone)
            return
        runs = self._run[blocks]
        self._run[blocks] = -1
        self._drop(self._stretches(runs))

    def remove_cached(self, blocks: np.ndarray) -> np.ndarray:
        """Uncache those of `blocks` (distinct ids, covered) that are cached, and return
        them in order: `remove(blocks[cached_among(blocks)])`, each block's run read once
        (apc's blocks taken from the free queue, most often all of them cached)."""
        runs = self._run[blocks]
        cached = runs >= 0
        k = np.count_nonzero(cached)
        if not k:
            return blocks[:0]
        if k != blocks.size:
            blocks, runs = blocks[cached], runs[cached]
        self._run[blocks] = -1
        self._drop(self._stretches(runs))
        return blocks

    @staticmethod
    def _stretches(runs: np.ndarray) -> dict[int, int]:
        """Per run id in `runs` (evicted blocks' runs), how many of its blocks: evicted in
        LRU order, a run's blocks come in a few stretches, counted a stretch at a time."""
        cut = (runs[1:] != runs[:-1]).nonzero()[0]  # (the last index of each stretch but the last)
        if not cut.size:
            return {runs.item(0): runs.size}
        ends = [*(cut + 1).tolist(), runs.size]
        gone: dict[int, int] = {}
        begin = 0
        for r, end in zip([*runs[cut].tolist(), runs.item(-1)], ends, strict=True):
            gone[r] = gone.get(r, 0) + end - begin
            begin = end
        return gone

    def _drop(self, gone: dict[int, int]) -> None:
        """Count `gone[r]` blocks of run `r` evicted; a run with none left goes."""
        for r, k in gone.items():
            run = self._runs[r]
            run.live -= k
            if not run.live:
                self._forget(r, run)

    def _forget(self, r: int, run: _Run) -> None:
        """Run `r`, with no block cached any more, goes."""
        del self._runs[r]
        others = self._starts[run.first]
        others.remove(r)
        if not others:
            del self._starts[run.first]

    # -- reading ---------------------------------------------------------------------

    def _fold(
        self, r: int, run: _Run, hashes: list[BlockHash], at: int, best: np.ndarray, best_block: np.ndarray
    ) -> None:
        """Offer run `r`'s blocks still cached in it for the positions where it agrees with
        `hashes` (a block evicted from the run and cached again elsewhere is not its own)."""
        n = self._agreement(run, hashes, at)
        blocks = run.blocks[:n]
        seq = self._seq[blocks]
        mine = self._run[blocks] == r
        if not mine.all():
            seq = np.where(mine, seq, _NEVER)
        window = best[at : at + n]
        older = seq < window
        window[older] = seq[older]
        best_block[at : at + n][older] = blocks[older]

    def first_run(self, hashes: list[BlockHash] | np.ndarray, listed: list[BlockHash] | None = None) -> list[int]:
        """The oldest cached block of each chain position of `hashes`, up to the first
        position with none. `listed`: the same hashes as bytes (at least as many), when the
        caller has them: the walk looks run starts up by them instead of converting."""
        hashes = as_keys(hashes)
        m = hashes.size
        runs, starts = self._runs, self._starts.get
        # only a run that starts at position 0 covers it: without one the walk ends there
        # (most lookups of a small cache), before any array is made
        if not m:
            return []
        first = hashes[:1].tobytes() if listed is None else listed[0]
        at_zero = [r for r in starts(first, ()) if runs[r].start == 0]
        if not at_zero:
            return []
        if len(at_zero) == 1:
            sole = self._sole_run(runs[at_zero[0]], hashes, listed)
            if sole is not None:
                return sole
        best = np.full(m, _NEVER, dtype=np.int64)
        best_block = np.full(m, -1, dtype=np.int64)
        # fold the runs starting at each position up to the first one still uncovered: a
        # run offers blocks only from its start on, so positions past that one cannot
        # change the answer (no window of lookups beyond the hit)
        lo, end = 0, 0  # scan run starts at positions lo .. end (end: first uncovered so far)
        while True:
            scan = hashes[lo : end + 1].tolist() if listed is None else listed[lo : end + 1]
            # the stretch's hashes that start a run, in order, found by C loops (`filter`,
            # `list.index` from the last one found on: each occurrence once, in order),
            # not by a Python step per position
            j = 0
            for h in filter(self._starts.__contains__, scan):
                j = scan.index(h, j)
                i = lo + j
                j += 1
                for r in starts(h):
                    run = runs[r]
                    if run.start == i:
                        self._fold(r, run, hashes, i, best, best_block)
            now = m  # the first uncovered position from `end` on (m: none)
            if end < m:
                gap = best[end:] == _NEVER
                k = int(gap.argmax())
                if gap[k]:
                    now = end + k
            if now == end:  # every position before it scanned, and it stays uncovered
                return best_block[:now].tolist()
            lo, end = end + 1, now

    def _sole_run(self, run: _Run, hashes: np.ndarray, listed: list[BlockHash] | None) -> list[int] | None:
        """`first_run`'s answer when `run` (the one run starting at position 0) answers
        alone: its blocks agreeing with `hashes` are all its own, and no other run starts
        at a position up to the first one it leaves uncovered (only such a run could offer
        an older block or reach further). None when that is not so: the general walk decides.
        The common lookup (a conversation's next turn) takes this path: no array per position."""
        n = self._agreement(run, hashes, 0)
        blocks = run.blocks[:n]
        if run.live != run.size and np.count_nonzero(self._run[blocks] != run.id):
            return None
        scan = hashes[1 : n + 1].tolist() if listed is None else listed[1 : n + 1]
        if any(map(self._starts.__contains__, scan)):
            return None
        return blocks.tolist()

    @staticmethod
    def _agreement(run: _Run, hashes: np.ndarray, at: int) -> int:
        """How many of `run`'s hashes equal `hashes[at:]`, from the first on (a chain: they
        agree up to a point, then never again)."""
        size = min(run.size, hashes.size - at)
        if size <= 0:
            return 0
        # compared as machine words; the first differing word's hash is the first that differs
        # (argmax of the flat comparison: a row-wise `any` over 2-word rows costs more than all else)
        differs = run.keys[:size].view(np.uint64) != hashes[at : at + size].view(np.uint64)
        k = int(differs.argmax())
        return k * size // differs.size if differs[k] else size

    def candidates(self, hashes: list[BlockHash]) -> list[list[int]]:
        """Per chain position of `hashes`, every cached block there, oldest first, up to
        the first position with none (for verify_tokens' walk)."""
        if isinstance(hashes, np.ndarray):
            hashes = hashes.tolist()
        out: list[list[int]] = []
        active: list[int] = []
        for i, h in enumerate(hashes):
            active += [r for r in self._starts.get(h, ()) if self._runs[r].start == i]
            here = []
            for r in active:
                run = self._runs[r]
                j = i - run.start
                if j < len(run.keys) and run.keys[j].tobytes() == h:
                    b = int(run.blocks[j])
                    if self._run[b] == r:
                        here.append((int(self._seq[b]), b))
            if not here:
                break
            out.append([b for _, b in sorted(here)])
        return out

    def digests(self, blocks) -> list[BlockHash | None]:
        """The hash each of `blocks` is cached under (None: not cached)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        runs = self._runs
        return [
            None if r < 0 else runs[r]._key_buf[o : o + 1].tobytes()
            for r, o in zip(self._run[blocks].tolist(), self._off[blocks].tolist(), strict=True)
        ]

    def holds(self, blocks: np.ndarray, hashes: list[BlockHash]) -> bool:
        """Whether each of `blocks` is cached under the hash at its place in `hashes`
        (`digests(blocks) == hashes`, compared a stretch of one run at a time: a match's
        blocks are a few runs' consecutive blocks)."""
        hashes = as_keys(hashes)
        if blocks.size != hashes.size:
            return False
        if not blocks.size:
            return True
        # most often one stretch of one run: its blocks there are `blocks` and each is still
        # its own (then at that offset: a run holds no block id twice, `add`)
        b0 = blocks.item(0)
        r, o = self._run.item(b0), self._off.item(b0)
        run = self._runs.get(r)
        n = blocks.size
        if (
            run is not None
            and run.blocks[o : o + n].tobytes() == blocks.tobytes()
            and run.keys[o : o + n].tobytes() == hashes.tobytes()
            and (run.live == run.size or not np.count_nonzero(self._run[blocks] != r))
        ):
            return True
        runs, offs = self._run[blocks], self._off[blocks]
        if (runs < 0).any():
            return False
        cut = ((runs[1:] != runs[:-1]) | (offs[1:] != offs[:-1] + 1)).nonzero()[0] + 1
        bounds = [0, *cut.tolist(), blocks.size]
        firsts = runs[bounds[:-1]].tolist()
        first_offs = offs[bounds[:-1]].tolist()
        for r, o, lo, hi in zip(firsts, first_offs, bounds, bounds[1:], strict=False):
            if self._runs[r].keys[o : o + hi - lo].tobytes() != hashes[lo:hi].tobytes():
                return False
        return True

    def items(self) -> list[tuple[BlockHash, list[int]]]:
        """(hash, its cached blocks oldest first) for every cached hash."""
        # the cached blocks oldest first (commit order; ties by id, as a sort of (seq, id)),
        # then every one's hash in one `digests`: grouped in that order, each hash's blocks
        # come out oldest first with no sort per hash (the invariant check reads all of
        # them: ~10^6 at unlimited capacity, where a call and a sort per block cost seconds)
        blocks = self.cached.nonzero()[0]
        blocks = blocks[np.argsort(self._seq[blocks], kind="stable")]
        groups: dict[BlockHash, list[int]] = {}
        for h, b in zip(self.digests(blocks), blocks.tolist(), strict=True):
            members = groups.get(h)
            if members is None:
                groups[h] = [b]
            else:
                members.append(b)
        return list(groups.items())

    def members(self, h: BlockHash) -> list[int]:
        return dict(self.items()).get(h, [])

    # -- for tests that corrupt a cache on purpose ---------------------------------------

    def position(self, block: int) -> int:
        run = self._runs[int(self._run[block])]
        return run.start + int(self._off[block])

    def reindex(self, block: int, h: BlockHash | None) -> None:
        """Cache `block` under `h` instead, at its chain position, as the youngest of `h`'s
        blocks (None: uncache it)."""
        self.cover(block + 1)
        cached = self.is_cached(block)
        at = self.position(block) if cached else 0
        ids = np.array([block], dtype=np.int64)
        if cached:
            self.remove(ids)
        if h is not None:
            self.add(ids, [h], at)  # (a run of its own)

    def make_oldest(self, h: BlockHash, block: int) -> None:
        members = self.members(h)
        if block not in members:
            raise KeyError(f"block {block} is not cached under that hash")
        if members[0] != block:
            self._seq[block] = self._seq[members[0]] - 1

    def check(self, fail) -> None:
        """Call `fail(message)` on the first broken invariant of the layout."""
        size = self._run.size
        if not self._off.size == self._seq.size == size:
            fail("index arrays of different sizes")
        if (self._run < -1).any():  # a run id is the cached flag: anything below -1 is neither
            fail("a block's run id is below -1 (-1 means not cached)")
        # every cached block where its run says, checked a run at a time (the cached blocks
        # grouped by run: one comparison per run, not a Python step per block)
        cached = self.cached.nonzero()[0]
        runs = self._run[cached]
        order = np.argsort(runs, kind="stable")
        cached, runs = cached[order], runs[order]
        bounds = [0, *(np.flatnonzero(runs[1:] != runs[:-1]) + 1).tolist(), cached.size] if cached.size else []
        for lo, hi in zip(bounds, bounds[1:], strict=False):  # (consecutive pairs)
            bs = cached[lo:hi]
            run = self._runs.get(runs.item(lo))
            if run is None:
                fail(f"cached block {bs.item(0)} is not where its run says")
            offs = self._off[bs]
            ok = (offs >= 0) & (offs < run.size)
            ok[ok] = run.blocks[offs[ok]] == bs[ok]
            if not ok.all():
                fail(f"cached block {bs[~ok].item(0)} is not where its run says")
        live = np.bincount(runs, minlength=self._next_run)
        for r, run in self._runs.items():
            if run.live != live[r] or not run.live:
                fail(f"run {r} counts {run.live} cached blocks, holds {live[r]}")
            if (
                len(run.keys) != run.blocks.size
                or run.first != run.keys[0].tobytes()
                or r not in self._starts.get(run.first, ())
            ):
                fail(f"run {r} is not indexed under its first hash")
        for h, rs in self._starts.items():
            for r in rs:
                if r not in self._runs or self._runs[r].first != h:
                    fail("a run start points at a run gone or with another first hash")
