"""apc's hash tables against a plain model: for every hash, its cached blocks in the order
they were published; a lookup answers the oldest. `DictIndex` (one entry per hash, any hash
function) and `RunIndex` (one entry per commit, chained hashes), and whole caches on each."""

from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from backends.apc import APCCache
from cachelib import ExtraKeys
from cachelib.errors import InvariantViolation
from cachelib.hashing import BlockHasher, DictIndex, RunIndex
from tests.helpers import drive_apc_alike


def _fail(msg: str) -> None:
    raise InvariantViolation(msg)


def _model_run(model: dict[bytes, list[int]], hashes: list[bytes]) -> list[int]:
    out = []
    for h in hashes:
        if not model.get(h):
            break
        out.append(model[h][0])
    return out


#: hash families a custom hash_fn can be (DictIndex is exact for any function)
FAMILIES = {
    "xxh3": lambda k: xxhash.xxh3_128_digest(k.to_bytes(8, "little")),
    "short": lambda k: k.to_bytes(3, "little")[: 1 + k % 3],
    "same-prefix": lambda k: b"\0" * 8 + k.to_bytes(4, "little"),
    "colliding": lambda k: xxhash.xxh3_128_digest((k % 5).to_bytes(8, "little")),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("seed", range(6))
def test_dict_index_equals_the_model_under_random_batches(family, seed):
    make = FAMILIES[family]
    rng = random.Random(seed)
    index = DictIndex()
    index.cover(3000)
    model: dict[bytes, list[int]] = {}
    free = list(range(3000))
    rng.shuffle(free)
    cached: list[int] = []
    for _ in range(60):
        if rng.random() < 0.55 and free:
            blocks = [free.pop() for _ in range(min(len(free), rng.choice([1, 3, 40, 400])))]
            keys = [make(rng.randrange(600)) for _ in blocks]  # repeats, in and across batches
            index.add(np.array(blocks, dtype=np.int64), keys)
            for b, h in zip(blocks, keys, strict=True):
                model.setdefault(h, []).append(b)
            cached += blocks
        elif cached:
            gone = rng.sample(cached, min(len(cached), rng.choice([1, 5, 60, 500])))
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
        assert index.lookup(probe).tolist() == [model[h][0] if h in model else -1 for h in probe]
        assert dict(index.items()) == model
        assert index.first_run(probe) == _model_run(model, probe)
        assert len(index) == len(cached)


def _two_runs() -> tuple[RunIndex, list[int]]:
    """A RunIndex holding two runs of chained hashes (blocks 10..14 and 20..22)."""
    hasher = BlockHasher(2)
    index = RunIndex()
    index.cover(30)
    first = hasher.hash_blocks(np.arange(10, dtype=np.int32), ExtraKeys(), 0, 5, None)
    second = hasher.hash_blocks(np.arange(100, 106, dtype=np.int32), ExtraKeys(), 0, 3, None)
    index.add(np.arange(10, 15, dtype=np.int64), first, 0)
    index.add(np.arange(20, 23, dtype=np.int64), second, 0)
    index.check(_fail)
    return index, [10, 11, 12, 13, 14, 20, 21, 22]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda ix: ix._off.__setitem__(12, 3), "cached block 12 is not where its run says"),
        (lambda ix: ix._off.__setitem__(21, 10**6), "cached block 21 is not where its run says"),
        (lambda ix: ix._off.__setitem__(20, -1), "cached block 20 is not where its run says"),
        (lambda ix: ix._run.__setitem__(13, 99), "cached block 13 is not where its run says"),
        (lambda ix: ix._run.__setitem__(5, -2), "below -1"),
        (lambda ix: setattr(ix._runs[1], "live", 4), "run 1 counts 4 cached blocks, holds 3"),
        (lambda ix: ix._run.__setitem__(14, -1), "run 0 counts 5 cached blocks, holds 4"),
    ],
)
def test_run_index_check_finds_a_corrupted_layout(corrupt, message):
    index, _ = _two_runs()
    corrupt(index)
    with pytest.raises(InvariantViolation, match=message):
        index.check(_fail)


def test_run_index_items_are_every_cached_block_under_its_hash_oldest_first():
    index, blocks = _two_runs()
    items = index.items()
    assert sorted(b for _, members in items for b in members) == blocks
    assert all(index.digests(members) == [h] * len(members) for h, members in items)
    # a block published again under a hash already cached comes after the older one
    (h, [b]) = items[0]
    index.add(np.array([25], dtype=np.int64), [h], 0)
    assert dict(index.items())[h] == [b, 25]
    index.make_oldest(h, 25)
    assert dict(index.items())[h] == [25, b]


