"""`PageTable`: a sequence's page ids as a growable integer buffer that reads like a list.

The contract's `Sequence.page_table` is a `list[int]` or one of these (cachelib/types.py):
apc and radix hand out these, so moving a prompt's thousands of page ids into a table is
one copy of an array, not a Python int per page.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class PageTable:
    """A sequence's page table: page `i` of the sequence is `table[i]`.

    Read like a `list[int]` (length, an index gives an int, a slice a list, iteration ints,
    equal to a list of the same ids), held as integer ids (`dtype`: int32 for radix, int64
    for apc) in a buffer that grows by doubling (a decode step appends one page without
    copying the table). A backend works on `array()`, a view of the ids, and may keep views
    of it (radix's tree nodes do, for the pages they hold): so it only ever appends ids and
    rewrites slots nothing views (radix: the duplicates of a request's own pages, before it
    inserts them). A buffer outgrown stays alive, unchanged, as long as something views it.
    Handing a table its ids as an array copies them once (`memcpy`); a list of Python ints
    would cost an object per page to build and a reference count per page to copy.
    """

    __slots__ = ("_buf", "_len")

    def __init__(self, capacity: int, dtype: type = np.int32) -> None:
        self._buf = np.empty(capacity if capacity > 4 else 4, dtype)  # (positional: numpy parses a keyword per call)
        self._len = 0

    @classmethod
    def of(cls, ids: np.ndarray, more: np.ndarray | None = None) -> PageTable:
        """A table holding `ids` (copied), then `more` if given (of the same dtype), of
        their dtype, with room to grow."""
        n = ids.size
        end = n if more is None else n + more.size
        table = cls(end + end // 8 + 16, ids.dtype.type)
        table._buf[:n] = ids
        if more is not None:
            table._buf[n:end] = more
        table._len = end
        return table

    def array(self) -> np.ndarray:
        """The ids, a view (the cache's and the tree's access; do not write it)."""
        return self._buf[: self._len]

    def item(self, i: int) -> int:
        """Id `i` (0 <= i < len) as a Python int, without a view or a numpy scalar: a
        decode step reads one or two ids."""
        return self._buf.item(i)

    def append_slots(self, n: int) -> np.ndarray:
        """`n` more slots at the end, returned (a view) for the caller to fill at once."""
        start = self._len
        end = start + n
        if end > self._buf.size:
            grown = np.empty(max(end, 2 * self._buf.size), dtype=self._buf.dtype)
            grown[:start] = self._buf[:start]
            self._buf = grown
        self._len = end
        return self._buf[start:end]

    def extend(self, pages: np.ndarray | Iterable[int]) -> None:
        if pages.__class__ is not np.ndarray:
            pages = np.fromiter(pages, dtype=self._buf.dtype)
        self.append_slots(pages.size)[:] = pages

    def append(self, page: int) -> None:
        end = self._len
        if end == self._buf.size:
            self.append_slots(1)[0] = page
        else:
            self._buf[end] = page
            self._len = end + 1

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
