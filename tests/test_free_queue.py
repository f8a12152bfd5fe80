"""The doubly linked free-block queue."""

from __future__ import annotations

import pytest

from cachelib.errors import InvariantViolation
from cachelib.free_queue import FreeBlockQueue, KVBlock


def ids(q: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in q]


def test_order_and_o1_operations():
    blocks = [KVBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4, 5] and len(q) == 6
    q.remove(blocks[3])
    assert ids(q) == [0, 1, 2, 4, 5]
    assert q.popleft() is blocks[0]
    assert [b.block_id for b in q.popleft_n(2)] == [1, 2]
    q.append(blocks[0])
    q.appendleft(blocks[3])
    assert ids(q) == [3, 4, 5, 0] and len(q) == 4
    q.append_n([blocks[2], blocks[1]])
    assert ids(q) == [3, 4, 5, 0, 2, 1]
    assert q.peek() is blocks[3]
    q.check()


def test_removed_block_has_no_links_and_errors():
    blocks = [KVBlock(i) for i in range(2)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[0])
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    with pytest.raises(ValueError):
        q.remove(blocks[0])
    with pytest.raises(IndexError):
        q.popleft_n(5)
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    assert q.popleft_n(0) == []


def test_check_detects_a_wrong_count():
    q = FreeBlockQueue([KVBlock(i) for i in range(3)])
    q.num_free = 2
    with pytest.raises(InvariantViolation):
        q.check()
