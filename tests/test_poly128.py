"""`poly128`, apc's vectorised block hash: the numpy path equals its definition computed
one block at a time in plain integers, and an apc cache makes the same decisions with it
as with the byte chains (xxh3_128, sha256) it replaced as the default."""

from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

import cachelib.hashing as hashing
from backends.apc import APCCache
from cachelib import ExtraKeys, create_cache
from cachelib.hashing import BlockHasher
from cachelib.kv_events import PagesRemoved, PagesStored
from cachelib.types import MultiModalSpan, Sequence
from tests.helpers import drive_apc_alike

M64 = (1 << 64) - 1
P = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)


def fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


def reference(
    tokens: list[int], page: int, extra: ExtraKeys, start: int, stop: int, parent: bytes | None
) -> list[bytes]:
    """The module docstring's definition, block by block in Python integers: a word is a
    token pair (low token first) at an even page size, else one sign-extended token; its
    offset constant is splitmix64's output for the offset + 1; a lane's block value is the
    sum of the mixed words (lane 2: a second bijection of each), plus 64 bits each of the
    xxh3-128 of the block's extra-key bytes; `H_i = P * H_{i-1} + c_i` per lane."""
    pairs = page % 2 == 0
    words = page // 2 if pairs else page
    offsets = [fmix64(((k + 1) * 0x9E3779B97F4A7C15) & M64) for k in range(words)]
    extra_of = BlockHasher(page).extra_bytes
    a = b = 0
    if parent is not None:
        a, b = int.from_bytes(parent[:8], "little"), int.from_bytes(parent[8:], "little")
    out = []
    for blk in range(start, stop):
        toks = [t & 0xFFFFFFFF for t in tokens[blk * page : (blk + 1) * page]]
        if pairs:
            ws = [toks[2 * i] | (toks[2 * i + 1] << 32) for i in range(words)]
        else:
            ws = [t | (0xFFFFFFFF00000000 if t >> 31 else 0) for t in toks]  # sign-extended
        ca = cb = 0
        for w, r in zip(ws, offsets, strict=True):
            x = fmix64(w ^ r)
            ca += x
            cb += (((x >> 29) ^ x) * 0xD6E8FEB86659FD93) & M64
        key = extra_of(extra, blk)
        if key:
            d = xxhash.xxh3_128_intdigest(key)
            ca += d & M64
            cb += d >> 64
        a = (P[0] * a + ca) & M64
        b = (P[1] * b + cb) & M64
        out.append(a.to_bytes(8, "little") + b.to_bytes(8, "little"))
    return out


def random_extra(rng: random.Random, n_tokens: int) -> ExtraKeys:
    kind = rng.randrange(4)
    if kind == 0:
        return ExtraKeys()
    if kind == 1:
        return ExtraKeys(cache_salt=rng.choice(["a", "tenant"]), lora_id=rng.choice([None, 3]))
    if kind == 2:
        return ExtraKeys(lora_id=rng.randrange(1, 5))
    off = rng.randrange(max(1, n_tokens))
    return ExtraKeys(mm=(MultiModalSpan(off, rng.randrange(1, 9), rng.choice(["img", "audio"])),))


@pytest.mark.parametrize("few_words", [0, 16, 10**9])  # numpy always / the default / Python always
@pytest.mark.parametrize("page", [1, 2, 3, 4, 5, 16, 32])
def test_poly128_equals_its_definition(monkeypatch, page, few_words):
    """Random tokens (the whole int32 range, negatives included), random extra keys, and
    the blocks hashed in random pieces, each chained from the previous piece's last hash."""
    monkeypatch.setattr(hashing, "_FEW_WORDS", few_words)
    rng = random.Random(page * 1000 + few_words % 997)
    hasher = BlockHasher(page, "poly128")
    for _ in range(12):
        n = rng.randrange(1, 40)
        tokens = [rng.choice([rng.randrange(-(2**31), 2**31), rng.randrange(200)]) for _ in range(n * page)]
        arr = np.array(tokens, dtype=np.int32)
        extra = random_extra(rng, len(tokens))
        cuts = sorted({0, n, *rng.sample(range(n + 1), min(3, n + 1))})
        got, parent = [], None
        for lo, hi in zip(cuts, cuts[1:], strict=False):
            piece = hasher.hash_blocks(arr, extra, lo, hi, parent)
            got += piece
            parent = piece[-1] if piece else parent
        assert got == reference(tokens, page, extra, 0, n, None)
        # one block at a time from the recorded content (what verify_tokens' checks rehash)
        parent = None
        for blk in range(n):
            parent = hasher.hash_block(
                parent, arr[blk * page : (blk + 1) * page].tobytes(), hasher.extra_bytes(extra, blk)
            )
            assert parent == got[blk]


