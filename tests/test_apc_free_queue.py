"""apc's bulk free queue (`BlockQueue`) against the linked list it replaces (`FreeBlockQueue`):
the same order after any sequence of batch operations, never-used ids held as a range."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cachelib.errors import InvariantViolation
from cachelib.free_queue import BlockQueue, FreeBlockQueue, KVBlock


def _ids(ref: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in ref]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("num_blocks", [1, 7, 40, 300])
def test_same_order_as_the_linked_list_under_random_batches(seed, num_blocks):
    rng = random.Random(seed)
    blocks = [KVBlock(i) for i in range(num_blocks)]
    ref = FreeBlockQueue(blocks)
    q = BlockQueue(num_blocks)
    out: list[int] = []  # ids taken, in no particular order
    for _ in range(200):
        op = rng.random()
        if op < 0.35 and len(ref):
            n = rng.randint(0, len(ref))
            want = [b.block_id for b in ref.popleft_n(n)]
            assert q.popleft_n(n).tolist() == want
            out += want
        elif op < 0.6 and out:
            batch = rng.sample(out, rng.randint(1, len(out)))
            for b in batch:
                out.remove(b)
            ref.append_n([blocks[b] for b in batch])
            q.append_n(batch)
        elif op < 0.8 and out:
            batch = rng.sample(out, rng.randint(1, len(out)))
            for b in batch:
                out.remove(b)
            for b in reversed(batch):
                ref.appendleft(blocks[b])
            q.appendleft_n(np.array(batch, dtype=np.int64))
        elif [b for b in _ids(ref) if b < q.num_used]:
            # a hit takes cached blocks out of the middle (never a never-used one)
            used = [b for b in _ids(ref) if b < q.num_used]
            batch = rng.sample(used, rng.randint(1, min(len(used), 5)))
            for b in batch:
                ref.remove(blocks[b])
            if rng.random() < 0.5:
                q.remove_n(batch)
            else:  # apc's way: ids it knows are queued, as an int64 array
                q.remove_queued(np.array(batch, dtype=np.int64))
            out += batch
        assert list(q) == _ids(ref)
        assert len(q) == len(ref)
        q.check()


def test_fresh_ids_sit_between_the_head_and_the_tail_entries():
    q = BlockQueue(10)
    taken = q.popleft_n(4)
    assert taken.tolist() == [0, 1, 2, 3] and q.num_used == 4
    q.append_n([1])  # evicted late: after every never-used id
    q.appendleft_n([3, 2])  # reused first
    assert list(q) == [3, 2, 4, 5, 6, 7, 8, 9, 1]
    assert list(q.ids(fresh=False)) == [3, 2, 1]
    assert q.popleft_n(4).tolist() == [3, 2, 4, 5]
    assert q.popleft_n(5).tolist() == [6, 7, 8, 9, 1]
    assert len(q) == 0 and q.num_used == 10
    q.check()


def test_errors_change_nothing():
    q = BlockQueue(5)
    q.append_n(q.popleft_n(3)[2:])  # 0 and 1 taken, 2 back at the tail
    assert list(q) == [3, 4, 2]
    with pytest.raises(IndexError):
        q.popleft_n(4)
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove_n([0])  # taken: not queued
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove_n([4])  # never used: only a used block is taken out of the middle
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove_n([2, 2])  # named twice
    for bad in ([0], [4], [2, 0]):  # the unchecked path sends what is not queued to remove_n
        with pytest.raises(ValueError, match="not in the free queue"):
            q.remove_queued(np.array(bad, dtype=np.int64))
    assert list(q) == [3, 4, 2] and len(q) == 3
    q.check()


def test_check_catches_a_wrong_count_and_a_broken_position():
    q = BlockQueue(6)
    q.append_n(q.popleft_n(3))
    q.check()
    q.num_free -= 1
    with pytest.raises(InvariantViolation, match="count"):
        q.check()
    q.num_free += 1
    q._pos[0] = q._pos[1]
    with pytest.raises(InvariantViolation, match="position"):
        q.check()


def test_a_billion_blocks_cost_nothing_until_used():
    q = BlockQueue(10**9)
    taken = q.popleft_n(1000)
    q.append_n(taken[::2])
    assert len(q) == 10**9 - 500 and q.num_used == 1000
    assert q._ring.nbytes + q._pos.nbytes < 100_000
    assert q.popleft_n(3).tolist() == [1000, 1001, 1002]
