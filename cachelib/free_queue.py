"""The free-block queue: free blocks in eviction (LRU) order, head evicted first.

New blocks are taken from the head; blocks released with cached content go to the tail,
so the head is always the least recently used, and a cache hit takes a block out of the
middle (vLLM V1's `FreeKVCacheBlockQueue`).

Two implementations of the same order:

- `BlockQueue`, what apc uses: block ids in a numpy array, every operation on a whole
  request's blocks at once (C loops, not a Python loop per block), and the never-used ids
  held as a range, so a pool of 10**9 blocks costs nothing until its blocks are used.
- `FreeBlockQueue` over `KVBlock` objects: vLLM's doubly linked list, one Python step per
  block, kept as the plain reference `BlockQueue` is tested against.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from cachelib.errors import InvariantViolation

_HOLE = 0  # a slot of `BlockQueue._ring` whose block was removed or taken (slots hold id + 1)
_NOWHERE = np.iinfo(np.int64).min // 2  # `BlockQueue._pos` of an id not in the ring (any shift leaves it negative)


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


class BlockQueue:
    """Free block ids `0 .. num_blocks - 1` in eviction order, operated on in bulk.

    Layout: the queued ids sit in `_ring[_head:_tail]` (a numpy array, head first), each
    stored as id + 1 so that a hole is 0 and a fresh ring is `np.zeros` (memory the system
    hands out zeroed and lazily: growing or compacting writes only the entries). The
    never-used ids `_fresh .. num_blocks - 1` are not stored: they are a run that sits, in
    queue order, at ring index `_fresh_at`, between the ids put at the head (`appendleft_n`,
    left of it) and those put at the tail (`append_n`, right of it); at first the queue is
    exactly that run, ids in order. `remove_n` leaves holes (`_HOLE`) that `popleft_n`
    skips; the ring is compacted (holes dropped, entries re-centred) when an end fills up.
    `_pos[b] + _shift` is block `b`'s ring index (`_pos[b]` is `_NOWHERE` while it is not
    in the ring: a compaction that moves the entries without dropping holes only changes
    `_shift`, no position is rewritten); `_pos` grows with the
    ids handed out, so memory follows the blocks used, not `num_blocks`.

    Every operation takes or returns a whole batch: `popleft_n` (the first n, head first),
    `append_n` (to the tail, in order), `appendleft_n` (to the head, the first of them taken
    first), `remove_n` (from anywhere). Costs are per call plus a few C-level steps per id.
    """

    __slots__ = ("num_blocks", "num_free", "_fresh", "_fresh_at", "_ring", "_head", "_tail", "_pos", "_shift")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.num_free = num_blocks
        self._fresh = 0  # the next never-used id
        self._ring = np.zeros(64, dtype=np.int64)  # all holes
        self._head = self._tail = self._fresh_at = 32
        self._pos = np.full(0, _NOWHERE, dtype=np.int64)
        self._shift = 0

    def __len__(self) -> int:
        return self.num_free

    @property
    def num_used(self) -> int:
        """Ids handed out at least once (`0 .. num_used - 1`); the rest were never used."""
        return self._fresh

    # -- taking ----------------------------------------------------------------------

    def popleft_n(self, n: int) -> np.ndarray:
        """Take the first `n` ids out, head first. Raises `IndexError` if fewer are free."""
        if n > self.num_free:
            raise IndexError(f"asked for {n} blocks, {self.num_free} free")
        if n <= 0:
            return np.empty(0, dtype=np.int64)
        self.num_free -= n
        if self._fresh == self.num_blocks:  # no never-used ids left: one contiguous run
            return self._take(self._tail, n)
        front = self._take(self._fresh_at, n)  # the ids put at the head, before the run
        n -= front.size
        if not n:
            return front
        k = min(n, self.num_blocks - self._fresh)
        fresh = np.arange(self._fresh, self._fresh + k, dtype=np.int64)
        self._fresh += k
        self._grow_pos()
        n -= k
        parts = [front, fresh]
        if n:  # the run is used up: what was appended after it comes next
            parts.append(self._take(self._tail, n))
        return np.concatenate(parts) if front.size or n else fresh

    def popleft_one(self) -> int:
        """`popleft_n(1)`, as a plain int: a decode step's new block. The head entry (past
        any holes) or else the next never-used id, with scalar steps."""
        if not self.num_free:
            raise IndexError("asked for 1 block, 0 free")
        ring, head = self._ring, self._head
        fresh_left = self._fresh < self.num_blocks
        limit = self._fresh_at if fresh_left else self._tail
        while head < limit:
            entry = ring.item(head)
            if entry == _HOLE:  # holes (blocks a hit took) up to the next id: skip them a window at a time
                window = ring[head : min(limit, head + 64)]
                found = np.flatnonzero(window)
                if not found.size:
                    head += window.size
                    continue
                head += found.item(0)
                entry = ring.item(head)
            ring[head] = _HOLE  # (its position goes stale, as in `_take`)
            self._head = head + 1
            self.num_free -= 1
            return entry - 1
        self._head = head  # (past holes only)
        if not fresh_left:
            raise InvariantViolation("free queue: a free count with no id left")
        block = self._fresh  # nothing before the never-used run: its first id
        self._fresh = block + 1
        if block >= self._pos.size:
            self._grow_pos()
        self.num_free -= 1
        return block

    def _take(self, limit: int, n: int) -> np.ndarray:
        """Up to `n` queued ids from the head, not past ring index `limit`; the head moves
        past them (and past the holes before them)."""
        ring, head = self._ring, self._head
        parts = []
        while n and head < limit:
            stop = min(limit, head + n)
            window = ring[head:stop]
            # (slots hold id + 1, a hole 0: a window with no hole is its ids, less one, in one call)
            holes = window.size - np.count_nonzero(window)
            if holes and stop < limit:
                # holes (blocks hits took): a window wider by about twice as many slots
                # most often holds the n ids, found in one pass instead of a pass per window
                window = ring[head : min(limit, stop + 2 * holes + 16)]
                at = window.nonzero()[0]
                if at.size >= n:
                    end = at.item(n - 1) + 1
                    got = window[at[:n]]
                    got -= 1
                    window[:end] = _HOLE  # (positions of taken ids go stale: `_positions` sees it)
                    parts.append(got)
                    head += end
                    break
                window = ring[head:stop]
            got = window - 1 if not holes else window[window != _HOLE] - 1
            window.fill(_HOLE)
            parts.append(got)
            n -= got.size
            head = stop
        self._head = head
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def remove_n(self, ids: Any) -> None:
        """Take `ids` (blocks used before: a cached block a hit takes back) out from wherever
        they are. Raises `ValueError` (changing nothing) if one is not in the queue, was
        never used, or is named twice."""
        ids = np.asarray(ids, dtype=np.int64)
        if not ids.size:
            return
        pos = self._positions(ids)
        if (pos < 0).any() or len(set(ids.tolist())) != ids.size:
            bad = ids[pos < 0][:1].tolist() or ids[:1].tolist()
            raise ValueError(f"block {bad[0]} is not in the free queue (or named twice)")
        self._ring[pos] = _HOLE
        self._pos[ids] = _NOWHERE
        self.num_free -= ids.size

    def remove_queued(self, ids: np.ndarray) -> None:
        """`remove_n` for int64 ids >= 0 the caller knows are queued and distinct (apc's hit
        blocks with no user): their positions are exact, so no range or duplicate checks.
        Ids that are not where their position says go to `remove_n`, which raises."""
        if not ids.size:
            return
        try:
            pos = self._pos[ids]
        except IndexError:  # an id never handed out (or negative past the start)
            self.remove_n(ids)
            return
        pos += self._shift
        # a queued id's position is exact, and no slot holds an id that is not queued: so
        # the slots at `pos` (clipped into the ring) hold exactly `ids` iff all are queued
        ring = self._ring
        if np.count_nonzero(ring.take(pos, mode="clip") != ids + 1):
            self.remove_n(ids)
            return
        ring[pos] = _HOLE
        self._pos[ids] = _NOWHERE
        self.num_free -= ids.size

    # -- putting back ------------------------------------------------------------------

    def append_n(self, ids: Any) -> None:
        """Put `ids` at the tail in order (the first of them is evicted first)."""
        ids = np.asarray(ids, dtype=np.int64)
        k = ids.size
        if not k:
            return
        if self._tail + k > self._ring.size:
            self._compact(k)
        tail = self._tail
        np.add(ids, 1, out=self._ring[tail : tail + k])
        self._pos[ids] = np.arange(tail - self._shift, tail + k - self._shift)
        self._tail = tail + k
        self.num_free += k

    def appendleft_n(self, ids: Any) -> None:
        """Put `ids` at the head, in order: `ids[0]` becomes the head (taken first)."""
        ids = np.asarray(ids, dtype=np.int64)
        k = ids.size
        if not k:
            return
        if self._head < k:
            self._compact(k)
        head = self._head - k
        if k == 1:  # (apc's release: a table's last, partial block) scalar writes, no arrays
            block = ids.item(0)
            self._ring[head] = block + 1
            self._pos[block] = head - self._shift
            self._head = head
            self.num_free += 1
            return
        np.add(ids, 1, out=self._ring[head : self._head])
        self._pos[ids] = np.arange(head - self._shift, self._head - self._shift)
        self._head = head
        self.num_free += k

    def append(self, block: Any) -> None:
        """Put one block (an id, or anything with `__index__`) at the tail."""
        self.append_n([operator.index(block)])

    def appendleft(self, block: Any) -> None:
        """Put one block at the head."""
        self.appendleft_n([operator.index(block)])

    # -- reading ---------------------------------------------------------------------

    def ids(self, *, fresh: bool = True) -> np.ndarray:
        """Every free id, head first; `fresh=False` leaves out the never-used ones."""
        ring = self._ring
        if self._fresh == self.num_blocks or not fresh:
            span = ring[self._head : self._tail]
            return span[span != _HOLE] - 1
        front = ring[self._head : self._fresh_at]
        back = ring[self._fresh_at : self._tail]
        run = np.arange(self._fresh, self.num_blocks, dtype=np.int64)
        return np.concatenate([front[front != _HOLE] - 1, run, back[back != _HOLE] - 1])

    def __iter__(self) -> Iterator[int]:
        """Head (evicted first) to tail."""
        return iter(self.ids().tolist())

    def contains(self, ids: Any) -> np.ndarray:
        """Per id of `ids`, whether it is in the queue."""
        ids = np.asarray(ids, dtype=np.int64)
        return (self._positions(ids) >= 0) | (ids >= self._fresh)

    def check(self) -> None:
        """Raise `InvariantViolation` if positions, ring and count disagree."""
        ring, pos = self._ring, self._pos
        if not 0 <= self._head <= self._tail <= ring.size:
            raise InvariantViolation(f"free queue head {self._head} / tail {self._tail} outside its ring")
        if self._fresh < self.num_blocks and not self._head <= self._fresh_at <= self._tail:
            raise InvariantViolation("free queue: the never-used run lies outside the queue")
        if (ring[: self._head] != _HOLE).any() or (ring[self._tail :] != _HOLE).any():
            raise InvariantViolation("free queue: ids outside head..tail")
        at = np.arange(self._head, self._tail)
        span = ring[self._head : self._tail]
        live, where = span[span != _HOLE] - 1, at[span != _HOLE]
        if live.size and (live.min() < 0 or live.max() >= self._fresh):
            raise InvariantViolation("free queue holds an id that was never handed out")
        if np.unique(live).size != live.size:
            raise InvariantViolation("free queue holds an id twice")
        if pos.size < self._fresh or (pos[self._fresh :] != _NOWHERE).any():
            raise InvariantViolation(f"free queue tracks {pos.size} positions, {self._fresh} ids handed out")
        found = self._positions(np.arange(self._fresh))
        pos = pos[: self._fresh]
        if not np.array_equal(pos[live] + self._shift, where) or np.count_nonzero(found >= 0) != live.size:
            raise InvariantViolation("free queue links broken: a position does not point at its id")
        count = live.size + self.num_blocks - self._fresh
        if count != self.num_free:
            raise InvariantViolation(f"free queue holds {count} blocks, count says {self.num_free}")

    # -- internals ---------------------------------------------------------------------

    def _positions(self, ids: np.ndarray) -> np.ndarray:
        """Each id's ring index, -1 if it is not in the ring. `_pos` is only a hint: an id
        taken out keeps its old index, which then holds a hole or another id."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks})")
        if ids.size and ids.max() >= self._fresh:  # never-used ids have no position
            pos = np.full(ids.size, -1, dtype=np.int64)
            used = ids < self._fresh
            pos[used] = self._positions(ids[used])
            return pos
        hint = self._pos[ids] + self._shift
        ring = self._ring
        # a stale hint may point past the ring (compacted since) or be negative (not queued)
        found = ring[np.maximum(np.minimum(hint, ring.size - 1), 0)] == ids + 1
        found &= hint >= 0
        return np.where(found, hint, -1)

    def _grow_pos(self) -> None:
        """`_pos` covers the ids handed out so far (grown geometrically: an id never
        handed out has no position)."""
        have = self._pos.size
        if self._fresh > have:
            size = min(self.num_blocks, max(self._fresh, 2 * have, 1024))
            self._pos = np.concatenate([self._pos, np.full(size - have, _NOWHERE, dtype=np.int64)])

    def _compact(self, room: int) -> None:
        """Re-centre the entries in a ring with `room` free at both ends, dropping the holes
        if they are many (else the span moves as it is: one copy, positions shift by a
        constant instead of one write per entry)."""
        ring = self._ring
        span = ring[self._head : self._tail]
        if 4 * (span.size - np.count_nonzero(span)) <= span.size:  # at most a quarter holes
            n = span.size
            size = max(64, 4 * (n + room))
            new = np.zeros(size, dtype=np.int64)
            head = min((size - n) // 2, room + max(64, n // 8))
            new[head : head + n] = span
            delta = head - self._head
            self._shift += delta
            self._fresh_at += delta
            self._ring, self._head, self._tail = new, head, head + n
            return
        keep = span != _HOLE
        live = span[keep]
        before_run = int(np.count_nonzero(keep[: max(self._fresh_at - self._head, 0)]))
        size = max(64, 4 * (live.size + room))
        new = np.zeros(size, dtype=np.int64)  # holes; only the entries below are written
        # most of the room after the entries: appends (released cached blocks) are the common
        # way in, and the head side regains room as blocks are taken (so a full ring, a copy
        # of every entry, comes about half as often as with the room split evenly)
        head = min((size - live.size) // 2, room + max(64, live.size // 8))
        new[head : head + live.size] = live
        self._pos[live - 1] = np.arange(head - self._shift, head + live.size - self._shift)
        self._fresh_at = head + before_run
        self._ring, self._head, self._tail = new, head, head + live.size