def test_poly128_tells_apart_what_the_chain_tells_apart():
    """Equal prefixes hash equal, and a change anywhere (one token, an extra key, the
    length) changes every hash from that block on: no equal hash among many near-identical
    prefixes (a collision would show up as a duplicate)."""
    hasher = BlockHasher(4, "poly128")
    base = np.arange(64, dtype=np.int32)
    seen: dict[bytes, tuple] = {}
    for pos in range(64):
        for delta in (1, -1, 1 << 16, 1 << 31):
            t = base.copy()
            t[pos] = np.int32((int(t[pos]) + delta + 2**31) % 2**32 - 2**31)
            hs = hasher.hash_blocks(t, ExtraKeys(), 0, 16, None)
            assert hs[: pos // 4] == hasher.hash_blocks(base, ExtraKeys(), 0, pos // 4, None)
            for i, h in enumerate(hs[pos // 4 :], pos // 4):
                assert seen.setdefault(h, (pos, delta, i)) == (pos, delta, i)
    salted = hasher.hash_blocks(base, ExtraKeys(cache_salt="x"), 0, 16, None)
    plain = hasher.hash_blocks(base, ExtraKeys(), 0, 16, None)
    assert all(a != b for a, b in zip(salted, plain, strict=True))
    zeros = hasher.hash_blocks(np.zeros(64, dtype=np.int32), ExtraKeys(), 0, 16, None)
    assert len(set(zeros)) == 16  # the same block content at 16 positions: 16 hashes


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_poly128_makes_the_byte_chains_decisions(page, seed):
    caches = [
        APCCache(num_pages=max(30, 160 // page), page_size=page, hash_algorithm=a)
        for a in ("poly128", "xxh3_128", "sha256")
    ]
    assert caches[0].hasher.algorithm == "poly128"
    drive_apc_alike(caches, seed, 200, salted=True)


def test_auto_picks_by_page_size():
    picked = {p: create_cache("apc", num_pages=8, page_size=p).hasher.algorithm for p in (1, 4, 8, 16, 32)}
    assert picked == {1: "poly128", 4: "poly128", 8: "poly128", 16: "xxh3_128", 32: "xxh3_128"}


def test_poly128_events_name_what_a_router_computes():
    """A default page-4 cache hashes with poly128, and the keys of its BlockStored events
    are what its `page_keys()` computes for the same tokens (how routers compare): a router
    stays consistent with the cache whatever the algorithm."""
    cache = create_cache("apc", num_pages=64, page_size=4)
    assert cache.hasher.algorithm == "poly128" and cache.page_keys().algorithm == "poly128"
    events: list = []

    class Listener:
        def on_kv_event(self, event):
            events.append(event)

    cache.subscribe(Listener())
    rng = random.Random(5)
    for i in range(30):
        toks = [rng.randrange(20) for _ in range(rng.randrange(5, 40))]
        s = Sequence(f"r{i}", toks, ExtraKeys(lora_id=rng.choice([None, 2])))
        m = cache.match(s)
        if cache.admit(s, m, len(s)) is not None:
            cache.commit(s, len(s))
            stored = [e for e in events if isinstance(e, PagesStored)]
            keys = cache.page_keys().keys(s.tokens, s.extra)
            if stored and len(s) // 4 > m.num_tokens // 4:
                assert stored[-1].keys == keys[m.num_tokens // 4 :]
            cache.release(s)
    assert any(isinstance(e, PagesRemoved) for e in events)


def test_replay_slice_decides_alike(shipped_trace):
    """The conversation trace's first requests, replayed at two page sizes under memory
    pressure: the same hit per request and the same evictions with poly128 as with xxh3."""
    from experiments.engine import CacheClient, replay

    for page, pages, limit in ((16, 4000, 150), (1, 60000, 40)):
        results = []
        for algorithm in ("poly128", "xxh3_128"):
            cache = create_cache("apc", num_pages=pages, page_size=page, hash_algorithm=algorithm)
            result = replay(CacheClient(cache), shipped_trace[:limit])
            results.append((result["hit_tokens"], result["evicted_pages"], result["per_request_hits"]))
        assert results[0] == results[1]
        assert results[0][0] > 0 and results[0][1] > 0  # hits and evictions both happened
