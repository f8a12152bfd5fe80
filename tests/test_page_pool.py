"""The FIFO page pool behind `none` and `paged`."""

from __future__ import annotations

import pytest

from cachelib.page_pool import FifoPagePool


def test_fifo_order_and_counts():
    pool = FifoPagePool(5)
    assert pool.take(2) == [0, 1] and len(pool) == 3
    pool.give([1, 0])
    assert list(pool) == [2, 3, 4, 1, 0]
    assert pool.take(4) == [2, 3, 4, 1]
    with pytest.raises(IndexError):
        pool.take(2)
    assert pool.take(0) == [] and len(pool) == 1


def test_compaction_keeps_order():
    pool = FifoPagePool(10_000)
    taken = pool.take(9_000)
    pool.give(taken[:100])
    assert pool.take(1_000) == list(range(9_000, 10_000))
    assert pool.take(100) == list(range(100)) and len(pool) == 0
