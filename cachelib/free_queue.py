"""A doubly linked queue of free blocks whose order is the eviction (LRU) order.

The links live on the blocks themselves, between two sentinels, so a cache hit can take a
block out of the middle in O(1) (vLLM V1's `FreeKVCacheBlockQueue` design; a `deque`
would need O(n) `remove`). New blocks are taken from the head; blocks released with
cached content go to the tail, so the head is always the least recently used.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from cachelib.errors import InvariantViolation


class KVBlock:
    """A physical KV block: id, reference count, content hash (None = not cached), and
    the free-queue links (both None while the block is not in the queue)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of blocks between a head and a tail sentinel.

    All operations are O(1) per block. A block is in the queue iff its links are set.
    """

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        self.append_n(list(blocks))

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[KVBlock]:
        """Head (evicted first) to tail."""
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def peek(self) -> KVBlock | None:
        node = self._head.next_free
        return None if node is self._tail else node

    def popleft(self) -> KVBlock:
        """Take the head block out. Raises `IndexError` when empty."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("free block queue is empty")
        nxt = block.next_free
        self._head.next_free = nxt
        nxt.prev_free = self._head
        block.prev_free = block.next_free = None
        self.num_free -= 1
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        """Take the first `n` blocks out, head first. Raises `IndexError` if fewer are free."""
        if n > self.num_free:
            raise IndexError(f"asked for {n} blocks, {self.num_free} free")
        out: list[KVBlock] = []
        if n <= 0:
            return out
        append = out.append
        block = self._head.next_free
        for _ in range(n):
            append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free -= n
        return out

    def remove(self, block: KVBlock) -> None:
        """Take `block` out from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        """Put `block` at the tail (evicted last)."""
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def append_n(self, blocks: list[KVBlock]) -> None:
        """Put `blocks` at the tail in order (the first of them is evicted first)."""
        if not blocks:
            return
        last = self._tail.prev_free
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free += len(blocks)

    def appendleft(self, block: KVBlock) -> None:
        """Put `block` at the head (taken first)."""
        first = self._head.next_free
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free += 1

    def check(self) -> None:
        """Raise `InvariantViolation` if the links are inconsistent or the count is wrong."""
        count = 0
        prev = self._head
        node = self._head.next_free
        while node is not self._tail:
            if node is None or node.prev_free is not prev:
                raise InvariantViolation(f"free queue links broken at {node}")
            count += 1
            if count > self.num_free:
                raise InvariantViolation("free queue longer than its count (a cycle?)")
            prev, node = node, node.next_free
        if self._tail.prev_free is not prev or count != self.num_free:
            raise InvariantViolation(f"free queue holds {count} blocks, count says {self.num_free}")
