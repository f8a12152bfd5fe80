"""Chained block hashes and their extra keys."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from cachelib import ExtraKeys, InvalidRequestError
from cachelib.hashing import ROOT_HASH, BlockHasher
from cachelib.types import MultiModalSpan

TOKENS = np.arange(32, dtype=np.int32)


def test_chain_depends_on_every_earlier_block():
    h = BlockHasher(4)
    base = h.hash_blocks(TOKENS, ExtraKeys(), 0, 8, None)
    changed = TOKENS.copy()
    changed[5] = 999  # block 1
    other = h.hash_blocks(changed, ExtraKeys(), 0, 8, None)
    assert base[0] == other[0]
    assert all(a != b for a, b in zip(base[1:], other[1:], strict=True))


def test_incremental_equals_one_shot():
    h = BlockHasher(4)
    whole = h.hash_blocks(TOKENS, ExtraKeys(lora_id=3), 0, 8, None)
    first = h.hash_blocks(TOKENS, ExtraKeys(lora_id=3), 0, 3, None)
    rest = h.hash_blocks(TOKENS, ExtraKeys(lora_id=3), 3, 8, first[-1])
    assert first + rest == whole


def test_first_block_is_xxh3_128_of_root_and_token_bytes():
    import xxhash

    (got,) = BlockHasher(4).hash_blocks(TOKENS, ExtraKeys(), 0, 1, None)
    assert got == xxhash.xxh3_128_digest(ROOT_HASH + TOKENS[:4].tobytes())


def test_sha256_option():
    (got,) = BlockHasher(4, "sha256").hash_blocks(TOKENS, ExtraKeys(), 0, 1, None)
    assert got == hashlib.sha256(ROOT_HASH + TOKENS[:4].tobytes()).digest()


def test_extra_keys_salt_first_block_lora_every_block_mm_overlap():
    h = BlockHasher(4)
    assert h.extra_bytes(ExtraKeys(cache_salt="s"), 0) != b""
    assert h.extra_bytes(ExtraKeys(cache_salt="s"), 1) == b""
    assert h.extra_bytes(ExtraKeys(lora_id=1), 5) != b""
    mm = ExtraKeys(mm=(MultiModalSpan(6, 3, "img"),))  # tokens 6..8: blocks 1 and 2
    assert [bool(h.extra_bytes(mm, b)) for b in range(4)] == [False, True, True, False]


def test_salted_hashes_equal_the_slow_path():
    h = BlockHasher(4)
    extra = ExtraKeys(cache_salt="tenant", lora_id=7)
    fast = h.hash_blocks(TOKENS, extra, 0, 8, None)
    slow, parent = [], ROOT_HASH
    for b in range(8):
        parent = h._fn(parent + TOKENS[4 * b : 4 * b + 4].tobytes() + h.extra_bytes(extra, b))
        slow.append(parent)
    assert fast == slow


def test_unknown_algorithm_and_partial_block_are_errors():
    with pytest.raises(InvalidRequestError, match="unknown hash algorithm"):
        BlockHasher(4, "md5")
    with pytest.raises(InvalidRequestError, match="not full"):
        BlockHasher(4).hash_blocks(TOKENS[:6], ExtraKeys(), 0, 2, None)