@pytest.mark.parametrize("seed", range(10))
def test_run_index_equals_the_model_on_chained_hashes(seed):
    """Commits of random prompts sharing prefixes (so equal blocks are published again, and
    runs start anywhere), random evictions: every walk answers as the model."""
    rng = random.Random(seed)
    hasher = BlockHasher(2)
    index = RunIndex()
    index.cover(4000)
    model: dict[bytes, list[int]] = {}
    free = list(range(4000))
    rng.shuffle(free)
    cached: dict[int, bytes] = {}
    stems = [[rng.randrange(4) for _ in range(rng.randrange(0, 30))] for _ in range(5)]
    for _ in range(120):
        if rng.random() < 0.6 and len(free) > 60:
            tokens = np.array(rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(2, 40))])
            hashes = hasher.hash_blocks(tokens, ExtraKeys(), 0, tokens.size // 2, None)
            start = len(_model_run(model, hashes))  # what a request would hit, then publish the rest
            start = rng.randrange(0, start + 1) if rng.random() < 0.3 else start  # or recompute some
            blocks = [free.pop() for _ in hashes[start:]]
            if blocks:
                index.add(np.array(blocks, dtype=np.int64), hashes[start:], start)
                for b, h in zip(blocks, hashes[start:], strict=True):
                    model.setdefault(h, []).append(b)
                    cached[b] = h
            probe = hashes + [b"never-seen-hash!"]  # (RunIndex keys are all 16 bytes)
        elif cached:
            gone = rng.sample(sorted(cached), min(len(cached), rng.choice([1, 4, 30])))
            index.remove(np.array(gone, dtype=np.int64))
            for b in gone:
                h = cached.pop(b)
                model[h].remove(b)
                if not model[h]:
                    del model[h]
                free.append(b)
            continue
        else:
            continue
        index.check(_fail)
        assert index.first_run(probe) == _model_run(model, probe)
        want = []
        for h in probe:
            if not model.get(h):
                break
            want.append(model[h])
        assert index.candidates(probe) == want
        assert sorted(index.digests(list(cached))) == sorted(cached.values())
        assert dict(index.items()) == model


def _constant(data: bytes) -> bytes:
    return b"\x07" * 16


@pytest.mark.parametrize("options", [{}, {"verify_tokens": True}, {"hash_algorithm": "sha256"}])
@pytest.mark.parametrize("seed", range(8))
def test_run_index_and_dict_make_the_same_decisions(monkeypatch, options, seed):
    """The same random calls (shared prefixes, decode, forks, releases, explicit evictions,
    memory pressure) on a cache with each table: the same matches, tables, copies, stats and
    LRU order after every call, and both pass check_invariants."""
    caches = []
    for kind in (DictIndex, RunIndex):
        monkeypatch.setattr(APCCache, "index_type", kind)
        caches.append(APCCache(num_pages=40, page_size=4, **options))
    assert isinstance(caches[0].index, DictIndex) and isinstance(caches[1].index, RunIndex)
    drive_apc_alike(caches, seed, 150)


def test_run_index_answers_an_older_block_from_a_run_that_starts_later():
    """Run X (positions 2..5) is older than run Y (0..5, duplicates of X at 2..5, committed
    after X's own first blocks were evicted): a lookup walks from Y's start but answers X's
    blocks at 2..5 (the oldest of each hash), even though Y alone covers the whole query."""
    hashes = BlockHasher(1).hash_blocks(np.arange(6, dtype=np.int32), ExtraKeys(), 0, 6, None)
    for kind in (RunIndex, DictIndex):
        index = kind()
        index.cover(20)
        index.add(np.array([0, 1]), hashes[:2], 0)  # Z
        index.add(np.array([2, 3, 4, 5]), hashes[2:], 2)  # X, after a hit on Z
        index.remove(np.array([0, 1]))  # Z evicted
        index.add(np.array([10, 11, 12, 13, 14, 15]), hashes, 0)  # Y: its blocks 2..5 duplicate X's
        assert index.first_run(hashes) == [10, 11, 2, 3, 4, 5], kind.__name__
        assert index.first_run(hashes[:4]) == [10, 11, 2, 3], kind.__name__
