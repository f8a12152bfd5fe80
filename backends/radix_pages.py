"""Page ids of the radix backend as int32 arrays: the free pool and the sequences' tables.

Page ids as Python ints in lists cost a reference-count update per page every time a list
is copied, joined or cut (at page size 1 that is every token of every prompt, several times
per request, each a likely cache miss). Here every move of page ids is a `memcpy` of an
int32 array, and a tree node takes its pages as a view of the table that computed them
(`RadixTree._node_pages`), not as a copy. No decision depends on which ids a table holds:
only how the ids are stored changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class PagePool:
    """The free page ids: recycled ids on a stack (last freed, first taken), then the
    never-used ids `fresh .. num_pages - 1`, created only when first handed out, so an
    unlimited pool costs nothing up front (the stack grows by doubling as pages come back).
    It does not check what it is given: the cache hands back only pages it handed out."""

    __slots__ = ("num_pages", "_stack", "_top", "_fresh")

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._stack = np.empty(min(num_pages, 1024), dtype=np.int32)
        self._top = 0  # recycled ids are `_stack[:_top]`
        self._fresh = 0  # the next never-used id

    @property
    def num_free(self) -> int:
        return self._top + self.num_pages - self._fresh

    def take(self, n: int) -> np.ndarray:
        """`n` free ids as a new array (the caller checked there are that many)."""
        out = np.empty(n, dtype=np.int32)
        self.take_into(out)
        return out

    def take_into(self, out: np.ndarray) -> None:
        """Fill `out` with free ids, as many as it holds (the caller checked there are)."""
        n = out.size
        k = min(n, self._top)
        if k:
            top = self._top
            out[:k] = self._stack[top - k : top]
            self._top = top - k
        if k < n:
            fresh = self._fresh
            out[k:] = np.arange(fresh, fresh + n - k, dtype=np.int32)
            self._fresh = fresh + n - k

    def give(self, pages: np.ndarray | list[int]) -> None:
        """Take `pages` back (copied: the caller keeps its array or list)."""
        n = len(pages)
        if not n:
            return
        top = self._top
        if top + n > self._stack.size:
            grown = np.empty(min(max(2 * self._stack.size, top + n), self.num_pages), dtype=np.int32)
            grown[:top] = self._stack[:top]
            self._stack = grown
        self._stack[top : top + n] = pages
        self._top = top + n

    def free_ids(self) -> list[int]:
        """Every free id (for invariants and tests)."""
        out = self._stack[: self._top].tolist()
        out += range(self._fresh, self.num_pages)
        return out


class PageTable:
    """A sequence's page table in a radix cache: page `i` of the sequence is `table[i]`.

    Read like a `list[int]` (length, an index gives an int, a slice a list, iteration ints,
    equal to a list of the same ids), held as int32 ids in a buffer that grows by doubling
    (a decode step appends one page without copying the table). The cache works on
    `array()`, a view of the ids, and tree nodes keep views of it for the pages they hold:
    the cache therefore only ever appends ids and rewrites slots no node views (the
    duplicates of a request's own pages, before it inserts them). A buffer outgrown stays
    alive, unchanged, as long as a node views it.
    """

    __slots__ = ("_buf", "_len")

    def __init__(self, capacity: int) -> None:
        self._buf = np.empty(max(capacity, 4), dtype=np.int32)
        self._len = 0

    def array(self) -> np.ndarray:
        """The ids, a view (the cache's and the tree's access; do not write it)."""
        return self._buf[: self._len]

    def append_slots(self, n: int) -> np.ndarray:
        """`n` more slots at the end, returned (a view) for the caller to fill at once."""
        start = self._len
        end = start + n
        if end > self._buf.size:
            grown = np.empty(max(end, 2 * self._buf.size), dtype=np.int32)
            grown[:start] = self._buf[:start]
            self._buf = grown
        self._len = end
        return self._buf[start:end]

    def extend(self, pages: np.ndarray | Iterable[int]) -> None:
        if pages.__class__ is not np.ndarray:
            pages = np.fromiter(pages, dtype=np.int32)
        self.append_slots(pages.size)[:] = pages

    def append(self, page: int) -> None:
        self.extend(np.array((page,), dtype=np.int32))

    def __setitem__(self, i: slice, pages: np.ndarray | list[int]) -> None:
        """Slots `i` (a slice, no longer than the table) now hold `pages`, as many: only
        slots no tree node views (a request's duplicates, before they are inserted)."""
        self._buf[: self._len][i] = pages

    # -- read as a list[int] ----------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        view = self._buf[: self._len]
        if i.__class__ is slice:
            return view[i].tolist()
        return int(view[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self._buf[: self._len].tolist())

    def tolist(self) -> list[int]:
        return self._buf[: self._len].tolist()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        view = self._buf[: self._len]
        if dtype is not None and dtype != view.dtype:
            return view.astype(dtype)
        return view.copy() if copy else view

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PageTable):
            return bool(np.array_equal(self.array(), other.array()))
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # mutable, like a list

    def __repr__(self) -> str:
        return f"PageTable({self.tolist()!r:.80})"
