"""A FIFO pool of free page ids with bulk take/give in C-level slices.

Pages are handed out oldest-freed first, in id order initially, so runs are reproducible.
A `deque` would pop one id per Python call; a request of 12k tokens at page size 16 takes
~800 pages at once, so the pool keeps a list and a head index and slices.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class FifoPagePool:
    """Free page ids in FIFO order: `take(n)` from the front, `give(pages)` to the back."""

    __slots__ = ("_ids", "_head")

    def __init__(self, num_pages: int) -> None:
        self._ids: list[int] = list(range(num_pages))
        self._head = 0

    def __len__(self) -> int:
        return len(self._ids) - self._head

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids[self._head :])

    def take(self, n: int) -> list[int]:
        """The `n` oldest free pages. Raises `IndexError` if fewer are free."""
        if n > len(self):
            raise IndexError(f"asked for {n} pages, {len(self)} free")
        out = self._ids[self._head : self._head + n]
        self._head += n
        if self._head > 4096 and self._head * 2 > len(self._ids):
            del self._ids[: self._head]  # amortised compaction keeps the list bounded
            self._head = 0
        return out

    def give(self, pages: Iterable[int]) -> None:
        """Return pages; they are handed out again after every page already free."""
        self._ids.extend(pages)
