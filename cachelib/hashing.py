"""Chained block hashes: `H_i = hash(H_{i-1} || tokens of block i || extra keys of block i)`.

The parent hash makes equal tokens at different positions (or after different prefixes)
hash apart, so a table keyed by `H_i` identifies a whole prefix. Extra keys fold in what
else changes the KV: `cache_salt` on the first block, `lora_id` on every block, a
multimodal input's hash on every block it overlaps (DESIGN §4 apc).

Tokens enter as their little-endian int32 bytes, a fixed width per block, and each extra
key is length-prefixed, so the byte string of a block is unambiguous.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import xxhash

from cachelib.errors import InvalidRequestError
from cachelib.types import ExtraKeys

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


def _key(tag: bytes, payload: bytes) -> bytes:
    return tag + len(payload).to_bytes(4, "little") + payload


class BlockHasher:
    """Computes the chained hashes of a sequence's full blocks.

    `algorithm` is `xxh3_128` (default, fast, non-cryptographic) or `sha256`; `hash_fn`
    overrides both (tests use a deliberately colliding one).
    """

    def __init__(self, page_size: int, algorithm: str = "xxh3_128", hash_fn: HashFn | None = None) -> None:
        if hash_fn is not None and not callable(hash_fn):
            raise InvalidRequestError(f"hash_fn must be a function bytes -> bytes, got {hash_fn!r}")
        if hash_fn is None:
            try:
                hash_fn = HASH_ALGORITHMS[algorithm]
            except KeyError:
                raise InvalidRequestError(
                    f"unknown hash algorithm {algorithm!r}; choose one of {sorted(HASH_ALGORITHMS)}"
                ) from None
        self.page_size = page_size
        self.algorithm = algorithm if hash_fn is HASH_ALGORITHMS.get(algorithm) else "custom"
        self._fn = hash_fn

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
        return self._fn((ROOT_HASH if parent is None else parent) + block_tokens + extra)

    def hash_blocks(
        self, tokens: np.ndarray, extra: ExtraKeys, start: int, stop: int, parent: BlockHash | None
    ) -> list[BlockHash]:
        """Hashes of full blocks `start .. stop-1` of `tokens`, chained from `parent`
        (the hash of block `start - 1`, or None for the root)."""
        size = self.page_size
        if stop * size > tokens.size:
            raise InvalidRequestError(f"block {stop - 1} is not full ({tokens.size} tokens)")
        fn = self._fn
        h = ROOT_HASH if parent is None else parent
        span = np.ascontiguousarray(tokens[start * size : stop * size])
        # one C call turns the span into a list of per-block byte strings (a void view per
        # block): cheaper than slicing a bytes buffer block by block in the loop
        chunks = span.reshape(-1, size).view(np.dtype((np.void, 4 * size))).ravel().tolist()
        out: list[BlockHash] = []
        append = out.append
        if extra.mm:
            # Multimodal spans vary the extra keys block by block: the slow path.
            for i, chunk in enumerate(chunks):
                h = fn(h + chunk + self.extra_bytes(extra, start + i))
                append(h)
            return out
        first = 0
        if start == 0 and stop > 0 and extra.cache_salt is not None:
            h = fn(h + chunks[0] + self.extra_bytes(extra, 0))
            append(h)
            first = 1
        suffix = self.extra_bytes(extra, 1)  # the same for every later block
        if suffix:
            for chunk in chunks[first:]:
                h = fn(h + chunk + suffix)
                append(h)
        else:
            for chunk in chunks[first:] if first else chunks:
                h = fn(h + chunk)
                append(h)
        return out
