"""apc's fast paths for a decode step and a lookup, each against the general path it
shortcuts: one free id popped (`BlockQueue.popleft_one`), one block hashed from the token
bytes, runs continued by a sequence's next blocks (`RunIndex.add`'s `after`, prefill chunks
included), a decode step's block added and evicted as ints (`RunIndex.add_one`,
`remove_one`), a lookup one run answers alone (`RunIndex._sole_run`), a hit proven in one
stretch (`RunIndex.holds`), and a hit proven once per epoch (`APCCache._verify_match`)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from backends.apc import APCCache
from cachelib import ExtraKeys, Sequence
from cachelib.errors import InvariantViolation
from cachelib.free_queue import BlockQueue
from cachelib.hashing import BlockHasher, DictIndex, RunIndex
from cachelib.types import MultiModalSpan


def _fail(msg: str) -> None:
    raise InvariantViolation(msg)


@pytest.mark.parametrize("seed", range(10))
def test_popleft_one_takes_what_popleft_n_takes(seed):
    """Two queues under the same random batches (holes from hits included): one takes a
    block at a time with `popleft_one`, the other with `popleft_n(1)`."""
    rng = random.Random(seed)
    num = rng.choice([5, 60, 500])
    one, bulk = BlockQueue(num), BlockQueue(num)
    out: list[int] = []
    took_past_a_hole = False
    for _ in range(400):
        op = rng.random()
        if op < 0.4 and len(bulk):
            for _ in range(min(len(bulk), rng.randint(1, 3))):
                head_hole = bulk._head < bulk._tail and bulk._ring[bulk._head] == 0
                want = int(bulk.popleft_n(1)[0])
                assert one.popleft_one() == want
                took_past_a_hole |= head_hole
                out.append(want)
        elif op < 0.7 and out:
            batch = rng.sample(out, rng.randint(1, len(out)))
            for b in batch:
                out.remove(b)
            side = "append_n" if rng.random() < 0.6 else "appendleft_n"
            getattr(one, side)(batch)
            getattr(bulk, side)(batch)
        else:
            queued = one.ids(fresh=False).tolist()
            if queued:  # a hit takes cached blocks out of the middle: holes
                batch = rng.sample(queued, rng.randint(1, min(len(queued), 8)))
                one.remove_queued(np.array(batch, dtype=np.int64))
                bulk.remove_queued(np.array(batch, dtype=np.int64))
                out += batch
        assert one.ids().tolist() == bulk.ids().tolist()
        assert len(one) == len(bulk)
        one.check()
        bulk.check()
    if num > 5:
        assert took_past_a_hole, "the random calls never put a hole at the head"


def test_popleft_one_skips_a_long_stretch_of_holes_and_then_takes_a_fresh_id():
    q = BlockQueue(1000)
    taken = q.popleft_n(300)
    q.append_n(taken)  # 0..299 queued after the never-used run 300..999
    q2 = BlockQueue(1000)
    q2.append_n(q2.popleft_n(1000))  # no never-used ids: 0..999 in the ring
    q2.remove_queued(np.arange(0, 200, dtype=np.int64))  # 200 holes at the head
    assert q2.popleft_one() == 200
    q2.check()
    assert q.popleft_one() == 300  # the never-used run comes before the appended ids
    q.check()


def test_one_block_hashes_equal_the_bulk_ones_under_every_kind_of_extra_key():
    """A sequence decoded one block at a time through the cache hashes each block from its
    token bytes (`hash_block`); the chain must equal `hash_blocks` over the whole sequence,
    with a salt (first block only), a LoRA (every block) and multimodal spans (some blocks)."""
    rng = np.random.default_rng(0)
    extras = [
        ExtraKeys(),
        ExtraKeys(cache_salt="s1"),
        ExtraKeys(lora_id=3),
        ExtraKeys(cache_salt="s2", lora_id=5, mm=(MultiModalSpan(offset=5, length=20, mm_hash="img"),)),
    ]
    for algorithm in ("xxh3_128", "sha256"):
        for extra in extras:
            cache = APCCache(200, 4, hash_algorithm=algorithm)
            seq = Sequence("a", rng.integers(0, 1000, 6).astype(np.int32), extra)
            cache.admit(seq, cache.match(seq), len(seq))
            cache.commit(seq, len(seq))
            for _ in range(30):  # decode: a block is committed each time one fills
                seq.append_token(int(rng.integers(0, 1000)))
                cache.grow(seq, len(seq))
                cache.commit(seq, len(seq))
            n = len(seq) // 4
            want = BlockHasher(4, algorithm).hash_blocks(seq.tokens, extra, 0, n, None)
            assert cache._block_hashes(seq, n)[:n] == want, (algorithm, extra)
            cache.check_invariants()


def test_token_bytes_reads_the_buffer_and_refuses_a_range_outside():
    seq = Sequence("a", np.arange(10, dtype=np.int32))
    seq.append_token(77)
    assert seq.token_bytes(8, 11) == np.array([8, 9, 77], dtype=np.int32).tobytes()
    with pytest.raises(IndexError):
        seq.token_bytes(5, 12)


@pytest.mark.parametrize("seed", range(10))
def test_continued_runs_answer_as_the_model(seed):
    """Prompts committed after a hit, then decode blocks committed one (or a few) at a time
    with `after`, random evictions (mid-run too, ids recycled into later commits): every
    lookup, candidate list, digest and proof equals the model's, and runs were continued."""
    rng = random.Random(seed)
    hasher = BlockHasher(2)
    index = RunIndex()
    index.cover(600)
    model: dict[bytes, list[int]] = {}
    free = list(range(600))
    rng.shuffle(free)
    cached: dict[int, bytes] = {}
    stems = [[rng.randrange(3) for _ in range(rng.randrange(0, 20))] for _ in range(4)]
    commits = 0
    history: list[list[bytes]] = []

    def publish(blocks: list[int], hashes: list[bytes], start: int, after) -> None:
        nonlocal commits
        index.add(np.array(blocks, dtype=np.int64), hashes, start, after)
        commits += 1
        for b, h in zip(blocks, hashes, strict=True):
            model.setdefault(h, []).append(b)
            cached[b] = h

    def evict(gone: list[int]) -> None:
        index.remove(np.array(gone, dtype=np.int64))
        for b in gone:
            h = cached.pop(b)
            model[h].remove(b)
            if not model[h]:
                del model[h]
            free.append(b)  # (popped next: an evicted id comes back at once)

    def check(probe: list[bytes]) -> None:
        index.check(_fail)
        want = []
        for h in probe:
            if not model.get(h):
                break
            want.append(model[h][0])
        got = index.first_run(probe)
        assert got == want
        assert index.first_run(probe, list(probe)) == want
        assert index.holds(np.array(want, dtype=np.int64), probe[: len(want)])
        if len(want) > 1:  # a wrong block in the proof is refused
            wrong = want[:]
            wrong[-1] = next(b for b in cached if b not in want) if len(cached) > len(want) else -1
            if wrong[-1] >= 0:
                assert not index.holds(np.array(wrong, dtype=np.int64), probe[: len(want)])
        assert index.candidates(probe) == [model[h] for h in probe[: len(index.candidates(probe))]]
        assert dict(index.items()) == model
        # every run's own blocks as a proof: true iff each is still cached under its hash there
        for run in list(index._runs.values()):
            blocks, keys = run.blocks.copy(), run.keys.tolist()
            want_holds = all(cached.get(b) == k for b, k in zip(blocks.tolist(), keys, strict=True))
            assert index.holds(blocks, keys) == want_holds

    for _ in range(40):
        tokens = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(2, 16))]
        tokens += [rng.randrange(3) for _ in range(2 * rng.randrange(4, 20))]  # what decode adds
        arr = np.array(tokens, dtype=np.int32)
        hashes = hasher.hash_blocks(arr, ExtraKeys(), 0, arr.size // 2, None)
        prompt = min(len(hashes), rng.randrange(1, 12))
        hit = []
        for h in hashes[:prompt]:
            if not model.get(h):
                break
            hit.append(model[h][0])
        if rng.random() < 0.3:  # or recompute some of the hit: duplicates of cached blocks
            hit = hit[: rng.randrange(0, len(hit) + 1)]
        if len(free) < len(hashes) + 10:
            evict(rng.sample(sorted(cached), min(len(cached), 60)))
        table = hit[:]
        pos = len(hit)
        while pos < len(hashes):  # the prompt's rest in one commit, then decode's few at a time
            k = prompt - pos if pos < prompt else rng.choice([1, 1, 1, 2, 3])
            k = max(1, min(k, len(hashes) - pos))
            blocks = [free.pop() for _ in range(k)]
            after = (table[pos - 1], hashes[pos - 1]) if pos else None
            publish(blocks, hashes[pos : pos + k], pos, after)
            table += blocks
            pos += k
            if rng.random() < 0.15 and len(cached) > 4:  # an eviction mid-decode, of blocks not held
                held = set(table)
                loose = [b for b in cached if b not in held]
                if loose:
                    evict(rng.sample(loose, min(len(loose), rng.choice([1, 5]))))
        history.append(hashes)
        for probe in [hashes, *rng.sample(history, min(len(history), 4))]:  # earlier requests' too
            check(probe + [b"never-seen-hash!"])
    assert index._next_run < commits, "no commit continued a run"


def test_a_run_starting_inside_the_sole_runs_hit_still_answers_its_older_blocks():
    """Only one run starts at position 0, but an older one starts inside its hit: the
    one-run shortcut must give way to the full walk (positions 2..5 answer the older run)."""
    hashes = BlockHasher(1).hash_blocks(np.arange(6, dtype=np.int32), ExtraKeys(), 0, 6, None)
    for kind in (RunIndex, DictIndex):
        index = kind()
        index.cover(20)
        index.add(np.array([0, 1]), hashes[:2], 0)  # Z
        index.add(np.array([2, 3, 4, 5]), hashes[2:], 2)  # X, after a hit on Z
        index.add(np.array([10, 11, 12, 13, 14, 15]), hashes, 0)  # Y: duplicates Z and X
        index.remove(np.array([0, 1]))  # Z evicted: Y is the only run at position 0
        assert index.first_run(hashes) == [10, 11, 2, 3, 4, 5], kind.__name__
        assert index.holds(np.array([10, 11, 2, 3, 4, 5]), hashes), kind.__name__
        assert not index.holds(np.array([10, 11, 12, 3, 4, 5]), hashes[:5] + [hashes[4]]), kind.__name__


def test_a_run_that_lost_a_block_is_not_continued_so_a_recycled_id_is_never_offered_twice():
    """Run R (blocks 10..15) duplicates an older run's positions 0..4 and adds position 5;
    its block 10 is evicted and, recycled, is the next block of a sequence that ends on R's
    last block. Continuing R would list id 10 twice in it (offset 0 and 6) and offer it at
    position 0, where nothing is cached any more."""
    hashes = BlockHasher(1).hash_blocks(np.arange(7, dtype=np.int32), ExtraKeys(), 0, 7, None)
    index = RunIndex()
    index.cover(20)
    index.add(np.array([0, 1, 2, 3, 4]), hashes[:5], 0)  # the older run
    index.add(np.array([10, 11, 12, 13, 14, 15]), hashes[:6], 0)  # R
    index.remove(np.array([10]))
    # a sequence that hit the older run's 0..4 and R's 15 commits position 6 in block 10
    index.add(np.array([10]), hashes[6:7], 6, (15, hashes[5]))
    index.remove(np.array([0]))
    index.check(_fail)
    assert index.first_run(hashes) == []  # position 0: neither 0 nor R's old 10 is cached there
    assert index.first_run(hashes[1:]) == []
    assert not index.holds(np.array([10, 11]), hashes[:2])
    assert index.digests([10]) == [hashes[6]]


def test_a_decode_continues_its_run():
    """A sequence's one-block commits after its prompt's continue the prompt's run: one run
    for the whole sequence (what keeps a lookup's walk short), its blocks at the right places."""
    hashes = BlockHasher(1).hash_blocks(np.arange(12, dtype=np.int32), ExtraKeys(), 0, 12, None)
    index = RunIndex()
    index.cover(20)
    index.add(np.arange(8), hashes[:8], 0)
    for pos in range(8, 12):
        index.add(np.array([pos]), hashes[pos : pos + 1], pos, (pos - 1, hashes[pos - 1]))
    assert len(index._runs) == 1
    index.check(_fail)
    assert index.first_run(hashes) == list(range(12))
    assert index.holds(np.arange(12), hashes)
    assert [index.position(b) for b in range(12)] == list(range(12))


def test_a_sequences_prefill_chunks_continue_its_run_until_a_block_of_it_is_evicted():
    """Commits of any size that follow a run's last block (a chunked prefill's) continue it:
    one run per sequence. Once a block of the run is evicted, the next commit starts a run of
    its own (an evicted id may come back), and lookups still find every cached block."""
    hashes = BlockHasher(1).hash_blocks(np.arange(100, dtype=np.int32), ExtraKeys(), 0, 100, None)
    index = RunIndex()
    index.cover(100)
    index.add(np.arange(20), hashes[:20], 0)
    for lo in range(20, 60, 20):  # two chunks of 20 blocks
        index.add(np.arange(lo, lo + 20), hashes[lo : lo + 20], lo, (lo - 1, hashes[lo - 1]))
    assert len(index._runs) == 1
    assert index.first_run(hashes) == list(range(60))
    assert index.holds(np.arange(60), hashes[:60])
    index.remove(np.array([5]))
    index.add(np.arange(60, 80), hashes[60:80], 60, (59, hashes[59]))
    assert len(index._runs) == 2
    index.check(_fail)
    assert index.first_run(hashes) == list(range(5))
    assert [index.position(b) for b in range(60, 80)] == list(range(60, 80))
    assert index.digests([59, 60, 79]) == [hashes[59], hashes[60], hashes[79]]


@pytest.mark.parametrize("seed", range(5))
def test_add_one_and_remove_one_keep_the_index_that_add_and_remove_keep(seed):
    """The scalar paths of a decode step (`add_one`, `remove_one`) against `add` and
    `remove` of one-item arrays on a twin index: the same runs, lookups and digests, under
    random commits, continuations, evictions and recycled ids."""
    rng = random.Random(seed)
    hashes = BlockHasher(1).hash_blocks(
        np.array([rng.randrange(2) for _ in range(80)], np.int32), ExtraKeys(), 0, 80, None
    )
    fast, slow = RunIndex(), RunIndex()
    fast.cover(200)
    slow.cover(200)
    free = list(range(200))
    rng.shuffle(free)
    cached: list[int] = []
    for _ in range(30):  # a prompt, then its decode one block at a time
        n = rng.randrange(1, 10)
        blocks = [free.pop() for _ in range(n)]
        for index in (fast, slow):
            index.add(np.array(blocks, dtype=np.int64), hashes[:n], 0)
        cached += blocks
        for pos in range(n, min(80, n + rng.randrange(0, 12))):
            block = free.pop()
            fast.add_one(block, hashes[pos], pos, blocks[-1], hashes[pos - 1])
            slow.add(np.array([block], dtype=np.int64), [hashes[pos]], pos, (blocks[-1], hashes[pos - 1]))
            blocks.append(block)
            cached.append(block)
        evictions = rng.randrange(0, 6)
        while cached and (evictions > 0 or len(free) < 25):  # ids back to the free list
            gone = cached.pop(rng.randrange(len(cached)))
            fast.remove_one(gone)
            slow.remove(np.array([gone], dtype=np.int64))
            free.insert(0, gone)
            evictions -= 1
        fast.check(_fail)
        assert {r: (run.start, run.blocks.tolist(), run.keys.tobytes()) for r, run in fast._runs.items()} == {
            r: (run.start, run.blocks.tolist(), run.keys.tobytes()) for r, run in slow._runs.items()
        }
        assert fast.first_run(hashes) == slow.first_run(hashes)
        assert fast.digests(np.arange(200)) == slow.digests(np.arange(200))


def test_a_hit_proven_once_is_not_trusted_after_an_eviction():
    """`admit` skips proving a hit that `_match` (or `can_admit`) proved for the same
    sequence at the current epoch; a match whose pages were found before an eviction, even
    restamped with the current epoch, is proven again and refused."""
    from cachelib.errors import InvalidRequestError
    from cachelib.types import Match

    cache = APCCache(6, 4)
    a = Sequence("a", np.arange(1, 14, dtype=np.int32))
    cache.admit(a, cache.match(a), len(a))
    cache.commit(a, len(a))
    cache.release(a)
    b = Sequence("b", np.arange(1, 14, dtype=np.int32))
    m = cache.match(b)
    assert m.num_tokens == 12 and cache.can_admit(b, m, len(b))
    x = Sequence("x", np.arange(100, 120, dtype=np.int32))  # evicts a's blocks
    cache.admit(x, cache.match(x), len(x))
    cache.commit(x, len(x))
    cache.release(x)
    restamped = tuple.__new__(Match, (m.request_id, m.num_tokens, m.pages, m.handle, cache._epoch, m.owner))
    with pytest.raises(InvalidRequestError, match="hold other tokens"):
        cache.admit(b, restamped, len(b))
    fresh = cache.match(b)  # matched again: proven, and admitted
    assert cache.admit(b, fresh, len(b)) == []
    cache.check_invariants()
