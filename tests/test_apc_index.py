"""apc's hash table (`BlockIndex`, and `DictIndex` for small pools) against a plain model:
for every hash, its cached blocks in the order they were added; lookups answer the oldest."""

from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from backends.apc import APCCache
from cachelib import CopyOp, ExtraKeys, Sequence
from cachelib.errors import InvariantViolation
from cachelib.hashing import BlockIndex, DictIndex


def _fail(msg: str) -> None:
    raise InvariantViolation(msg)


#: hash families: the real one, and the kinds a custom hash_fn can be (all exact by design)
FAMILIES = {
    # 16 random bytes, the default (fast fingerprints)
    "xxh3": (16, lambda k: xxhash.xxh3_128_digest(k.to_bytes(8, "little"))),
    # 32 bytes (sha256's size)
    "wide": (32, lambda k: xxhash.xxh3_128_digest(k.to_bytes(8, "little")) * 2),
    # short digests of any length: padded fingerprints
    "short": (None, lambda k: k.to_bytes(3, "little")[: 1 + k % 3]),
    # equal fingerprints (first 8 bytes), different hashes: every lookup must confirm
    "same-fingerprint": (None, lambda k: b"\0" * 8 + k.to_bytes(4, "little")),
    # few distinct hashes: duplicates everywhere
    "colliding": (16, lambda k: xxhash.xxh3_128_digest((k % 5).to_bytes(8, "little"))),
}


@pytest.mark.parametrize("kind", [BlockIndex, DictIndex])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("seed", range(6))
def test_index_equals_the_model_under_random_batches(kind, family, seed):
    size, make = FAMILIES[family]
    rng = random.Random(seed)
    index = kind(size)
    num_blocks = 3000
    index.cover(num_blocks)
    model: dict[bytes, list[int]] = {}
    free = list(range(num_blocks))
    rng.shuffle(free)
    cached: list[int] = []
    for _ in range(60):
        if rng.random() < 0.55 and free:
            n = min(len(free), rng.choice([1, 3, 40, 400]))
            blocks = [free.pop() for _ in range(n)]
            # hashes repeat: from a small pool, so equal hashes meet in and across batches
            keys = [make(rng.randrange(600)) for _ in blocks]
            index.add(np.array(blocks, dtype=np.int64), keys)
            for b, h in zip(blocks, keys, strict=True):
                model.setdefault(h, []).append(b)
            cached += blocks
        elif cached:
            n = min(len(cached), rng.choice([1, 5, 60, 500]))
            gone = rng.sample(cached, n)
            index.remove(np.array(gone, dtype=np.int64))
            for b in gone:
                cached.remove(b)
                free.append(b)
                h = next(h for h, bs in model.items() if b in bs)
                model[h].remove(b)
                if not model[h]:
                    del model[h]
        index.check(_fail)
        probe = list(model) + [make(600 + i) for i in range(5)]
        want = [model[h][0] if h in model else -1 for h in probe]
        assert index.lookup(probe).tolist() == want
        assert all(index.members(h) == model[h] for h in model)
        assert {h: bs for h, bs in index.items()} == model
        assert len(index) == len(cached)
        assert sorted(np.flatnonzero(index.cached).tolist()) == sorted(cached)


@pytest.mark.parametrize("kind", [BlockIndex, DictIndex])
def test_first_run_stops_at_the_first_miss(kind):
    index = kind(16)
    index.cover(1000)
    keys = [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(900)]
    index.add(np.arange(700), keys[:700])
    assert index.first_run(keys) == list(range(700))
    index.remove(np.array([450]))
    assert index.first_run(keys) == list(range(450))
    assert index.first_run([keys[800], *keys]) == []


@pytest.mark.parametrize("kind", [BlockIndex, DictIndex])
def test_check_sees_a_block_under_another_hash(kind):
    index = kind(16)
    index.cover(10)
    index.add(np.arange(4), [xxhash.xxh3_128_digest(bytes([i])) for i in range(4)])
    index.check(_fail)
    index.digest[2] = xxhash.xxh3_128_digest(b"other")
    with pytest.raises(InvariantViolation):
        index.check(_fail)


def _constant(data: bytes) -> bytes:
    return b"\x07" * 16


@pytest.mark.parametrize("options", [{}, {"verify_tokens": True}, {"hash_fn": _constant, "verify_tokens": True}])
@pytest.mark.parametrize("seed", range(8))
def test_numpy_table_and_dict_make_the_same_decisions(monkeypatch, options, seed):
    """The same random calls (shared prefixes, decode, forks, releases, explicit evictions,
    memory pressure) on a cache with each table: the same matches, tables, copies, stats and
    LRU order after every call, and both pass check_invariants."""
    caches = []
    for big_pool in (1 << 40, 0):  # a dict, then the numpy table, for the same small pool
        monkeypatch.setattr(APCCache, "big_pool", big_pool)
        caches.append(APCCache(num_pages=40, page_size=4, **options))
    assert isinstance(caches[0].index, DictIndex) and isinstance(caches[1].index, BlockIndex)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    live: list[list[Sequence]] = []  # per cache, the same sequences by position
    for step in range(150):
        op = rng.random()
        if op < 0.4 or not live:
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            extra = ExtraKeys(lora_id=rng.choice([None, 1]))
            seqs = [Sequence(f"s{step}", toks, extra) for _ in caches]
            got = []
            for c, s in zip(caches, seqs, strict=True):
                m = c.match(s)
                ops = c.admit(s, m, len(s))
                if ops is not None:
                    c.commit(s, len(s))
                got.append((m.num_tokens, m.pages, ops, s.page_table))
            assert got[0] == got[1]
            if got[0][2] is not None:
                live.append(seqs)
        elif op < 0.6:
            seqs = rng.choice(live)
            n = rng.randrange(1, 9)
            new = [rng.randrange(1000, 2000) for _ in range(n)]
            got = []
            for c, s in zip(caches, seqs, strict=True):
                s.append(new)
                ops = c.grow(s, len(s))
                if ops is not None:
                    c.commit(s, len(s) - 1)
                got.append((ops, s.page_table, s.num_computed))
            assert got[0] == got[1]
        elif op < 0.7:
            parents = rng.choice(live)
            kids = [p.fork(f"f{step}") for p in parents]
            got = [c.fork(p, k) for c, p, k in zip(caches, parents, kids, strict=True)]
            assert got[0] == got[1] and all(o is None or isinstance(o, list) for o in got)
            assert all(isinstance(op_, CopyOp) for op_ in got[0] or [])
            if got[0] is not None:
                assert kids[0].page_table == kids[1].page_table
                live.append(kids)
        elif op < 0.95:
            seqs = live.pop(rng.randrange(len(live)))
            for c, s in zip(caches, seqs, strict=True):
                c.release(s)
        else:
            k = rng.randrange(0, 6)
            assert caches[0].evict(k) == caches[1].evict(k)
        for c in caches:
            c.check_invariants()
        assert caches[0].stats() == caches[1].stats()
        assert caches[0].cached_blocks_in_lru_order() == caches[1].cached_blocks_in_lru_order()
        assert list(caches[0].free_queue) == list(caches[1].free_queue)
